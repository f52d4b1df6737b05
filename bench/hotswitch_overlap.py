"""Training time a hot switch costs while the job trains, staging included, against a restart.

`bench/hotswitch.py` times the pause only; the spawn and staging before it overlap training but
share the machine's cores with it. Here the job trains in the background (as under the agent),
the switch runs in the middle, and the training time lost is measured from the step counter:

    lost_s = wall time from the switch's start to its return
             - steps done in that time / the step rate measured just before

against `restart_s` (checkpoint, stop, spawn, load), during which nothing trains. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.hotswitch import PAIRS_FULL, Pair, _restart, _spec
from worker_agent.runtime.runner import JobRunner

DEFINITIONS = {
    "rate_steps_per_s": "steps/s of background training over `--window-s` just before the switch",
    "resize_wall_s": "wall time of JobRunner.resize (spawn + plan + staging + pause)",
    "steps_during": "steps the background driver finished while resize ran",
    "lost_s": "resize_wall_s - steps_during / rate_steps_per_s: training time the switch cost "
    "(0 when training went on at full speed; +-lost_s_resolution, one step, from counting steps)",
    "lost_s_timed": "the same from step completion times instead of step counts: (first step "
    "completed after the switch returned - last step completed before it started) - the old "
    "layout's steps in between / rate_steps_per_s - that last step / rate_after_steps_per_s "
    "(no one-step resolution; still as noisy as the step rates)",
    "first_step_after_s": "the first step after the switch returned (new layout; compare "
    "with 1 / rate_after_steps_per_s)",
    "restart_s": "checkpoint-and-restart to the same layout (nothing trains meanwhile)",
    "stage_profile": "per worker, its staging thread per phase: wall_s, user_s / sys_s (CPU in "
    "user space / the kernel, e.g. page faults), runq_s (runnable, waiting for a core), minflt "
    "(page faults), vcsw / ivcsw (voluntary / involuntary context switches); wall - user - sys "
    "- runq is time blocked (the GIL, locks)",
}


def _next_step(run: JobRunner) -> tuple[int, float]:
    """Wait for the step counter to move; return (step, when)."""
    s0 = run.step_progress().step
    while (s := run.step_progress().step) == s0:
        time.sleep(0.005)
    return s, time.perf_counter()


def _rate(run: JobRunner, window_s: float) -> float:
    """Steps per second of the background driver, between step boundaries >= `window_s` apart."""
    s0, t0 = _next_step(run)
    time.sleep(window_s)
    s1, t1 = _next_step(run)
    return (s1 - s0) / (t1 - t0)


def overlap_case(
    size: str, pair: Pair, window_s: float, stage_nice: int | None = None
) -> dict[str, Any]:
    """Train, switch src -> dst while training, then restart src -> dst from a checkpoint."""
    spec = _spec(size)
    src_n, src, dst_n, dst = pair
    run = JobRunner(stage_nice=stage_nice)
    try:
        run.start(spec, src_n, src)
        run.train(2)
        run.run_background()
        time.sleep(window_s / 2)  # warm-up
        rate = _rate(run, window_s)
        before = run.step_progress()
        s0, t0 = before.step, time.perf_counter()
        report = run.resize(dst_n, dst)
        t_end = time.perf_counter()
        wall_s = t_end - t0
        steps = run.step_progress().step - s0
        # The first step completed after the switch ran in the new layout.
        s_after, t_after = _next_step(run)
        t_after = run.step_progress().step_at
        rate_after = _rate(run, window_s)
        run.pause()
        # The restart alternative, from the same (source) layout to the same target.
        run.resize(src_n, src)
        with tempfile.TemporaryDirectory(prefix="gf-ckpt-") as d:
            run, restart_s = _restart(run, spec, dst_n, dst, d)
    finally:
        run.stop()
    lost_s = max(0.0, wall_s - steps / rate) if rate > 0 else wall_s
    old_steps = s_after - before.step - 1
    lost_timed_s = (t_after - before.step_at) - old_steps / rate - 1 / rate_after
    return {
        "model": size,
        "stage_nice": stage_nice,
        "src": str(src),
        "dst": str(dst),
        "rate_steps_per_s": round(rate, 3),
        "rate_after_steps_per_s": round(rate_after, 3),
        "resize_wall_s": round(wall_s, 3),
        "switch_s": round(report.switch_s, 3),
        "stage_s": round(report.stage_s, 3),
        "spawn_s": round(report.spawn_s, 3),
        "steps_during": steps,
        "lost_s": round(lost_s, 3),
        "lost_s_resolution": round(1 / rate, 3) if rate > 0 else None,
        "lost_s_timed": round(lost_timed_s, 3),
        "first_step_after_s": round(t_after - t_end, 3),
        "restart_s": round(restart_s, 3),
        "speedup_vs_restart_lost": round(restart_s / lost_s, 1) if lost_s > 0 else None,
        "speedup_vs_restart_pause": round(restart_s / report.switch_s, 1),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "stage_profile": [
            {ph: {k: round(v, 3) for k, v in d.items()} for ph, d in w.items()}
            for w in report.stage_profile
        ],
    }


def main() -> None:
    """Run the cases and print one JSON document."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="100M", help="comma list of bench/hotswitch.py sizes")
    ap.add_argument("--window-s", type=float, default=4.0, help="rate measurement window")
    ap.add_argument(
        "--cases",
        default=None,
        help="comma list of case indices to run (0..5: each pair, then its reverse); all if unset",
    )
    ap.add_argument(
        "--stage-nice",
        default="none",
        help="JobRunner(stage_nice=...): the staging thread's nice value, or 'none'",
    )
    args = ap.parse_args()
    stage_nice = None if args.stage_nice == "none" else int(args.stage_nice)
    only = None if args.cases is None else {int(i) for i in args.cases.split(",")}
    torch.set_num_threads(1)
    cases = []
    load_start = os.getloadavg()
    for size in args.sizes.split(","):
        pairs = [
            pair
            for src_n, src, dst_n, dst in PAIRS_FULL
            for pair in ((src_n, src, dst_n, dst), (dst_n, dst, src_n, src))
        ]
        for i, pair in enumerate(pairs):
            if only is None or i in only:
                cases.append(overlap_case(size, pair, args.window_s, stage_nice))
    print(
        json.dumps(
            {
                "definitions": DEFINITIONS,
                "cases": cases,
                "loadavg_start": [round(x, 2) for x in load_start],
                "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
