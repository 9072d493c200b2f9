"""Serving: render the Triton model repository from settings and run an embedded tritonserver."""
