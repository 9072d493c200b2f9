"""A real tritonserver on loopback, shared by the tests of a module."""

from __future__ import annotations

import pytest
from helpers.triton_server import start_server


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    srv = start_server(engine_dir, tmp_path_factory.mktemp("triton"))
    yield srv
    srv.stop()
