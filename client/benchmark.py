#!/usr/bin/env python3
"""Goodput benchmarks: seeded workloads, open-loop Poisson rate sweeps, SLO attainment.

  python client/benchmark.py run --workload chat --url 127.0.0.1:8001      # a running server
  python client/benchmark.py run --target gateway --url http://127.0.0.1:9000 \\
      --model smollm2-135m-instruct                                        # DISAGG_API_KEY set
  python client/benchmark.py compare                                       # the three modes

See docs/benchmarks.md for what it measures and the figures it gave.
"""

import sys

from disagg.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
