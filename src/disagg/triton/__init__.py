"""The Triton adapter: the only modules that import triton_python_backend_utils, each with one
job (pb: tensors, responses, errors; params: typed model parameters; bls: the contract of
calls between models; pools: the BLS prefill/decode pools and their serving side;
pb_metrics: metrics; runner: how entry models serve requests). Imported only inside a
Python backend stub, and unit-tested against tests/fakes/triton_python_backend_utils.py."""
