"""The Triton side of disagg: tensor contracts, orchestration logic and the one adapter module
(`pb.py`) that knows triton_python_backend_utils."""
