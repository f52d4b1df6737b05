"""Nodes in Linux network namespaces joined by veth pairs to one bridge, made and removed here.

Used by `tests/multinode/` and `bench/hotswitch_nodes.py`. Each node is a namespace with one interface `eth0` at 198.18.0.<i+2>/24 (RFC 2544 benchmark
space, 198.18.0.0/15, so no real network is ever addressed). The bridge lives in a namespace
of its own, so nothing is added to the host's namespace and the 198.18.0.0/24 subnet of
concurrent runs cannot collide. Every byte between two nodes crosses two veth pairs and the
bridge; `shape` puts a `tc tbf` qdisc on a node's interface, `cut` takes its link down.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

SUBNET = "198.18.0"
"""Inside 198.18.0.0/15 (RFC 2544): the only addresses these tests ever use."""


@dataclass
class Node:
    """One node: its namespace, its address and its interface inside the namespace."""

    name: str
    netns: str
    address: str
    ifname: str = "eth0"
    port: str = ""
    """The bridge-side end of its veth pair (in the switch namespace)."""


@dataclass
class Network:
    """The switch namespace, its nodes, and every process started in them."""

    switch: str
    nodes: dict[str, Node] = field(default_factory=dict)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def popen(
        self, node: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start `argv` inside `node`'s namespace (stdout piped, text)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[node].netns, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.procs.append(proc)
        return proc

    def python(
        self, node: str, args: Sequence[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start this interpreter with `args` inside `node`'s namespace."""
        return self.popen(node, [sys.executable, *args], env)

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL every process in `node`'s namespace (the node dies; its link stays up)."""
        pids = _pids(self.nodes[node].netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def shape(self, node: str, rate: str, burst: str = "64kb", latency: str = "20ms") -> None:
        """Limit what `node` sends to `rate` (e.g. `1gbit`) with a `tc tbf` qdisc on its interface.

        (`netem` is not available on every kernel, this machine's included; `tbf` is.)
        """
        n = self.nodes[node]
        subprocess.run(
            ["tc", "-n", n.netns, "qdisc", "replace", "dev", n.ifname, "root", "tbf",
             "rate", rate, "burst", burst, "latency", latency],
            check=True,
            capture_output=True,
        )  # fmt: skip

    def cut(self, node: str) -> None:
        """Cut `node`'s link at the bridge: from then on its packets are silently dropped."""
        _ip("-n", self.switch, "link", "set", self.nodes[node].port, "down")

    def tx_bytes(self, node: str) -> int:
        """Bytes `node` has sent on its interface (kernel counter)."""
        n = self.nodes[node]
        out = subprocess.run(
            ["ip", "-n", n.netns, "-s", "-j", "link", "show", n.ifname],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"gfprobe{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def network(names: Sequence[str], prefix: str = "gf") -> Iterator[Network]:
    """Namespaces for `names` on one bridge; everything is removed on exit, even on failure.

    Namespace names start with `prefix` (who made them: concurrent runs tell theirs apart)."""
    tag = prefix + uuid.uuid4().hex[:8]
    net = Network(switch=f"{tag}-sw")
    made: list[str] = []
    try:
        _ip("netns", "add", net.switch)
        made.append(net.switch)
        _ip("-n", net.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.switch, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            node = Node(name, f"{tag}-{name}", f"{SUBNET}.{i + 2}", port=f"v{i}")
            _ip("netns", "add", node.netns)
            made.append(node.netns)
            _ip(
                "-n", net.switch, "link", "add", node.port, "type", "veth",
                "peer", "name", node.ifname, "netns", node.netns,
            )  # fmt: skip
            _ip("-n", net.switch, "link", "set", node.port, "master", "br0")
            _ip("-n", net.switch, "link", "set", node.port, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            _ip("-n", node.netns, "link", "set", node.ifname, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
            net.nodes[name] = node
        yield net
    finally:
        for proc in net.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
        for ns in made:
            # Whatever our processes started in there (worker processes) goes too.
            for pid in _pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for ns in reversed(made):
            while _pids(ns) and time.monotonic() < deadline:
                time.sleep(0.05)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
