"""Hot switches between nodes over shaped veth links (`python -m bench.hotswitch --nodes N`).

Each node is a network namespace (`bench/netns.py`) whose interface is shaped with `tc tbf`
(`--rate`, default 1 Gbit/s per node and direction; `netem` delays are not available on
every kernel). Node a runs the job's runner and two workers; nodes b.. run worker hosts with
two workers each. Per switch: bytes_moved, bytes_lower_bound (what must move at least),
bytes_cross_node and bytes_cross_node_min (the least any sender choice moves between nodes),
switch_s (training paused), and speedup_vs_restart: the checkpoint-and-restart alternative
(every worker writes its shard to shared storage, all stop, new ones start on the target
slots and load, resharding) divided by switch_s. Needs root (namespaces); prints one JSON.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import sys
import tempfile
import time
from typing import Any

import torch

from bench.netns import network, unavailable
from worker_agent.protocol import worker_grant
from worker_agent.runtime.presets import JobSpec, build_job
from worker_agent.runtime.remote import HOST_KEY_ENV, HostClient
from worker_agent.runtime.runner import GpuSlot, JobRunner, SwitchReport
from worker_agent.sharding import Layout

SIZES = {
    "10M": {"d_model": 256, "n_layers": 12, "n_heads": 8},
    "50M": {"d_model": 512, "n_layers": 16, "n_heads": 8},
}
SLOTS_PER_NODE = 2
TIMEOUT_S = 300.0


def _cases(nodes: list[str]) -> list[tuple[str, list[GpuSlot], Layout]]:
    """The chain of (name, slots, layout): grow from node a to every node, regroup, shrink."""
    a = [GpuSlot(nodes[0], i) for i in range(SLOTS_PER_NODE)]
    every = [GpuSlot(n, i) for n in nodes for i in range(SLOTS_PER_NODE)]
    n = len(nodes)
    chain = [
        ("start", a, Layout(tp=2)),
        (f"grow a -> {n} nodes", every, Layout(dp=n, tp=2)),
    ]
    if n == 2:
        chain.append(("dp across nodes -> pp across nodes", every, Layout(pp=2, tp=2)))
    chain.append((f"shrink {n} nodes -> a", a, Layout(tp=2)))
    return chain


def _record(name: str, rep: SwitchReport, restart_s: float) -> dict[str, Any]:
    return {
        "case": name,
        "src": str(rep.src),
        "dst": str(rep.dst),
        "bytes_moved": rep.bytes_moved,
        "bytes_lower_bound": rep.bytes_lower_bound,
        "bytes_cross_node": rep.bytes_cross_node,
        "bytes_cross_node_min": rep.bytes_cross_node_min,
        "max_send_bytes": rep.max_send_bytes,
        "switch_s": round(rep.switch_s, 3),
        "exchange_s": round(rep.exchange_s, 3),
        "restart_s": round(restart_s, 3),
        "speedup_vs_restart": round(restart_s / rep.switch_s, 1) if rep.switch_s else None,
    }


def driver(args: dict[str, Any]) -> dict[str, Any]:
    """Inside node a: run the chain, each switch also as a checkpoint-and-restart."""
    torch.set_num_threads(1)
    # Every host shares the bench's node secret; the grant is job 1's for a runner on this node.
    grant = worker_grant(os.environ[HOST_KEY_ENV], 1, args["node"]).encode()
    hosts = {
        n: HostClient((a, int(p)), grant, 1, args["node"], timeout_s=30.0)
        for n, (a, p) in args["hosts"].items()
    }
    size = SIZES[args["size"]]
    spec = JobSpec(
        preset="gpt", d_model=size["d_model"], n_layers=size["n_layers"], n_heads=size["n_heads"]
    )
    nodes = [args["node"], *args["hosts"]]

    def runner() -> JobRunner:
        return JobRunner(store_host=args["address"], hosts=hosts, timeout_s=TIMEOUT_S)

    chain = _cases(nodes)
    out: list[dict[str, Any]] = []
    run = runner()
    try:
        _, slots, layout = chain[0]
        run.start(spec, slots, layout)
        run.train(1)  # non-zero optimizer state
        for name, slots, layout in chain[1:]:
            rep = run.resize(slots, layout)
            with tempfile.TemporaryDirectory(prefix="gf-ckpt-", dir=args["shared_dir"]) as d:
                os.chmod(d, 0o777)
                t0 = time.perf_counter()
                ckpt = run.save_checkpoint(d)
                src_slots, src_layout = run.slots(), run.layout
                run.stop()
                fresh = runner()
                fresh.start(spec, src_slots, src_layout, checkpoint=ckpt)
                restart_s = time.perf_counter() - t0
                run = fresh
            out.append(_record(name, rep, restart_s))
    finally:
        run.stop()
    return {"n_params": sum(p.numel for p in build_job(spec).param_specs()), "cases": out}


def nodes_main(n_nodes: int, quick: bool, rate: str) -> None:
    """Make the namespaces, start the worker hosts, run the driver in node a, print JSON."""
    why = unavailable()
    if why is not None:
        sys.exit(f"--nodes needs network namespaces: {why}")
    if n_nodes < 2:
        sys.exit("--nodes needs at least 2")
    names = [chr(ord("a") + i) for i in range(n_nodes)]
    env = {HOST_KEY_ENV: secrets.token_hex(16)}
    started = time.perf_counter()
    load_start = os.getloadavg()
    with network(names) as net, tempfile.TemporaryDirectory(prefix="gf-bench-") as shared:
        for name in names:
            net.shape(name, rate)
        hosts: dict[str, list[Any]] = {}
        for name in names[1:]:
            proc = net.python(
                name, ["-m", "worker_agent.runtime.remote", "--bind", net.nodes[name].address], env
            )
            assert proc.stdout is not None
            hosts[name] = [net.nodes[name].address, json.loads(proc.stdout.readline())["port"]]
        args = {
            "node": names[0],
            "address": net.nodes[names[0]].address,
            "hosts": hosts,
            "size": "10M" if quick else "50M",
            "shared_dir": shared,
        }
        proc = net.python(
            names[0], ["-m", "bench.hotswitch_nodes", "--driver", json.dumps(args)], env
        )
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"driver failed:\n{stderr[-4000:]}")
        result = json.loads(stdout.strip().splitlines()[-1])
    print(
        json.dumps(
            {
                "benchmark": "hotswitch --nodes",
                "nodes": n_nodes,
                "slots_per_node": SLOTS_PER_NODE,
                "link": f"veth + bridge, tc tbf {rate} egress per node",
                "model": f"gpt {'10M' if quick else '50M'} preset",
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "loadavg_1m_start": round(load_start[0], 2),
                "loadavg_1m_end": round(os.getloadavg()[0], 2),
                "wall_s": round(time.perf_counter() - started, 1),
                **result,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        print(json.dumps(driver(json.loads(sys.argv[2]))), flush=True)
