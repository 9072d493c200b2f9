"""The Triton adapter: the only modules that import triton_python_backend_utils, each with one
job (pb: tensors, responses, errors; params: typed model parameters; bls: the contract of
calls between models; pools: the orchestrator's BLS prefill/decode pools, caller side;
prefill_side, decode_side: the pool models' side of them; local_pipeline: the router's call
of the orchestrator; pb_metrics: metrics; runner: how entry models serve requests; the
tensors of every call: disagg.codec). Imported only inside a Python backend stub, and
unit-tested against tests/fakes/triton_python_backend_utils.py."""
