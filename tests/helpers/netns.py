"""A network link of the test's own: a network namespace joined to this one by a veth pair,
addresses on a /30 of 10.77.0.0/16 and nothing else (no route out, no forwarding). Taking
the namespace's end down is a partition (packets to it vanish: a connect times out);
`slowed` limits the link's rate with a token bucket (tc tbf: this kernel has no netem).
Needs root and iproute2."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


def available() -> str:
    """Why a link cannot be made here ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    probe = f"dgprobe{os.getpid() % 60000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:  # a container without CAP_NET_ADMIN / CAP_SYS_ADMIN
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class NetnsLink:
    def __init__(self) -> None:
        tag = os.getpid() % 60000
        self.ns = f"dgt{tag}"
        self.root_dev, self.ns_dev = f"dgt{tag}a", f"dgt{tag}b"
        net = 4 * (tag % 16000)  # a /30 of its own
        prefix = f"10.77.{net // 256 % 256}"
        self.root_addr, self.ns_addr = f"{prefix}.{net % 256 + 1}", f"{prefix}.{net % 256 + 2}"
        self.cleanup()  # what a killed earlier run with this pid left
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.root_dev, "type", "veth", "peer", "name", self.ns_dev)
            _ip("link", "set", self.ns_dev, "netns", self.ns)
            _ip("addr", "add", f"{self.root_addr}/30", "dev", self.root_dev)
            _ip("link", "set", self.root_dev, "up")
            self.in_ns("addr", "add", f"{self.ns_addr}/30", "dev", self.ns_dev)
            self.in_ns("link", "set", self.ns_dev, "up")
            self.in_ns("link", "set", "lo", "up")
            # the far end's MAC address pinned, as a switch's neighbours are cached: cut, the
            # link then loses packets silently (without, ARP fails within ~3 s and connects
            # end with "no route to host", which is kinder than what a real partition does)
            mac = subprocess.run(
                ["ip", "netns", "exec", self.ns, "cat", f"/sys/class/net/{self.ns_dev}/address"],
                check=True, capture_output=True, text=True, timeout=30,
            ).stdout.strip()  # fmt: skip
            _ip("neigh", "replace", self.ns_addr, "lladdr", mac, "dev", self.root_dev,
                "nud", "permanent")  # fmt: skip
        except Exception:
            self.cleanup()
            raise

    def in_ns(self, *args: str) -> None:
        _ip("netns", "exec", self.ns, "ip", *args)

    def popen(self, argv: list[str]) -> subprocess.Popen[str]:
        """A process inside the namespace."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns, *argv], stdout=subprocess.PIPE, text=True
        )

    @contextlib.contextmanager
    def partitioned(self) -> Iterator[None]:
        """The link cut for the block's length, then healed."""
        self.in_ns("link", "set", self.ns_dev, "down")
        try:
            yield
        finally:
            self.in_ns("link", "set", self.ns_dev, "up")

    @contextlib.contextmanager
    def slowed(self, rate: str) -> Iterator[None]:
        """The link limited to `rate` (tc's units: "20mbit") for the block's length."""
        tc = ["tc", "qdisc", "replace", "dev", self.root_dev, "root", "tbf", "rate", rate,
              "burst", "32kbit", "latency", "2s"]  # fmt: skip
        subprocess.run(tc, check=True, capture_output=True, timeout=30)
        try:
            yield
        finally:
            with contextlib.suppress(subprocess.CalledProcessError):
                subprocess.run(
                    ["tc", "qdisc", "del", "dev", self.root_dev, "root"],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip

    def cleanup(self) -> None:
        for args in (("link", "del", self.root_dev), ("netns", "del", self.ns)):
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip(*args)
