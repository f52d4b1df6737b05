"""Hot-switch cost: switch time, bytes moved vs the lower bound, bandwidth vs a plain p2p copy of
the same bytes, and the checkpoint-and-restart alternative. Prints JSON.

    python bench/hotswitch.py [--quick] [--sizes 10M,50M,100M,250M,500M]

Workers are CPU processes on gloo (loopback); on a GPU node the same code runs on NCCL.
The JSON's "definitions" say exactly what each figure measures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_agent.runtime.layout import Layout
from worker_agent.runtime.pool import JobRunner, SwitchReport
from worker_agent.runtime.presets import JobSpec, build_job

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
# (src gpus, src layout, dst gpus, dst layout); every pair is also run in reverse.
PAIRS_FULL = [
    (2, Layout(tp=2), 2, Layout(pp=2)),
    (2, Layout(dp=2), 2, Layout(tp=2)),
    (2, Layout(dp=2), 4, Layout(dp=2, tp=2)),
]
PAIRS_QUICK = [(2, Layout(tp=2), 2, Layout(pp=2))]
FUSED_PER_PEER = 2**62
"""direct_min_run_bytes that sends exactly one fused (packed) message per peer."""

DEFINITIONS = {
    "switch_s": "training paused: (snapshot copy, none by default on CPU) + regroup + transfer "
    "+ commit + sub-group rebuild, as the runner measures it",
    "spawn_s_overlapped, plan_s_overlapped, stage_s_overlapped": "before the pause, while "
    "training may go on: new workers boot; the runner plans; every worker works out its "
    "messages and allocates and pre-faults its new shard and staging buffers (the bench does "
    "not train meanwhile, so on a busy job these would compete for its cores)",
    "exchange_s": "slowest worker's pack + post-to-last-message-received + unpack (its local "
    "copies run in a thread meanwhile)",
    "plain_copy_s": "one batch_isend_irecv of the same bytes between the same rank pairs (one "
    "message per pair) in a separate pool of idle workers of the same world size, send and "
    "receive buffers allocated and touched beforehand like the switch's; median of 3 after a "
    "warm-up, measured in the same run right after the switch",
    "bandwidth_ratio": "plain_copy_s / exchange_s (1.0 = the switch moves its bytes as fast as "
    "a plain copy of them)",
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


def _case(
    size: str,
    n_params: int,
    variant: str,
    report: SwitchReport,
    plain_s: float,
    plain_fresh_s: float,
    restart_s: float,
) -> dict[str, Any]:
    moved = report.bytes_moved
    ratio = plain_s / report.exchange_s if moved and report.exchange_s > 0 else None
    ratio_fresh = plain_fresh_s / report.exchange_s if moved and report.exchange_s > 0 else None
    return {
        "params": n_params,
        "model": size,
        "src": str(report.src),
        "dst": str(report.dst),
        "variant": variant,
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
        "plain_copy_s": round(plain_s, 4),
        "plain_copy_fresh_s": round(plain_fresh_s, 4),
        "bandwidth_ratio": None if ratio is None else round(ratio, 3),
        "bandwidth_ratio_vs_fresh": None if ratio_fresh is None else round(ratio_fresh, 3),
        "restart_s": round(restart_s, 3),
        "speedup_vs_restart": round(restart_s / report.switch_s, 1),
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
) -> list[dict[str, Any]]:
    """Switch src->dst->src in one pool, then restart src->dst->src from checkpoints."""
    spec = _spec(size)
    n_params = sum(p.numel for p in build_job(spec).param_specs())
    src_n, src, dst_n, dst = pair
    variant = "fused-per-peer" if direct_min_run_bytes == FUSED_PER_PEER else "default"
    run = JobRunner(direct_min_run_bytes=direct_min_run_bytes)
    try:
        run.start(spec, src_n, src)
        run.train(1)  # non-zero optimizer state
        fwd = run.resize(dst_n, dst)
        plain = [_plain(probe, fwd)]
        back = run.resize(src_n, src)
        plain.append(_plain(probe, back))
        with tempfile.TemporaryDirectory(prefix="gf-ckpt-") as d1:
            run, restart_fwd = _restart(run, spec, dst_n, dst, d1)
        with tempfile.TemporaryDirectory(prefix="gf-ckpt-") as d2:
            run, restart_back = _restart(run, spec, src_n, src, d2)
    finally:
        run.stop()
    return [
        _case(size, n_params, variant, rep, plain_s, fresh_s, restart_s)
        for rep, (plain_s, fresh_s), restart_s in zip(
            (fwd, back), plain, (restart_fwd, restart_back), strict=True
        )
    ]


def _plain(probe: JobRunner, rep: SwitchReport) -> tuple[float, float]:
    """Plain copy of the switch's per-pair bytes: warm buffers, and into fresh receive buffers."""
    if not rep.bytes_moved:
        return 0.0, 0.0
    return probe.probe_p2p(rep.pair_bytes), probe.probe_p2p(rep.pair_bytes, fresh=True)


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def main() -> None:
    """Run the cases and print one JSON document."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one small model, one pair (< 1 min)")
    ap.add_argument("--sizes", default="10M,50M,100M,250M", help=f"comma list of {list(SIZES)}")
    ap.add_argument(
        "--no-fused-compare",
        action="store_true",
        help="skip the 50M tp2<->pp2 rerun with one fused message per peer",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = ["10M"] if args.quick else args.sizes.split(",")
    pairs = PAIRS_QUICK if args.quick else PAIRS_FULL
    cases: list[dict[str, Any]] = []
    started = time.perf_counter()
    with JobRunner(snapshot_policy="none") as probe:
        # Plain-copy reference: a separate pool of 4 idle workers, warm pre-allocated buffers.
        probe.start(
            JobSpec(preset="mlp", n_layers=1, d_model=8, global_batch_size=4, micro_batch_size=1),
            4,
            Layout(dp=4),
        )
        for size in sizes:
            for pair in pairs[:1] if size in PAIRS_ONLY_SHARDED else pairs:
                cases += run_pair(size, pair, probe)
            if size == "50M" and not args.quick and not args.no_fused_compare:
                # The issue asks for one fused buffer per peer; the executor sends big runs
                # unpacked instead. Measure both on the same pair.
                cases += run_pair(size, pairs[0], probe, FUSED_PER_PEER)
    default = [c for c in cases if c["variant"] == "default"]
    moved = [c for c in default if c["bytes_moved"]]
    print(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread/worker, "
                f"backend gloo (loopback), torch {torch.__version__}",
                "definitions": DEFINITIONS,
                "cases": cases,
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
                    "bench_s": round(time.perf_counter() - started, 1),
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
