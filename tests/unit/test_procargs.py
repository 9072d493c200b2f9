"""A secret on a child's command line is overwritten where `ps` reads it, and the child still
has the value it parsed."""

import subprocess
import sys

import pytest

from disagg.serve import procargs

pytestmark = pytest.mark.unit


def _ps_args(pid: int) -> str:
    return subprocess.run(
        ["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, check=True
    ).stdout


def test_a_secret_is_masked_in_ps_and_the_child_keeps_what_it_parsed():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; key = sys.argv[1]; print('ready', flush=True); "
            "sys.stdin.readline(); print(key, flush=True)",
            "--api=model-repository:admin-key=s3cret-value",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"  # it has read its arguments
        assert "s3cret-value" in _ps_args(child.pid)
        n = procargs.mask_when(child.pid, ["s3cret-value", ""], is_parsed=lambda: True)
        assert n == 1
        shown = _ps_args(child.pid)
        assert "s3cret-value" not in shown and "admin-key=************" in shown
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "--api=model-repository:admin-key=s3cret-value\n"
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_raises_oserror():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(OSError):
        procargs.mask_args(child.pid, ["x"])
