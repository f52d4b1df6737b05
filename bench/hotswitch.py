"""Hot-switch cost: switch time, bytes moved vs the lower bound, bandwidth vs a plain p2p copy of
the same bytes, and the checkpoint-and-restart alternative. Prints JSON.

    python -m bench.hotswitch [--quick] [--model gpt2-124m,llama-350m,bert-base,resnet50]
    python -m bench.hotswitch --sizes 10M,50M,100M,250M,500M [--no-p2p-compare]
    python -m bench.hotswitch --nodes N [--quick] [--rate 1gbit]   (root: network namespaces)

`--model` (the default) runs real architectures at real sizes (`bench/hotswitch_models.py`),
with the training time a switch costs a job that keeps training; `--quick` is GPT-2 124M
tp2 <-> pp2. `--sizes` runs the functional GPT presets of earlier runs, with the bandwidth
comparisons against plain copies.

Workers are CPU processes on gloo (loopback); on a GPU node the same code runs on NCCL. All
workers here are on one node with their state in shared memory, so the default runner moves
bytes by copying out of the sender's buffer ("shm"); the "p2p" variant forces gloo messages.
The JSON's "definitions" say exactly what each figure measures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.hotswitch_models import DEFINITIONS as MODEL_DEFINITIONS
from bench.hotswitch_models import MODEL_PAIRS, QUICK, run_model_pair
from worker_agent.runtime.presets import JobSpec, build_job
from worker_agent.runtime.runner import JobRunner, SwitchReport
from worker_agent.sharding import Layout

# GPT presets sized to ~10 M, ~50 M, ~100 M, ~250 M parameters.
SIZES: dict[str, dict[str, int]] = {
    "10M": {"d_model": 256, "n_layers": 12, "n_heads": 8},
    "50M": {"d_model": 512, "n_layers": 16, "n_heads": 8},
    "100M": {"d_model": 768, "n_layers": 14, "n_heads": 12},
    "250M": {"d_model": 1024, "n_layers": 20, "n_heads": 16},
    "500M": {"d_model": 1536, "n_layers": 17, "n_heads": 16},
}
# Replicated layouts of the biggest model need 6 GB per worker plus the new shards: too much for
# this machine, so it runs only the sharded pair.
PAIRS_ONLY_SHARDED = {"500M"}
Pair = tuple[int, Layout, int, Layout]
"""(src gpus, src layout, dst gpus, dst layout); every pair is also run in reverse."""
PAIRS_FULL: list[Pair] = [
    (2, Layout(tp=2), 2, Layout(pp=2)),
    (2, Layout(dp=2), 2, Layout(tp=2)),
    (2, Layout(dp=2), 4, Layout(dp=2, tp=2)),
]
PAIRS_QUICK: list[Pair] = [(2, Layout(tp=2), 2, Layout(pp=2))]
FUSED_PER_PEER = 2**62
"""direct_min_run_bytes that sends exactly one fused (packed) message per peer."""
P2P_PAIRS = {"10M": 3, "50M": 1, "100M": 3, "250M": 1, "500M": 0}
"""Per size, how many of the pairs also run with transport="p2p" (no restart baseline)."""

DEFINITIONS = {
    "switch_s": "training paused: (snapshot copy, none by default on CPU) + regroup + transfer "
    "+ commit + sub-group rebuild, as the runner measures it",
    "spawn_s_overlapped, plan_s_overlapped, stage_s_overlapped": "before the pause, while "
    "training may go on: new workers boot; the runner plans; every worker works out its "
    "messages and allocates and pre-faults its new shard and staging buffers (the bench does "
    "not train meanwhile, so on a busy job these would compete for its cores)",
    "transport": "shm: every moved byte was copied by its receiver straight out of the "
    "sender's shared-memory state (same node, CPU); p2p: every byte travelled as a gloo message; "
    "mixed: both",
    "exchange_s": "slowest worker's pack + post-to-last-byte-received (its pulls out of peers' "
    "shared memory included) + unpack; with messages in flight its local copies run in a thread "
    "meanwhile, without them they run after (local_s, inside switch_s, not in exchange_s)",
    "plain_copy_s": "one batch_isend_irecv of the same bytes between the same rank pairs (one "
    "message per pair) in a separate pool of idle workers of the world size the switch "
    "transferred in (4 when it grows or shrinks between 2 and 4; ranks not in a pair wait at the "
    "barrier), private memory (measured: no different from shared memory here), send and "
    "receive buffers allocated and touched beforehand like the switch's; median of 3 after a "
    "warm-up, measured in the same run right after the switch",
    "plain_shm_copy_s": "the same pool: every receiver copies each pair's bytes (one contiguous "
    "copy per pair) out of a buffer its sender allocated in shared memory into a warm buffer, "
    "all receivers at once, pages of both faulted in beforehand; median of 3 after a warm-up",
    "bandwidth_ratio": "plain_copy_s / exchange_s, the issue's definition (1.0 = the switch "
    "moves its bytes as fast as a plain p2p copy of them)",
    "bandwidth_ratio_vs_same_transport": "the plain copy of the transport the switch used "
    "(plain_shm_copy_s for shm, plain_copy_s for p2p) / exchange_s",
    "restart_s": "checkpoint-and-restart in the same run: every worker torch.saves its shard to "
    "local disk, every worker process exits, new processes spawn (import torch), form a process "
    "group and load with resharding (files still in the page cache)",
}


def _spec(size: str) -> JobSpec:
    return JobSpec(
        preset="gpt",
        vocab_size=1024,
        seq_len=16,
        global_batch_size=4,
        micro_batch_size=1,
        **SIZES[size],  # type: ignore[arg-type]
    )


def _transport(report: SwitchReport) -> str | None:
    if not report.bytes_moved:
        return None
    if report.bytes_pulled == report.bytes_moved:
        return "shm"
    return "p2p" if report.bytes_pulled == 0 else "mixed"


def _ratio(plain_s: float, report: SwitchReport) -> float | None:
    if not report.bytes_moved or report.exchange_s <= 0:
        return None
    return round(plain_s / report.exchange_s, 3)


def _case(
    size: str,
    n_params: int,
    variant: str,
    report: SwitchReport,
    plain: tuple[float, float, float],
    restart_s: float | None,
) -> dict[str, Any]:
    moved = report.bytes_moved
    plain_s, plain_fresh_s, plain_shm_s = plain
    transport = _transport(report)
    same = {"shm": plain_shm_s, "p2p": plain_s}.get(transport or "")
    return {
        "params": n_params,
        "model": size,
        "src": str(report.src),
        "dst": str(report.dst),
        "variant": variant,
        "transport": transport,
        "switch_s": round(report.switch_s, 4),
        "snapshot_s": round(report.snapshot_s, 4),
        "stage_wait_s": round(report.stage_wait_s, 4),
        "exchange_s": round(report.exchange_s, 4),
        "pack_s": round(report.pack_s, 4),
        "comm_s": round(report.comm_s, 4),
        "unpack_s": round(report.unpack_s, 4),
        "local_s": round(report.local_s, 4),
        "regroup_s": round(report.regroup_s, 4),
        "spawn_s_overlapped": round(report.spawn_s, 3),
        "plan_s_overlapped": round(report.plan_s, 3),
        "stage_s_overlapped": round(report.stage_s, 3),
        "bytes_moved": moved,
        "bytes_lower_bound": report.bytes_lower_bound,
        "bytes_pulled": report.bytes_pulled,
        "bytes_local": report.bytes_local,
        "messages": report.messages,
        "plain_copy_s": round(plain_s, 4),
        "plain_copy_fresh_s": round(plain_fresh_s, 4),
        "plain_shm_copy_s": round(plain_shm_s, 4),
        "bandwidth_ratio": _ratio(plain_s, report),
        "bandwidth_ratio_vs_fresh": _ratio(plain_fresh_s, report),
        "bandwidth_ratio_vs_shm_copy": _ratio(plain_shm_s, report),
        "bandwidth_ratio_vs_same_transport": None if same is None else _ratio(same, report),
        "restart_s": None if restart_s is None else round(restart_s, 3),
        "speedup_vs_restart": None if restart_s is None else round(restart_s / report.switch_s, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _restart(
    run: JobRunner, spec: JobSpec, gpus: int, layout: Layout, workdir: str
) -> tuple[JobRunner, float]:
    """Checkpoint to disk, stop every worker, start new ones in `layout`, load (resharding)."""
    t0 = time.perf_counter()
    ckpt = run.save_checkpoint(workdir)
    run.stop()
    fresh = JobRunner()
    fresh.start(spec, gpus, layout, checkpoint=ckpt)
    return fresh, time.perf_counter() - t0


def run_pair(
    size: str,
    pair: tuple[int, Layout, int, Layout],
    probe: JobRunner,
    direct_min_run_bytes: int | None = None,
    transport: Literal["auto", "p2p"] = "auto",
) -> list[dict[str, Any]]:
    """Switch src->dst->src in one pool; for the default runner also restart src->dst->src
    from checkpoints (the restart does not depend on the switch's transport)."""
    spec = _spec(size)
    n_params = sum(p.numel for p in build_job(spec).param_specs())
    src_n, src, dst_n, dst = pair
    variant = "default" if transport == "auto" else "p2p"
    if direct_min_run_bytes == FUSED_PER_PEER:
        variant += "-fused-per-peer"
    run = JobRunner(direct_min_run_bytes=direct_min_run_bytes, transport=transport)
    restarts: tuple[float | None, float | None] = (None, None)
    try:
        run.start(spec, src_n, src)
        run.train(1)  # non-zero optimizer state
        fwd = run.resize(dst_n, dst)
        plain = [_plain(probe, fwd)]
        back = run.resize(src_n, src)
        plain.append(_plain(probe, back))
        if variant == "default":
            with tempfile.TemporaryDirectory(prefix="gf-ckpt-") as d1:
                run, restart_fwd = _restart(run, spec, dst_n, dst, d1)
            with tempfile.TemporaryDirectory(prefix="gf-ckpt-") as d2:
                run, restart_back = _restart(run, spec, src_n, src, d2)
            restarts = (restart_fwd, restart_back)
    finally:
        run.stop()
    return [
        _case(size, n_params, variant, rep, pl, restart_s)
        for rep, pl, restart_s in zip((fwd, back), plain, restarts, strict=True)
    ]


def _plain(probe: JobRunner, rep: SwitchReport) -> tuple[float, float, float]:
    """Plain copies of the switch's per-pair bytes: p2p into warm and into fresh receive
    buffers, and out of shared memory."""
    if not rep.bytes_moved:
        return 0.0, 0.0, 0.0
    return (
        probe.probe_p2p(rep.pair_bytes),
        probe.probe_p2p(rep.pair_bytes, fresh=True),
        probe.probe_shm_copy(rep.pair_bytes),
    )


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def main() -> None:
    """Run the cases and print one JSON document."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="GPT-2 124M, tp2 <-> pp2 (a few min)")
    ap.add_argument(
        "--model",
        default=None,
        help=f"comma list of {list(MODEL_PAIRS)} (the default: all of them)",
    )
    ap.add_argument("--window-s", type=float, default=8.0, help="step-rate window (--model)")
    ap.add_argument("--no-lost", action="store_true", help="skip the training-time-lost cases")
    ap.add_argument(
        "--sizes", default=None, help=f"functional GPT presets instead: comma list of {list(SIZES)}"
    )
    ap.add_argument(
        "--no-fused-compare",
        action="store_true",
        help="skip the 50M tp2<->pp2 p2p rerun with one fused message per peer",
    )
    ap.add_argument(
        "--no-p2p-compare",
        action="store_true",
        help="skip the reruns with transport='p2p' (every byte as a gloo message)",
    )
    ap.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="switch between N nodes (network namespaces on shaped veth links; bench/hotswitch_nodes.py)",
    )
    ap.add_argument("--rate", default="1gbit", help="--nodes: tc tbf rate of each node's link")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.nodes is not None:
        from bench.hotswitch_nodes import nodes_main

        nodes_main(args.nodes, args.quick, args.rate)
        return
    if args.sizes is None:
        models_main(args.model, args.quick, args.window_s, not args.no_lost)
        return
    sizes = args.sizes.split(",")
    pairs = PAIRS_FULL
    cases: list[dict[str, Any]] = []
    started = time.perf_counter()
    load_start = os.getloadavg()
    world_sizes = sorted({max(p[0], p[2]) for p in pairs})
    with contextlib.ExitStack() as stack:
        # Plain-copy references: separate pools of idle workers, one per world size the switches
        # transfer in; warm pre-allocated buffers.
        probes: dict[int, JobRunner] = {}
        for n in world_sizes:
            probes[n] = stack.enter_context(JobRunner(snapshot_policy="none"))
            probes[n].start(
                JobSpec(
                    preset="mlp", n_layers=1, d_model=8, global_batch_size=4, micro_batch_size=1
                ),
                n,
                Layout(dp=n),
            )
        failed: list[dict[str, str]] = []

        def run(
            size: str,
            pair: Pair,
            dmr: int | None = None,
            transport: Literal["auto", "p2p"] = "auto",
        ) -> None:
            # One failed pair (e.g. the OOM killer on a busy machine) is reported, not fatal.
            try:
                cases.extend(run_pair(size, pair, probes[max(pair[0], pair[2])], dmr, transport))
            except Exception as exc:
                what = f"{size} {pair[1]}<->{pair[3]} {transport} {dmr}"
                failed.append({"case": what, "error": f"{type(exc).__name__}: {exc}"[:500]})

        for size in sizes:
            for pair in pairs[:1] if size in PAIRS_ONLY_SHARDED else pairs:
                run(size, pair)
            if not args.no_p2p_compare:
                n_p2p = len(pairs) if args.quick else P2P_PAIRS.get(size, 0)
                for pair in pairs[:n_p2p]:
                    run(size, pair, transport="p2p")
            if size == "50M" and not args.quick and not args.no_fused_compare:
                # The issue asks for one fused buffer per peer; the p2p executor sends big runs
                # unpacked instead. Measure both on the same pair.
                run(size, pairs[0], FUSED_PER_PEER, "p2p")
    default = [c for c in cases if c["variant"] == "default"]
    moved = [c for c in default if c["bytes_moved"]]
    p2p = [c for c in cases if c["variant"] == "p2p" and c["bytes_moved"]]
    print(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread/worker, "
                f"backend gloo (loopback), torch {torch.__version__}",
                "definitions": DEFINITIONS,
                "cases": cases,
                "failed": failed,
                "summary": {
                    "bytes_moved_equals_lower_bound": all(
                        c["bytes_moved"] == c["bytes_lower_bound"] for c in cases
                    ),
                    "min_bandwidth_ratio": min((c["bandwidth_ratio"] for c in moved), default=None),
                    "min_bandwidth_ratio_vs_fresh": min(
                        (c["bandwidth_ratio_vs_fresh"] for c in moved), default=None
                    ),
                    "min_speedup_vs_restart": min(c["speedup_vs_restart"] for c in default),
                    "median_bandwidth_ratio": _median([c["bandwidth_ratio"] for c in moved]),
                    "median_speedup_vs_restart": _median(
                        [c["speedup_vs_restart"] for c in default]
                    ),
                    "min_bandwidth_ratio_vs_same_transport": min(
                        (c["bandwidth_ratio_vs_same_transport"] for c in moved), default=None
                    ),
                    "median_bandwidth_ratio_vs_same_transport": _median(
                        [c["bandwidth_ratio_vs_same_transport"] for c in moved]
                    ),
                    "p2p_variant_min_bandwidth_ratio": min(
                        (c["bandwidth_ratio"] for c in p2p), default=None
                    ),
                    "p2p_variant_median_bandwidth_ratio": _median(
                        [c["bandwidth_ratio"] for c in p2p]
                    ),
                    "bench_s": round(time.perf_counter() - started, 1),
                    "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                },
            },
            indent=2,
        )
    )


def models_main(models: str | None, quick: bool, window_s: float, lost: bool) -> None:
    """The real-architecture cases (`bench/hotswitch_models.py`) as one JSON document."""
    chosen = QUICK if quick else MODEL_PAIRS
    if models is not None:
        chosen = {m: MODEL_PAIRS[m] for m in models.split(",")}
    started = time.perf_counter()
    load_start = os.getloadavg()
    cases: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    for model, pairs in chosen.items():
        for pair in pairs:
            try:
                cases += run_model_pair(model, pair, window_s, lost)
            except Exception as exc:  # one failed pair (e.g. out of memory) is reported
                failed.append({"case": f"{model} {pair[1]}<->{pair[3]}", "error": f"{exc}"[:500]})
    speedups = [c["speedup_vs_restart"] for c in cases]
    lost_s = [c["lost_s"] for c in cases if "lost_s" in c]
    print(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 torch thread/worker,"
                f" backend gloo (loopback), torch {torch.__version__}",
                "definitions": MODEL_DEFINITIONS,
                "cases": cases,
                "failed": failed,
                "summary": {
                    "bytes_moved_equals_lower_bound": all(
                        c["bytes_moved"] == c["bytes_lower_bound"] for c in cases
                    ),
                    "min_speedup_vs_restart": min(speedups, default=None),
                    "median_speedup_vs_restart": _median(speedups),
                    "max_switch_s": max((c["switch_s"] for c in cases), default=None),
                    "max_lost_s": max(lost_s, default=None),
                    "median_lost_s": _median(lost_s),
                    "bench_s": round(time.perf_counter() - started, 1),
                    "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
