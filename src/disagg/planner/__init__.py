"""Deciding when to disaggregate and how many of each: a profiler, a simulator and a planner
(docs/planner.md).

    profile.py, costs.py     the profile file and its fitted cost models (torch-free)
    measure.py, handoff.py,  `disagg profile`: the real engine and KV paths timed here
      machine.py, recording.py
    topology.py              what is simulated: mode, replicas, engine limits, shared cores
    clock.py                 simulated time: the event loop, nodes that share their cores
    decode_sim.py            a decode engine that computes nothing (MIRROR of the real step)
    pools.py, simulator.py   the pools and the frontend in simulated time -> Timelines
    sweep.py                 a predicted sweep in the shape of bench's; traces
    simulate_cli.py, plan.py, options.py   `disagg simulate`, `disagg plan`
"""
