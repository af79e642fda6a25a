#!/usr/bin/env bash
# pdserve's one GPU check (issue 15): about 4.5 minutes on an H200 (243 s on 2026-11-27 before
# step 3b; its step timeouts add up to 775 s with step 3c's), from the repo root.
#
#   bash bench/gpu_check.sh            # on the GPU machine; results under $OUT (default ./gpu_out, git-ignored)
#   bash bench/gpu_check.sh --dry-run  # on a CPU: every step with tiny shapes (CI runs this); results
#                                      # under $OUT (default: a new temporary directory, printed at the end)
#
# Steps (each under its own timeout, so one hang cannot eat the lease):
#   0. the environment: card, versions, which optional packages the image lacks;
#   1. the GPU-only tests: tests/kernels compiled on the device, tests/gpu (engine on CUDA,
#      fp32 greedy and bf16 logits against transformers on the device, CUDA graphs against
#      eager, chunked prefill against a synchronised run, the memory plan);
#   2. bench/kernels_gpu.py: ceilings, bf16 kernel checks against float64, decode/prefill
#      timings against the copy bandwidth and SDPA (cuDNN beside it);
#   3. bench/gpu_e2e.py: tiny-model step time, Llama-3-8B-shaped random bf16 decode at
#      batch 1/8/32/64 eager, with CUDA graphs, and with graphs and async scheduling, against the
#      bytes/HBM limit, and the long prompt chunked vs one pass;
#  3c. bench/gpu_served.py: the gateway over HTTP in front of a prefill and a decode worker on the
#      card, without Ray (served greedy = offline on the tiny model; the 8B shape at 64 streams:
#      served tok/s, TTFT, TPOT against the engine's own rate); its results go into e2e.json;
#  3b. bench/gpu_profile.py: the 8B shape's decode kernels under torch.profiler, time per family
#      (GEMV, attention, norms...) against the bytes floor (tables in the log only);
#   4. bench/gpu_summary.py: one table (gpu_check.txt, Markdown for docs/gpu.md) and gpu_check.json.
# $OUT gets 8 files (all the device tool brings back): gpu_check.log, pytest_gpu.xml,
# pytest_kernels.xml, kernels_gpu.json, kernels_gpu.txt, e2e.json, gpu_check.json, gpu_check.txt.
# Exit status: non-zero when a test or check failed or a step produced nothing.
set -u -o pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
if [ -z "${OUT:-}" ]; then
  if [ "$DRY" = 1 ]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX"); else OUT=$PWD/gpu_out; fi
fi
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PDSERVE_CACHE_DIR=${PDSERVE_CACHE_DIR:-${TMPDIR:-/tmp}/pdserve-cache}
PY=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
: > "$LOG"
T0=$(date +%s)
step() { printf '\n=== [%s s] %s\n' "$(( $(date +%s) - T0 ))" "$*" | tee -a "$LOG"; }
run() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1
  step "0. environment (dry run on the CPU)"
  run timeout 60 "$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
  step "1. GPU-only tests: collected (they skip without CUDA)"
  # Both at once (each is mostly one core importing torch), their lines into the log in order.
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/gpu --junitxml="$OUT/pytest_gpu.xml" \
      > "$OUT/collect_gpu.tmp" 2>&1 &
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider --collect-only tests/kernels \
      --junitxml="$OUT/pytest_kernels.xml" > "$OUT/collect_kernels.tmp" 2>&1
  wait
  for f in "$OUT/collect_gpu.tmp" "$OUT/collect_kernels.tmp"; do tail -2 "$f" | tee -a "$LOG"; rm -f "$f"; done
  step "2. kernels bench (dry run)"
  run timeout 300 "$PY" bench/kernels_gpu.py --dry-run
  step "3. end to end (dry run)"
  run timeout 300 "$PY" bench/gpu_e2e.py --dry-run
  step "3c. served over HTTP without Ray (dry run)"
  run timeout 300 "$PY" bench/gpu_served.py --dry-run
  step "3b. where a decode step's time goes (dry run)"
  run timeout 120 env -u OUT "$PY" bench/gpu_profile.py --dry-run --batches 1,2 --steps 3
else
  step "0. environment"
  run timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  run timeout 15 "$PY" - <<'EOF'
import importlib.util as u, torch, triton, numpy, transformers
p = torch.cuda.get_device_properties(0)
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| triton", triton.__version__, "| numpy",
      numpy.__version__, "| transformers", transformers.__version__)
print(p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
print({m: u.find_spec(m) is not None for m in ("zmq", "ray", "pydantic", "cryptography", "xdist", "pytest_timeout")})
EOF
  step "1. GPU-only tests: tests/gpu (the engine on CUDA), then tests/kernels compiled on the device"
  # -o filterwarnings: pyproject names a pydantic warning class, and the lent image has no
  # pydantic (pytest would exit 4). tests/gpu runs alone: its memory-plan test reads the
  # device's free memory, which parallel workers would change. Two runs, two reports: a
  # timeout in the second keeps the first's.
  PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o "filterwarnings=ignore::DeprecationWarning" -rfE)
  run timeout 90 "${PYTEST[@]}" tests/gpu --junitxml="$OUT/pytest_gpu.xml"
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  run timeout 110 "${PYTEST[@]}" "${XDIST[@]}" tests/kernels --ignore=tests/kernels/test_static_compile.py \
      --ignore=tests/kernels/test_gpu_script_dry_run.py --junitxml="$OUT/pytest_kernels.xml"
  step "2. kernels bench (no tuning sweep: bench/kernels_gpu.py --tune is its own run)"
  run timeout 95 "$PY" bench/kernels_gpu.py
  step "3. end to end"
  run timeout 200 "$PY" bench/gpu_e2e.py
  step "3c. served over HTTP without Ray: 1P+1D on the card, the 8B shape at 64 streams"
  run timeout 240 "$PY" bench/gpu_served.py
  # The profile's tables go to the log only (OUT unset): the device tool brings back 8 files.
  step "3b. where a decode step's time goes: kernel time per family at batch 1, 8 and 64"
  run timeout 60 env -u OUT "$PY" bench/gpu_profile.py --batches 1,8,64
fi
step "4. summary"
run "$PY" bench/gpu_summary.py "$OUT" --seconds "$(( $(date +%s) - T0 ))"
status=$?
ls -la "$OUT" | tee -a "$LOG"
echo "results: $OUT" | tee -a "$LOG"
exit "$status"
