"""A second host on this machine: a network namespace joined to this one by a veth pair, with an
address of its own on each end, so that ranks across "hosts" talk over a real interface (whose
byte counters then measure what crosses between them). Needs root and iproute2 (Debian's `ip`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TwoHosts:
    address: str  # this host's end of the pair
    interface: str  # this host's end's name (GLOO_SOCKET_IFNAME here)
    namespace: str  # run the other host's commands under `ip netns exec NAMESPACE`
    their_interface: str  # the other end's name (GLOO_SOCKET_IFNAME there)

    def bytes_crossed(self) -> int:
        """Bytes sent and received on this end so far."""
        statistics = Path("/sys/class/net") / self.interface / "statistics"
        return sum(int((statistics / name).read_text()) for name in ("tx_bytes", "rx_bytes"))


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (`ip`)"
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """A namespace and its veth pair (10.213.N.1 here, .2 there), removed on exit."""
    tag = os.getpid() % 10000
    hosts = TwoHosts(f"10.213.{tag % 250}.1", f"kvp{tag}a", f"kvp-host{tag}", f"kvp{tag}b")
    theirs = f"10.213.{tag % 250}.2/30"
    in_namespace = ["ip", "netns", "exec", hosts.namespace]
    commands = [
        ["ip", "netns", "add", hosts.namespace],
        ["ip", "link", "add", hosts.interface, "type", "veth", "peer", "name", hosts.their_interface],
        ["ip", "link", "set", hosts.their_interface, "netns", hosts.namespace],
        ["ip", "addr", "add", f"{hosts.address}/30", "dev", hosts.interface],
        ["ip", "link", "set", hosts.interface, "up"],
        [*in_namespace, "ip", "addr", "add", theirs, "dev", hosts.their_interface],
        [*in_namespace, "ip", "link", "set", hosts.their_interface, "up"],
    ]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        yield hosts
    finally:
        subprocess.run(["ip", "netns", "del", hosts.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", hosts.interface], capture_output=True)
