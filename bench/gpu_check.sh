#!/usr/bin/env bash
# The GPU path, on a machine with NVIDIA GPUs: NCCL workers, device buffers, NVML readings, the
# hot switch on NCCL, and the model jobs' loss equivalence on GPUs. Self-contained: it installs
# nothing (the GPU machine may have no network) and uses whatever `python3` and packages are
# there; every check it cannot run is reported with the reason.
#
#     bash bench/gpu_check.sh            # writes $OUT/gpu_check.json (+ logs), or ./gpu_check/
#
# Checks (each "passed", "failed" or "skipped: why"):
#   env          python, torch, CUDA devices, NCCL, NVML, transformers, pydantic, pytest
#   nvml         NvmlMeter by CUDA index (CUDA_VISIBLE_DEVICES mapping), power and energy
#   nccl_1gpu    one NCCL worker: start, train, gather, checkpoint, export (llama-tiny) vs gloo/CPU
#   nccl_same_gpu  two NCCL workers on one GPU (NCCL normally refuses: duplicate GPU)
#   nccl_switch  >= 2 GPUs: hot switches dp2 -> tp2 -> pp2 -> 1 on NCCL, loss vs 1 GPU
#   gpu_tests    >= 2 GPUs and pytest: tests/runtime/test_module_jobs.py on NCCL
#   bench        >= 2 GPUs: python -m bench.hotswitch --quick (GPT-2 124M tp2 <-> pp2)
#   node_power   one GPU: the ledger's NVML path (worker_agent/node_power.py) while the GPU idles
#                and while it works: per-cut energy from NVML's counter vs power polled at 20 Hz
#   step_time    one GPU: GPT-2 124M (fp32, bf16) and LLaMA-350M (bf16) training step time
#
# GPU_CHECKS="nvml node_power nccl_1gpu" runs only those (env always runs); default: all.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRANSFORMERS_VERBOSITY=error
RESULTS="$OUT_DIR/results.jsonl"
: > "$RESULTS"

record() {  # name status detail
  "$PY" - "$1" "$2" "$3" >> "$RESULTS" <<'EOF'
import json, sys
print(json.dumps({"check": sys.argv[1], "status": sys.argv[2], "detail": sys.argv[3][-4000:]}))
EOF
  echo "[$1] $2" >&2
}

wanted() { [ -z "${GPU_CHECKS:-}" ] || [[ " $GPU_CHECKS " == *" $1 "* ]]; }

run_check() {  # name timeout_s python-code
  local name=$1 limit=$2 code=$3 log="$OUT_DIR/$1.log"
  if ! wanted "$name"; then record "$name" "skipped: not in GPU_CHECKS" ""; return; fi
  if timeout "$limit" "$PY" -c "$code" > "$log" 2>&1; then
    record "$name" passed "$(tail -c 3000 "$log")"
  else
    record "$name" "failed (exit $?)" "$(tail -c 3000 "$log")"
  fi
}

if ! command -v "$PY" > /dev/null || ! "$PY" -c 'import torch' 2> "$OUT_DIR/env.log"; then
  echo '{"check": "env", "status": "failed", "detail": "no python3 with torch"}' > "$RESULTS"
  cp "$RESULTS" "$OUT_DIR/gpu_check.json"
  cat "$OUT_DIR/gpu_check.json"
  exit 0
fi

ENV_JSON=$("$PY" - <<'EOF'
import importlib, json, platform
import torch
out = {"python": platform.python_version(), "torch": torch.__version__,
       "cuda": torch.cuda.is_available(), "gpus": torch.cuda.device_count()}
out["names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
out["memory_gib"] = [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)
                     for i in range(out["gpus"])]
import torch.distributed as dist
out["nccl"] = dist.is_available() and dist.is_nccl_available()
for mod in ("pynvml", "transformers", "safetensors", "pydantic", "pytest", "numpy", "httpx",
            "fastapi", "tenacity"):
    try:
        m = importlib.import_module(mod)
        out[mod] = getattr(m, "__version__", "yes")
    except Exception as exc:
        out[mod] = f"missing ({type(exc).__name__})"
print(json.dumps(out))
EOF
)
record env passed "$ENV_JSON"
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
has() { "$PY" -c "import $1" > /dev/null 2>&1; }

if [ "$GPUS" -lt 1 ]; then
  record nvml "skipped: no CUDA device" ""
else
  if has pynvml && has pydantic; then
    run_check nvml 120 '
import json, os, torch
from worker_agent.telemetry import NvmlMeter
m = NvmlMeter()
n = torch.cuda.device_count()
print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "count": m.device_count(),
  "describe": [m.describe(i) for i in range(n)], "power_w": m.power_w(list(range(n))),
  "energy_j": m.energy_j(list(range(n)))}))
assert m.device_count() == n
'
  else
    record nvml "skipped: pynvml or pydantic missing" ""
  fi
fi

MODULE_OK=1
for mod in transformers safetensors pydantic numpy; do has $mod || MODULE_OK=0; done

if [ "$GPUS" -ge 1 ] && [ "$MODULE_OK" = 1 ]; then
  run_check nccl_1gpu 600 '
import json, tempfile, time, torch
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import JobRunner
from worker_agent.sharding import Layout
if __name__ == "__main__":
    # LLaMA has no dropout: CUDA and CPU draw different dropout masks from the same seed.
    spec = JobSpec(model="llama-tiny", global_batch_size=8, micro_batch_size=2)
    with JobRunner(backend="nccl") as run:
        t0 = time.perf_counter()
        run.start(spec, 1, Layout())
        losses = [l for _, l in run.train(3)]
        state = run.gather_state()
        with tempfile.TemporaryDirectory() as d:
            run.save_checkpoint(d)
            run.export(d + "/export")
        wall = time.perf_counter() - t0
    with JobRunner(backend="gloo") as cpu:
        cpu.start(spec, 1, Layout())
        ref = [l for _, l in cpu.train(3)]
    print(json.dumps({"losses": losses, "cpu_losses": ref, "wall_s": round(wall, 2)}))
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-4
'
  run_check nccl_same_gpu 120 '
import json, torch
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import GpuSlot, JobRunner
from worker_agent.sharding import Layout
if __name__ == "__main__":
    spec = JobSpec(model="gpt2-tiny", global_batch_size=8, micro_batch_size=2)
    with JobRunner(backend="nccl", timeout_s=45) as run:
        run.start(spec, [GpuSlot("a", 0), GpuSlot("b", 0)], Layout(dp=2))
        print(json.dumps({"losses": [l for _, l in run.train(2)]}))
'
else
  record nccl_1gpu "skipped: needs a GPU and transformers, safetensors, pydantic, numpy" ""
  record nccl_same_gpu "skipped: needs a GPU and transformers, safetensors, pydantic, numpy" ""
fi

if [ "$GPUS" -ge 2 ] && [ "$MODULE_OK" = 1 ]; then
  run_check nccl_switch 900 '
import json, torch
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import JobRunner
from worker_agent.sharding import Layout
if __name__ == "__main__":
    spec = JobSpec(model="llama-tiny", global_batch_size=8, micro_batch_size=2)
    with JobRunner(backend="nccl") as run:
        run.start(spec, 1, Layout())
        losses = [l for _, l in run.train(1)]
        reports = []
        for lay in (Layout(dp=2), Layout(tp=2), Layout(pp=2), Layout()):
            r = run.resize(lay.world_size, lay)
            reports.append({"dst": str(lay), "switch_s": r.switch_s, "bytes_moved": r.bytes_moved,
                            "lower_bound": r.bytes_lower_bound})
            losses += [l for _, l in run.train(1)]
    with JobRunner(backend="nccl") as ref_run:
        ref_run.start(spec, 1, Layout())
        ref = [l for _, l in ref_run.train(5)]
    print(json.dumps({"losses": losses, "ref": ref, "switches": reports}))
    assert all(r["bytes_moved"] == r["lower_bound"] for r in reports)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref)) < 1e-4
'
  if has pytest; then
    if timeout 1800 "$PY" -m pytest -q -p no:cacheprovider tests/runtime/test_module_jobs.py \
        > "$OUT_DIR/gpu_tests.log" 2>&1; then
      record gpu_tests passed "$(tail -c 2000 "$OUT_DIR/gpu_tests.log")"
    else
      record gpu_tests "failed" "$(tail -c 3000 "$OUT_DIR/gpu_tests.log")"
    fi
  else
    record gpu_tests "skipped: pytest missing" ""
  fi
  if timeout 1800 "$PY" -m bench.hotswitch --quick > "$OUT_DIR/bench.json" 2> "$OUT_DIR/bench.log"; then
    record bench passed "$(head -c 3000 "$OUT_DIR/bench.json")"
  else
    record bench failed "$(tail -c 3000 "$OUT_DIR/bench.log")"
  fi
else
  for c in nccl_switch gpu_tests bench; do
    record $c "skipped: needs 2 GPUs (found $GPUS) and transformers, safetensors, pydantic, numpy; NCCL puts one rank per GPU" ""
  done
fi

if [ "$GPUS" -ge 1 ] && has pynvml && has pydantic; then
  run_check node_power 180 '
import json, threading, time, torch
from worker_agent.node_power import NodeModel, NodePowerSampler
from worker_agent.protocol import GpuSlotInfo
from worker_agent.telemetry import NvmlMeter
meter = NvmlMeter()
sampler = NodePowerSampler([GpuSlotInfo(index=0)], NodeModel(60.0, 0.0), nvml=meter)
polled_j, stop = [0.0], threading.Event()
def poll():  # the reference: board power integrated at 20 Hz
    last = time.monotonic()
    while not stop.is_set():
        time.sleep(0.05)
        now = time.monotonic()
        polled_j[0] += meter.power_w([0]) * (now - last)
        last = now
threading.Thread(target=poll, daemon=True).start()
def phase(busy: bool, seconds: float, job: int | None) -> dict:
    sampler.cut({0: job} if job else {})
    start_j, cuts, t0 = polled_j[0], [], time.monotonic()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while time.monotonic() - t0 < seconds:
        if busy:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        else:
            time.sleep(0.1)
        if time.monotonic() - t0 >= len(cuts) + 1:
            cuts.append(sampler.cut({0: job} if job else {}))
    readings = [r for c in cuts for r in c.readings if r.component == "gpu"]
    counter_j = sum(r.energy_j for r in readings)
    ref_j = polled_j[0] - start_j
    return {"cuts": len(cuts), "sources": sorted({r.source for r in readings}),
            "job_ids": sorted({r.job_id or 0 for r in readings}),
            "counter_j": round(counter_j, 1), "polled_j": round(ref_j, 1),
            "mean_w": round(counter_j / sum(c.interval_s for c in cuts), 1),
            "rel_diff": round(abs(counter_j - ref_j) / ref_j, 4)}
out = {"gpu": meter.describe(0)[0], "idle": phase(False, 8, None), "busy": phase(True, 15, 7)}
stop.set()
print(json.dumps(out))
for p in ("idle", "busy"):
    assert out[p]["sources"] == ["nvml"], out
    assert out[p]["rel_diff"] < 0.1, out
assert out["busy"]["job_ids"] == [7] and out["idle"]["job_ids"] == [0]
assert out["busy"]["mean_w"] > out["idle"]["mean_w"]
'
else
  record node_power "skipped: needs a GPU, pynvml and pydantic" ""
fi

if [ "$GPUS" -ge 1 ] && [ "$MODULE_OK" = 1 ]; then
  run_check step_time 900 '
import json, time, torch
from worker_agent.runtime.presets import JobSpec
from worker_agent.runtime.runner import JobRunner
from worker_agent.sharding import Layout
if __name__ == "__main__":
    out = {}
    for model, precision in (("gpt2-124m", "fp32"), ("gpt2-124m", "bf16"), ("llama-350m", "bf16")):
        spec = JobSpec(model=model, global_batch_size=16, micro_batch_size=8,
                       options={"precision": precision, "seq_len": 512})
        with JobRunner(backend="nccl") as run:
            run.start(spec, 1, Layout())
            run.train(2)
            t0 = time.perf_counter()
            run.train(5)
            out[f"{model}/{precision}"] = {"step_s": round((time.perf_counter() - t0) / 5, 4),
                              "tokens_per_s": round(5 * 16 * 512 / (time.perf_counter() - t0))}
    print(json.dumps(out))
'
else
  record step_time "skipped: needs a GPU and transformers" ""
fi

"$PY" - "$RESULTS" "$OUT_DIR/gpu_check.json" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
doc = {"checks": rows, "summary": {r["check"]: r["status"] for r in rows}}
open(sys.argv[2], "w").write(json.dumps(doc, indent=2))
print(json.dumps(doc["summary"], indent=2))
EOF
