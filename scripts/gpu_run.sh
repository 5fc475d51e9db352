#!/usr/bin/env bash
# The one command for a lent GPU machine: GPU tests, copy-bandwidth probe, GPU bench presets.
#
# Runbook (from the repo root, on the GPU machine; torch must already be installed there):
#   scripts/gpu_run.sh                      # all phases: tests probe 1b 3b 8b 8b-8k
#   scripts/gpu_run.sh tests probe 1b       # a subset, in this order
#   STEPS=3 scripts/gpu_run.sh 8b           # fewer measured steps (passed to python -m bench)
# With the device tool (10 minutes per call), split the phases over calls, e.g.
#   run: scripts/gpu_run.sh tests probe 1b     then    run: scripts/gpu_run.sh 3b 8b
#
# Phases:
#   tests   PYTHONPATH=. pytest -m gpu over the whole tests/ tree -> gpu_tests.xml (junit) + gpu_tests.txt
#   probe   python -m bench.probe: pinned/pageable H2D/D2H, 1 MB-1 GB, alone and under a matmul -> probe.json
#   1b 3b   python -m bench --preset 1b|3b (s=4096, bf16)             -> <run_id>.json/.md/.png
#           (compile and compile_offload run on 1b only unless COMPILE_ALL=1)
#   8b      python -m bench --preset 8b --seq 4096 (as many h=4096 blocks as fit)
#   8b-8k   python -m bench --preset 8b --seq 8192
#   plan-1b python -m bench --plan --preset 1b: the planner's frontier at 25/50/75 % of activation
#           memory vs none/ac/sac/offload/offload_ac, compile's activation_memory_budget and torch's
#           auto-AC ILP (needs pulp + pwlf wheels in .whl/; else listed as skipped with the error)
#   plan-8b python -m bench --plan --preset 8b --seq 4096, then --max-seq at that no-plan peak
# (plan-* are not in the default set: run them by name once the measurement phases are in.)
# Everything goes to bench/results/<device-slug>/ (plus gpu_run.log). When $OUT is set (the device
# tool's return folder), that folder is also packed into $OUT/gpu_results_<device-slug>.tar.gz and
# the log and test summary are copied next to it. Commit bench/results/<device-slug>/ afterwards.
#
# Optional peers: wheels placed in .whl/ (e.g. trl, pure Python) are installed into /tmp/site first.
# tabulate (pure Python, a dependency of offload since issue 26: the bench's and the ledger's tables)
# must be importable there too: put its wheel in .whl/ if the machine lacks it.
# Exit status: 0 when every phase succeeded, else the last failing phase's status.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_run.sh: torch.cuda.is_available() is False here; this script is for a CUDA machine" >&2
  exit 2
fi
DEV=$("$PY" -c "from bench.env import device_slug; print(device_slug('cuda'))")
RES="bench/results/$DEV"
mkdir -p "$RES"
LOG="$RES/gpu_run.log"
STEP_ARGS=()
[ -n "${STEPS:-}" ] && STEP_ARGS=(--steps "$STEPS")
# The compiled strategies run on 1b only: compiling 16-32 unrolled h>=3072 blocks twice would
# take minutes of each 10-minute device call. COMPILE_ALL=1 keeps them everywhere.
NOCOMPILE="--skip compile,compile_offload"
[ -n "${COMPILE_ALL:-}" ] && NOCOMPILE=""

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(tests probe 1b 3b 8b 8b-8k)
status=0

{ echo "== gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) phases: ${phases[*]}"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } | tee -a "$LOG"

phase() {  # phase NAME CMD...: run, log, remember a failure
  local name=$1; shift
  echo "== [$name] $*" | tee -a "$LOG"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== [$name] rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=$rc
  return 0
}

for ph in "${phases[@]}"; do
  case "$ph" in
    tests)
      echo "== [tests] pytest -m gpu tests" | tee -a "$LOG"
      "$PY" -m pytest -m gpu tests -p no:cacheprovider -rA --junitxml="$RES/gpu_tests.xml" >"$RES/gpu_tests.txt" 2>&1
      rc=$?
      tail -n 60 "$RES/gpu_tests.txt" | tee -a "$LOG"
      echo "== [tests] rc=$rc" | tee -a "$LOG"
      # pytest exit 5 = nothing collected; anything else non-zero is a failure
      [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && status=$rc ;;
    probe) phase probe "$PY" -m bench.probe --out "$RES" ;;
    1b)    phase 1b "$PY" -m bench --device cuda --preset 1b --out "$RES" "${STEP_ARGS[@]}" ;;
    3b)    phase 3b "$PY" -m bench --device cuda --preset 3b --out "$RES" $NOCOMPILE "${STEP_ARGS[@]}" ;;
    8b)    phase 8b "$PY" -m bench --device cuda --preset 8b --seq 4096 --out "$RES" $NOCOMPILE "${STEP_ARGS[@]}" ;;
    8b-8k) phase 8b-8k "$PY" -m bench --device cuda --preset 8b --seq 8192 --out "$RES" $NOCOMPILE "${STEP_ARGS[@]}" ;;
    plan-1b) phase plan-1b "$PY" -m bench --device cuda --preset 1b --plan --out "$RES" "${STEP_ARGS[@]}" ;;
    plan-8b) phase plan-8b "$PY" -m bench --device cuda --preset 8b --seq 4096 --plan --out "$RES" "${STEP_ARGS[@]}"
             phase max-seq-8b "$PY" -m bench --device cuda --preset 8b --seq 4096 --max-seq --out "$RES" "${STEP_ARGS[@]}" ;;
    *) echo "gpu_run.sh: unknown phase '$ph' (phases: tests probe 1b 3b 8b 8b-8k plan-1b plan-8b)" | tee -a "$LOG"; status=2 ;;
  esac
done

if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu_results_$DEV.tar.gz" -C bench/results "$DEV"
  cp "$LOG" "$OUT/gpu_run.log"
  [ -f "$RES/gpu_tests.txt" ] && cp "$RES/gpu_tests.txt" "$OUT/gpu_tests.txt"
  echo "== packed $RES into $OUT/gpu_results_$DEV.tar.gz"
fi
exit "$status"
