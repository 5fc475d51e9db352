#!/usr/bin/env bash
# The one command for a lent GPU machine: GPU tests, the CUDA sanitizer, the copy-bandwidth probe and
# the GPU bench presets, planned within a time budget, most valuable first, and every result copied
# into $OUT after every phase (and every 15 s during one), so a kill at any point returns everything
# finished so far.
#
# Runbook (from the repo root; docs/gpu-run.md has the two prepared device-tool calls):
#   scripts/gpu_run.sh --budget 330 --commit abc1234 --label call1 env tests probe 1b   # call 1 (~5.5 min)
#   scripts/gpu_run.sh --budget 330 --commit abc1234 --label call2 env sanitizer 8b     # call 2 (~5.5 min)
#   scripts/gpu_run.sh --dry-run --budget 120                                # CPU: the same phases, tiny
#   scripts/gpu_run.sh                                                       # every default phase, no budget
#
# Options:
#   --budget SECONDS  wall-clock budget for the whole script. A phase whose estimate exceeds what is
#                     left is skipped (recorded, with the reason); a phase that runs is stopped at
#                     min(its cap, what is left) (SIGTERM: the bench then rewrites its files saying
#                     what is missing). 10 s are kept for the last copy into $OUT.
#   --commit SHA      the commit the results record (the device gets a copy of the tree without .git).
#   --results DIR     where results go (default bench/results/<device-slug>; dry-run: a temp folder).
#   --label NAME      suffix of this call's own files (gpu_run_NAME.log, summary_NAME.json, env_NAME.json),
#                     so two calls' results unpack into one folder without overwriting each other.
#   --dry-run         CPU: every phase at a tiny size, on the emulated accelerator where it needs a device
#                     (tests/offload/test_gpu_offload.py's emulated twins for tests and sanitizer). CI runs
#                     it (tests/test_gpu_run.py) so this script cannot rot between GPU runs.
#
# Phases, in priority order (default: env tests probe 1b sanitizer 8b predict 3b 8b-8k; plan-* by name):
#   env        python -m bench.env: versions, device, psutil.virtual_memory(), settings -> env.json
#   tests      pytest -m "gpu and not slow" tests (the 1000-step soak excluded), per-test deadline
#              (scripts/pytest_deadline.py) -> gpu_tests.txt (streamed) + gpu_tests.xml
#   probe      python -m bench.probe --max-mb 256: pinned/pageable H2D/D2H -> probe.json
#   1b         python -m bench --preset 1b, 3 steps, no compiled strategies (COMPILE=1 keeps them)
#   sanitizer  TORCH_CUDA_SANITIZER=1 pytest over the stream/race tests -> sanitizer.txt + sanitizer.xml
#   8b         python -m bench --preset 8b --seq 4096, 3 steps, no compile
#   predict    python -m bench.predicted_vs_measured over the bench JSONs in the results folder (CPU work:
#              offload.predict for the same presets on the GPU meta.device_name maps to) ->
#              predicted_vs_measured.json/.md (dry-run: --gpu h100-sxm stands in for the CPU device)
#   3b 8b-8k   python -m bench --preset 3b | --preset 8b --seq 8192
#   plan-1b plan-8b   the planner's frontier (needs pulp + pwlf wheels in .whl/)
# STEPS=N changes the measured steps of the bench phases (default 3).
#
# What comes back in $OUT (at most 8 files, all at its top level): results_<device>.tar.gz (the whole
# results folder), gpu_run[_LABEL].log (streamed as written), summary[_LABEL].json (every phase: status,
# seconds, estimate, limit, reason; the phase in flight is "running"), gpu_tests.txt, sanitizer.txt.
# Commit them: tar -xzf results_<device>.tar.gz -C bench/results (docs/gpu-run.md).
#
# Wheels in .whl/ (trl; pulp + pwlf for plan-*) are installed into /tmp/site first (not in --dry-run).
# Exit status: 0 when no phase failed (skipped ones do not fail), 1 when one did, 2 for bad arguments
# or no GPU without --dry-run, 128+signal when killed.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
PY=${PYTHON:-python3}
export PYTHONPATH=".:scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # deterministic cuBLAS (bench/verdict.py)
RESERVE=10         # seconds kept for the last copy into $OUT
PACK_EVERY=${PACK_EVERY:-15}
STEPS=${STEPS:-3}

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
BUDGET="" DRY="" COMMIT="${OFFLOAD_GIT_COMMIT:-}" RES="" LABEL=""
phases=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --budget=*) BUDGET=${1#*=}; shift ;;
    --commit) COMMIT=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --commit=*) COMMIT=${1#*=}; shift ;;
    --results) RES=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --results=*) RES=${1#*=}; shift ;;
    --label) LABEL=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --label=*) LABEL=${1#*=}; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) phases+=("$1"); shift ;;
  esac
done
if [ -n "$BUDGET" ] && ! [[ "$BUDGET" =~ ^[0-9]+$ ]]; then
  echo "gpu_run.sh: --budget '$BUDGET' must be whole seconds, e.g. --budget 330" >&2; exit 2
fi
if ! [[ "$LABEL" =~ ^[A-Za-z0-9_-]*$ ]]; then
  echo "gpu_run.sh: --label '$LABEL' may hold only letters, digits, '_' and '-' (it names files)" >&2; exit 2
fi
SFX=${LABEL:+_$LABEL}
[ ${#phases[@]} -eq 0 ] && phases=(env tests probe 1b sanitizer 8b predict 3b 8b-8k)

# name: estimate and cap in seconds on a GPU, then in --dry-run. The estimate decides whether a phase starts;
# the cap bounds how long it may run. env, tests, probe, 1b, sanitizer and 8b: measured on the H200 run
# (bench/results/nvidia-h200/summary_call*.json: 5, 169, 7, 76, 60 and 249+ s, the 8b phase cut at its cap
# with two strategies left; a little added for the tests and strategies added since); the rest from
# ../shared/research/gpu-readiness-2026-11.md. GPU_RUN_EST_<phase> (e.g. GPU_RUN_EST_8b_8k=400) overrides one.
declare -A EST=(
  [env]="10 40 5 60" [tests]="200 240 15 120" [probe]="15 75 8 60" [1b]="90 120 15 120"
  [sanitizer]="70 150 15 120" [8b]="230 250 15 120" [predict]="45 120 10 90" [3b]="150 240 15 120"
  [8b-8k]="300 420 15 120" [plan-1b]="450 590 2 30" [plan-8b]="590 590 2 30" [sleep]="600 600 1 600"
)
for ph in "${phases[@]}"; do
  if [ -z "${EST[$ph]:-}" ] || { [ "$ph" = sleep ] && [ -z "$DRY" ]; }; then
    echo "gpu_run.sh: unknown phase '$ph' (phases: env tests probe 1b sanitizer 8b predict 3b 8b-8k plan-1b plan-8b)" >&2
    exit 2
  fi
done

if [ -n "$DRY" ]; then
  DEV=dry-run-cpu
  RES=${RES:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_run_dry.XXXXXX")/$DEV}
else
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_run.sh: torch.cuda.is_available() is False here; this script is for a CUDA machine" \
         "(on CPU: scripts/gpu_run.sh --dry-run)" >&2
    exit 2
  fi
  DEV=$("$PY" -c "from bench.env import device_slug; print(device_slug('cuda'))")
  RES=${RES:-bench/results/$DEV}
fi
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
[ -n "$COMMIT" ] && export OFFLOAD_GIT_COMMIT="$COMMIT"
LOG="$RES/gpu_run$SFX.log"
STATE="$RES/.phases$SFX.tsv"
: >"$STATE"
LOGS=("$LOG")
[ -n "${OUT:-}" ] && { mkdir -p "$OUT"; LOGS+=("$OUT/gpu_run$SFX.log"); }
say() { echo "$*" | tee -a "${LOGS[@]}"; }

summary() {  # summary.json from the phase table, into $RES (and $OUT)
  "$PY" - "$STATE" "$RES/summary$SFX.json" "${phases[*]}" "$BUDGET" "$DRY" "${OFFLOAD_GIT_COMMIT:-}" "$DEV" \
        "$((SECONDS - T0))" <<'EOF'
import json, os, sys
state, out, planned, budget, dry, commit, dev, elapsed = sys.argv[1:]
rows = {}
for line in open(state):
    name, status, rc, secs, est, limit, reason = line.rstrip("\n").split("\t")
    rows[name] = {"phase": name, "status": status, "rc": None if rc == "" else int(rc),
                  "seconds": None if secs == "" else int(secs), "estimate_s": int(est),
                  "limit_s": None if limit == "" else int(limit), "reason": reason}
phases = [rows.get(p, {"phase": p, "status": "pending", "reason": "not reached yet"}) for p in planned.split()]
data = {"script": "scripts/gpu_run.sh", "device": dev, "dry_run": bool(dry), "commit": commit or None,
        "budget_s": int(budget) if budget else None, "elapsed_s": int(elapsed), "phases": phases}
tmp = out + ".part"
with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
os.replace(tmp, out)
EOF
}

copy_in() {  # copy_in SRC NAME: atomically into $OUT (the last 15 MiB of a text file at most)
  local tmp="$OUT/.$2.$BASHPID.part"
  tail -c 15728640 "$1" >"$tmp" 2>/dev/null && mv -f "$tmp" "$OUT/$2"
  rm -f "$tmp"
}

pack() {  # everything so far into $OUT: the results folder as one tar, the text logs beside it
  [ -n "${OUT:-}" ] || return 0
  local tmp="$OUT/.results.$BASHPID.part"
  if tar -czf "$tmp" -C "$(dirname "$RES")" --exclude='.phases*.tsv'  "$(basename "$RES")" 2>/dev/null; then
    mv -f "$tmp" "$OUT/results_$DEV.tar.gz"
  fi
  rm -f "$tmp"
  for f in "summary$SFX.json" gpu_tests.txt sanitizer.txt; do
    [ -f "$RES/$f" ] && copy_in "$RES/$f" "$f"
  done
  return 0
}

record() {  # record NAME STATUS RC SECONDS EST LIMIT REASON
  grep -v "^$1	" "$STATE" >"$STATE.new"; mv -f "$STATE.new" "$STATE"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$STATE"
  summary
}

# -------------------------------------------------------------- the phases' commands
PYTEST=("$PY" -m pytest -p no:cacheprovider -p pytest_deadline -rA -v)
RACE_K="race or known_bug or retain_graph or streams or inplace or exception_mid_forward"
skip_reason() {  # why a phase cannot run here ("" if it can)
  case "$1" in
    predict)
      if [ ! -e offload/predict/__init__.py ] && [ ! -e offload/predict.py ]; then
        echo "offload.predict is not in this tree (issues 33/34): no predicted_vs_measured.json"
      elif [ ! -f bench/predicted_vs_measured.py ]; then
        echo "bench/predicted_vs_measured.py (offload.predict's numbers for the measured presets) is not written yet"
      fi ;;
    plan-1b|plan-8b) [ -n "$DRY" ] && echo "the planner's frontier has no tiny stand-in in --dry-run" ;;
  esac
}

phase_cmd() {  # the command of phase $1, GPU or dry-run
  local dry_bench=(--emulate --steps 1 --warmup 0 --dim 32 --layers 1 --vocab 64 --no-probe --no-plot --quiet)
  # Most valuable first (the bench rewrites its files after each strategy, so a cap keeps what ran): the
  # targets' strategies, the partial offloads, the peers; the slow synchronous ones last.
  local order=none,ac,offload_ac,offload,offload_part,offload_part_bytes,offload_head_excluded,account_only
  order+=,sac,trl,torchtune,compile,compile_offload,offload_sync,save_on_cpu
  local gpu_bench=(--device cuda --steps "$STEPS" --warmup 1 --out "$RES" --strategies "$order")
  local nocompile=(--skip compile,compile_offload)
  [ -n "${COMPILE:-}" ] && nocompile=()
  case "$1:${DRY:+dry}" in
    env:*)        CMD=("$PY" -m bench.env --out "$RES/env$SFX.json") ;;
    tests:)       CMD=("${PYTEST[@]}" -m "gpu and not slow" tests --deadline "${TEST_DEADLINE:-90}"
                       --junitxml="$RES/gpu_tests.xml") ;;
    tests:dry)    CMD=("${PYTEST[@]}" -m "emulated and not slow" tests/offload/test_gpu_offload.py
                       -k "race_d2h_waits or retain_graph" --deadline 60 --junitxml="$RES/gpu_tests.xml") ;;
    sanitizer:)   CMD=(env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" -m "gpu and not slow" tests/offload/test_gpu_offload.py
                       -k "$RACE_K" --deadline "${TEST_DEADLINE:-90}" --junitxml="$RES/sanitizer.xml") ;;
    sanitizer:dry) CMD=("${PYTEST[@]}" -m "emulated and not slow" tests/offload/test_gpu_offload.py
                       -k "race_source_block" --deadline 60 --junitxml="$RES/sanitizer.xml") ;;
    probe:)       CMD=("$PY" -m bench.probe --max-mb 256 --out "$RES") ;;
    probe:dry)    CMD=("$PY" -m bench.probe --device cpu --max-mb 1 --no-contention --out "$RES") ;;
    1b:)          CMD=("$PY" -m bench --preset 1b "${gpu_bench[@]}" "${nocompile[@]}") ;;
    8b:)          CMD=("$PY" -m bench --preset 8b --seq 4096 "${gpu_bench[@]}" "${nocompile[@]}") ;;
    3b:)          CMD=("$PY" -m bench --preset 3b "${gpu_bench[@]}" "${nocompile[@]}") ;;
    8b-8k:)       CMD=("$PY" -m bench --preset 8b --seq 8192 "${gpu_bench[@]}" "${nocompile[@]}") ;;
    1b:dry)       CMD=("$PY" -m bench --seq 16 --strategies none,offload,offload_ac,offload_part "${dry_bench[@]}" --out "$RES") ;;
    8b:dry)       CMD=("$PY" -m bench --seq 24 --strategies none,offload "${dry_bench[@]}" --out "$RES") ;;
    3b:dry)       CMD=("$PY" -m bench --seq 20 --strategies none,offload "${dry_bench[@]}" --out "$RES") ;;
    8b-8k:dry)    CMD=("$PY" -m bench --seq 28 --strategies none,offload "${dry_bench[@]}" --out "$RES") ;;
    plan-1b:)     CMD=("$PY" -m bench --device cuda --preset 1b --plan --out "$RES" --steps "$STEPS") ;;
    plan-8b:)     CMD=("$PY" -m bench --device cuda --preset 8b --seq 4096 --plan --out "$RES" --steps "$STEPS") ;;
    predict:)     CMD=("$PY" -m bench.predicted_vs_measured --results "$RES" --quiet) ;;
    predict:dry)  CMD=("$PY" -m bench.predicted_vs_measured --results "$RES" --gpu h100-sxm --quiet) ;;  # cpu: a stand-in
    sleep:dry)    CMD=(sleep 600) ;;  # dry-run only: a phase to kill (tests/test_gpu_run.py)
  esac
}

# -------------------------------------------------------------- signals: record, copy, go
CHILD="" PACKER="" CURRENT="" CUR_T0=0 CUR_EST=0 CUR_LIMIT=""
on_signal() {
  trap - TERM INT
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
  [ -n "$PACKER" ] && { kill "$PACKER" 2>/dev/null; wait "$PACKER" 2>/dev/null; }
  if [ -n "$CURRENT" ]; then
    record "$CURRENT" killed "" "$((SECONDS - CUR_T0))" "$CUR_EST" "$CUR_LIMIT" "the script got SIG$1 during this phase"
  fi
  say "== gpu_run.sh: SIG$1 at $((SECONDS - T0))s; results so far are in ${OUT:-$RES}"
  pack
  exit $((128 + $2))
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT

# -------------------------------------------------------------- the run
say "== gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) device $DEV${DRY:+ (dry run)} budget ${BUDGET:-none}s" \
    "commit ${OFFLOAD_GIT_COMMIT:-unknown} phases: ${phases[*]}"
summary
pack
status=0
for ph in "${phases[@]}"; do
  read -r est cap dest dcap <<<"${EST[$ph]}"
  [ -n "$DRY" ] && est=$dest cap=$dcap
  # GPU_RUN_EST_<phase>=SECONDS overrides a phase's estimate (tuning after a measured run; tests)
  ov="GPU_RUN_EST_${ph//-/_}"; [ -n "${!ov:-}" ] && est=${!ov}
  limit=$cap
  if [ -n "$BUDGET" ]; then
    left=$((BUDGET - (SECONDS - T0) - RESERVE))
    if [ "$est" -gt "$left" ]; then
      record "$ph" skipped "" "" "$est" "" "estimated ${est}s > ${left}s left of the ${BUDGET}s budget"
      say "== [$ph] skipped: estimated ${est}s > ${left}s left"
      continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  why=$(skip_reason "$ph")
  if [ -n "$why" ]; then
    record "$ph" skipped "" "" "$est" "" "$why"
    say "== [$ph] skipped: $why"
    continue
  fi
  phase_cmd "$ph"
  CURRENT=$ph CUR_T0=$SECONDS CUR_EST=$est CUR_LIMIT=$limit
  record "$ph" running "" "" "$est" "$limit" "started at $((SECONDS - T0))s"
  pack
  say "== [$ph] (estimate ${est}s, limit ${limit}s) ${CMD[*]}"
  tees=("${LOGS[@]}")
  case "$ph" in tests) tees+=("$RES/gpu_tests.txt") ;; sanitizer) tees+=("$RES/sanitizer.txt") ;; esac
  if [ -n "${OUT:-}" ]; then
    # TERM from the phase's end lets a pack in progress finish (its tar and mv), so no half-written
    # .part file is left in $OUT: the trap only sets a flag, checked between packs.
    ( stop=0; trap 'stop=1' TERM; trap - INT
      while [ "$stop" = 0 ]; do
        sleep "$PACK_EVERY" & wait $! 2>/dev/null; kill $! 2>/dev/null
        [ "$stop" = 0 ] && pack
      done ) &
    PACKER=$!
  fi
  timeout --foreground --signal=TERM --kill-after=15 "$limit" "${CMD[@]}" > >(tee -a "${tees[@]}") 2>&1 &
  CHILD=$!
  wait "$CHILD"
  rc=$?
  CHILD=""
  [ -n "$PACKER" ] && { kill "$PACKER" 2>/dev/null; wait "$PACKER" 2>/dev/null; PACKER=""; }
  secs=$((SECONDS - CUR_T0))
  case "$rc" in
    0) st=ok why="" ;;
    124|137) st=timeout why="stopped at its ${limit}s limit (SIGTERM, then SIGKILL 15 s later)" ;;
    5) st=ok why="no test collected (pytest exit 5)" ;;
    3) st=partial why="the bench stopped early: see meta.partial in its JSON" ;;
    *) st=failed why="exit status $rc" ;;
  esac
  [ "$st" = ok ] || status=1
  CURRENT=""
  record "$ph" "$st" "$rc" "$secs" "$est" "$limit" "$why"
  say "== [$ph] $st rc=$rc in ${secs}s${why:+ ($why)}"
  pack
done
say "== gpu_run.sh done in $((SECONDS - T0))s, status $status; results in $RES${OUT:+, copied into $OUT}"
pack
exit "$status"
