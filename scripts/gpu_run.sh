#!/usr/bin/env bash
# The one command for a lent GPU machine: GPU tests, the CUDA sanitizer, the copy-bandwidth probe and
# the GPU bench, planned within a time budget, most valuable first, and every result copied into $OUT
# after every phase (and every 15 s during one), so a kill at any point returns everything finished so far.
#
# Runbook (from the repo root; docs/gpu-run.md has the two prepared device-tool calls, ready to paste):
#   scripts/gpu_run.sh --budget 330 --commit abc1234 --run 2026-12-01-abc1234 --label call1 \
#       env errors tests sanitizer probe 1b-hooks                                 # call 1: correctness (~5.5 min)
#   scripts/gpu_run.sh --budget 330 --commit abc1234 --run 2026-12-01-abc1234 --label call2 \
#       env plans 8b                                                               # call 2: speed (~5.5 min)
#   scripts/gpu_run.sh --budget 140 --commit abc1234 --run 2026-12-01-abc1234 --label call3 \
#       env long                                                   # call 3, while warm and time is left (~2.5 min)
#   scripts/gpu_run.sh --dry-run --budget 120                                # CPU: the same phases, tiny
#   scripts/gpu_run.sh                                                       # every default phase, no budget
#
# Options:
#   --budget SECONDS  wall-clock budget for the whole script. A phase whose estimate exceeds what is
#                     left is skipped (recorded, with the reason); a phase that runs is stopped at
#                     min(its cap, what is left) (SIGTERM: the bench then rewrites its files saying
#                     what is missing). 10 s are kept for the last copy into $OUT.
#   --commit SHA      the commit the results record (the device gets a copy of the tree without .git).
#   --run NAME        the run's own folder, bench/results/<device-slug>/NAME (default: <UTC date>-<commit>): every
#                     call of one GPU session names the same run, so its files sit together and never mix
#                     with another run's. Nothing is appended across runs; a phase run again overwrites its files.
#   --results DIR     the run's folder itself, instead (dry-run default: a temp folder).
#   --label NAME      suffix of this call's own files (gpu_run_NAME.log, summary_NAME.json, env_NAME.json),
#                     so two calls' results share the run's folder without overwriting each other.
#   --dry-run         CPU: every phase at a tiny size, on the emulated accelerator where it needs a device
#                     (tests/offload/test_gpu_offload.py's emulated twins for errors, tests and sanitizer). CI
#                     runs it (tests/test_gpu_run.py) so this script cannot rot between GPU runs.
#
# Phases, in priority order (default: env errors tests sanitizer probe plans 8b long predict 1b-hooks 1b 3b 8b-8k;
# plan-* by name). A phase that writes its files only at its end (plans) goes before one that rewrites them after
# every strategy (the bench presets), so a budget that runs out cuts the latter's last strategies, not the former.
#   env        python -m bench.env: versions, device, the host CPU (model, clock, governor, load), memory,
#              settings, and the GPU-trace callbacks registered after importing what the run imports -> env.json
#   errors     the in-place / unpack-hook error variants first (SystemError on the H200 runs), in a process that
#              never imports torch.cuda._sanitizer (asserted: scripts/pytest_gpu_trace.py) -> errors.txt + .xml
#   tests      pytest -m "gpu and not slow" tests, the errors phase's tests and the 1000-step soak excluded,
#              per-test deadline (scripts/pytest_deadline.py), no GPU-trace callback (asserted at the end of
#              the process) -> gpu_tests.txt (streamed) + gpu_tests.xml + gpu_trace_tests.json
#   sanitizer  TORCH_CUDA_SANITIZER=1 pytest over the stream/race/in-place tests, in its own process (its
#              callbacks asserted on) -> sanitizer.txt + sanitizer.xml + gpu_trace_sanitizer.json
#   probe      python -m bench.probe --max-mb 256: pinned/pageable H2D/D2H -> probe.json
#   plans      python -m bench --plan --preset 8b: offload.plan at 70 % and 50 % of none's activation memory,
#              each measured (peak within budget, step) beside none, ac and offload_ac, STEPS_PLAN (5) timed
#              steps each -> plan_8b_*.json/.md/.png
#   8b         python -m bench --preset 8b --seq 4096: none, ac, offload_ac, the partial sweep (the first k
#              blocks offloaded, k = 6 (offload_part), 4, 8, 10), account_only (the engine's default hooks, then
#              native and Python), k = 0, offload, STEPS_8B (6) measured steps; one profiled step of none and of
#              offload_part summarised (bench/trace_summary.py) -> 8b_L<fit>_s4096_b1_bfloat16.json/.md,
#              trace_*.json.gz
#   long       python -m bench --preset 8b --seq 8192: none, ac, offload_ac, long_context (one long-context
#              point; skipped with the reason where bench/strategies.py has no long_context)
#   predict    python -m bench.predicted_vs_measured over the bench JSONs in the run's folder (CPU work:
#              offload.predict for the same presets on the GPU meta.device_name maps to) ->
#              predicted_vs_measured.json/.md (dry-run: --gpu h100-sxm stands in for the CPU device)
#   1b-hooks   python -m bench --preset 1b: none and account_only (default, Python and native hooks)
#   1b 3b 8b-8k   python -m bench --preset 1b | 3b | 8b --seq 8192, every strategy but the compiled ones
#   plan-1b plan-8b   the planner's whole frontier (needs pulp + pwlf wheels in .whl/)
# STEPS_8B=N (default 6) the measured steps of 8b and 1b-hooks, STEPS_PLAN=N (5) the timed steps of plans, STEPS=N
# (3) those of the other bench phases.
#
# Each phase's row in summary[_LABEL].json has its status, seconds, estimate, limit, reason, the host's load
# over it (1-minute load average at start and end, CPU busy / iowait / steal %, mean clock in MHz, from /proc)
# and, for the pytest phases, the GPU-trace record of that test process.
#
# What comes back in $OUT (at most 8 files, all at its top level): results_<device>.tar.gz (the run's folder, as
# <device>/<run>/...; trace_*.json.gz left out if they would make it larger than 15 MiB), gpu_run[_LABEL].log
# (streamed as written), summary[_LABEL].json, errors.txt, gpu_tests.txt, sanitizer.txt.
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
STEPS_8B=${STEPS_8B:-6}
STEPS_PLAN=${STEPS_PLAN:-5}
TAR_MAX=15728640   # the device tool returns files of 16 MiB at most

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
BUDGET="" DRY="" COMMIT="${OFFLOAD_GIT_COMMIT:-}" RES="" LABEL="" RUN=""
phases=()
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --budget=*) BUDGET=${1#*=}; shift ;;
    --commit) COMMIT=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --commit=*) COMMIT=${1#*=}; shift ;;
    --results) RES=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --results=*) RES=${1#*=}; shift ;;
    --run) RUN=${2:-}; shift 2 || { usage >&2; exit 2; } ;;
    --run=*) RUN=${1#*=}; shift ;;
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
for opt in "label=$LABEL" "run=$RUN"; do
  if ! [[ "${opt#*=}" =~ ^[A-Za-z0-9_.-]*$ ]]; then
    echo "gpu_run.sh: --${opt%%=*} '${opt#*=}' may hold only letters, digits, '.', '_' and '-' (it names files)" >&2
    exit 2
  fi
done
SFX=${LABEL:+_$LABEL}
[ ${#phases[@]} -eq 0 ] && phases=(env errors tests sanitizer probe plans 8b long predict 1b-hooks 1b 3b 8b-8k)

# name: estimate and cap in seconds on a GPU, then in --dry-run. The estimate decides whether a phase starts;
# the cap bounds how long it may run. From the H200 runs (bench/results/nvidia-h200/2026-11-26-49b9263/
# summary_call*.json and gpu_tests.xml: env 5 s; the 51 tests 174 s in 194 s of pytest, 20 of them the native
# build; the sanitizer's 19 tests 62 s, 22 of them the synchronous bitwise variants now left out; probe 8 s;
# 8b: 10 s to start, then per strategy at 3 steps none 17 s with its two deterministic steps, ac and offload_ac
# 8 s, offload 47 s (pinning 24 GB), a partial offload 13 s, account_only 8 s; 1b 94+ s for 11 strategies), plus
# 0.4-1 s per extra 8b step, ~6 s per profiled step and a 20 s native build where call 1 left none cached: ~230 s
# for ORDER_8B, so its cap cuts the last ones (offload first); the planner: (1 + warmup + steps) steps without a
# plan and per decision (4), 3 arms and 2 budgets measured, pinning included: ~90 s. The rest from
# ../shared/research/gpu-readiness-2026-11.md. Run C (bench/results/nvidia-h200/2026-11-29-*/summary_call*.json)
# measured: env 5-9 s, errors 30, tests 131, sanitizer 45, probe 9, 1b-hooks 23, plans 110, 8b 171 (12
# strategies, 6 steps, two profiled), long 105; the estimates below follow it.
# GPU_RUN_EST_<phase> (e.g. GPU_RUN_EST_8b_8k=400) overrides one.
declare -A EST=(
  [env]="10 40 5 60" [errors]="30 90 10 90" [tests]="140 250 15 120" [sanitizer]="50 120 15 120"
  [probe]="15 75 8 60" [8b]="180 250 15 120" [plans]="115 150 10 90" [long]="110 130 10 90"
  [predict]="45 120 10 90" [1b-hooks]="30 60 8 60" [1b]="90 120 15 120" [3b]="150 240 15 120"
  [8b-8k]="300 420 15 120" [plan-1b]="450 590 2 30" [plan-8b]="590 590 2 30" [sleep]="600 600 1 600"
)
KNOWN="env errors tests sanitizer probe 8b plans long predict 1b-hooks 1b 3b 8b-8k plan-1b plan-8b"
for ph in "${phases[@]}"; do
  if [ -z "${EST[$ph]:-}" ] || { [ "$ph" = sleep ] && [ -z "$DRY" ]; }; then
    echo "gpu_run.sh: unknown phase '$ph' (phases: $KNOWN)" >&2
    exit 2
  fi
done

if [ -n "$DRY" ]; then
  DEV=dry-run-cpu
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
fi
RUN=${RUN:-$(date -u +%Y-%m-%d)-${COMMIT:-nocommit}}
if [ -z "$RES" ]; then
  if [ -n "$DRY" ]; then RES=$(mktemp -d "${TMPDIR:-/tmp}/gpu_run_dry.XXXXXX")/$DEV/$RUN
  else RES=bench/results/$DEV/$RUN; fi
fi
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
[ -n "$COMMIT" ] && export OFFLOAD_GIT_COMMIT="$COMMIT"
LOG="$RES/gpu_run$SFX.log"
STATE="$RES/.phases$SFX.tsv"
: >"$STATE"
: >"$LOG"
LOGS=("$LOG")
[ -n "${OUT:-}" ] && { mkdir -p "$OUT"; : >"$OUT/gpu_run$SFX.log"; LOGS+=("$OUT/gpu_run$SFX.log"); }
say() { echo "$*" | tee -a "${LOGS[@]}"; }

snap() {  # the host's load now: "load1,cpu_total,cpu_idle,cpu_iowait,cpu_steal,mean_mhz" (/proc; "" elsewhere)
  local l1 rest cpu u n sy id wa irq sirq st mhz
  { read -r l1 rest </proc/loadavg && read -r cpu u n sy id wa irq sirq st rest </proc/stat; } 2>/dev/null || return 0
  mhz=$(awk -F: '/^cpu MHz/ {s += $2; k++} END {if (k) printf "%.0f", s / k}' /proc/cpuinfo 2>/dev/null)
  echo "$l1,$((u + n + sy + id + wa + irq + sirq + st)),$id,$wa,$st,$mhz"
}

summary() {  # summary.json from the phase table, into $RES (and $OUT)
  "$PY" - "$STATE" "$RES/summary$SFX.json" "${phases[*]}" "$BUDGET" "$DRY" "${OFFLOAD_GIT_COMMIT:-}" "$DEV" \
        "$((SECONDS - T0))" "$RUN" "$RES" <<'EOF'
import json, os, sys
state, out, planned, budget, dry, commit, dev, elapsed, run, res = sys.argv[1:]


def load(start, end):
    """The host's load over a phase, from two snapshots (scripts/gpu_run.sh snap)."""
    if not start:
        return None
    a = start.split(",")
    b = end.split(",") if end else None
    row = {"loadavg_1m_start": float(a[0]), "loadavg_1m_end": float(b[0]) if b else None,
           "mhz_mean_start": float(a[5]) if a[5] else None, "mhz_mean_end": float(b[5]) if b and b[5] else None}
    if b:
        total = int(b[1]) - int(a[1])
        if total > 0:
            idle, iowait, steal = (int(b[i]) - int(a[i]) for i in (2, 3, 4))
            row.update(cpu_busy_pct=round(100 * (total - idle - iowait) / total, 1),
                       iowait_pct=round(100 * iowait / total, 1), steal_pct=round(100 * steal / total, 1))
    return row


rows = {}
for line in open(state):
    name, status, rc, secs, est, limit, reason, start, end = line.rstrip("\n").split("\t")
    rows[name] = {"phase": name, "status": status, "rc": None if rc == "" else int(rc),
                  "seconds": None if secs == "" else int(secs), "estimate_s": int(est),
                  "limit_s": None if limit == "" else int(limit), "reason": reason, "load": load(start, end)}
    trace = os.path.join(res, f"gpu_trace_{name}.json")
    if status not in ("skipped", "running") and os.path.isfile(trace):
        try:
            rows[name]["gpu_trace"] = json.load(open(trace))
        except ValueError:
            pass
phases = [rows.get(p, {"phase": p, "status": "pending", "reason": "not reached yet"}) for p in planned.split()]
data = {"script": "scripts/gpu_run.sh", "device": dev, "run": run, "dry_run": bool(dry), "commit": commit or None,
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

TXT_LOGS=(errors.txt gpu_tests.txt sanitizer.txt)
pack() {  # everything so far into $OUT: the run's folder as one tar (<device>/<run>/...), the text logs beside it
  [ -n "${OUT:-}" ] || return 0
  local tmp="$OUT/.results.$BASHPID.part" top parent
  parent=$(dirname "$RES"); top=$(dirname "$parent")
  if tar -czf "$tmp" -C "$top" --exclude='.phases*.tsv' "$(basename "$parent")/$(basename "$RES")" 2>/dev/null; then
    if [ "$(stat -c %s "$tmp" 2>/dev/null || echo 0)" -gt "$TAR_MAX" ]; then  # too large to come back: no raw traces
      tar -czf "$tmp" -C "$top" --exclude='.phases*.tsv' --exclude='trace_*.json.gz' \
          "$(basename "$parent")/$(basename "$RES")" 2>/dev/null
    fi
    mv -f "$tmp" "$OUT/results_$DEV.tar.gz"
  fi
  rm -f "$tmp"
  for f in "summary$SFX.json" "${TXT_LOGS[@]}"; do
    [ -f "$RES/$f" ] && copy_in "$RES/$f" "$f"
  done
  return 0
}

record() {  # record NAME STATUS RC SECONDS EST LIMIT REASON [LOAD_START LOAD_END]
  grep -v "^$1	" "$STATE" >"$STATE.new"; mv -f "$STATE.new" "$STATE"
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" "$7" "${8:-}" "${9:-}" >>"$STATE"
  summary
}

# -------------------------------------------------------------- the phases' commands
PYTEST=("$PY" -m pytest -p no:cacheprovider -p pytest_deadline -p pytest_gpu_trace -rA -v)
# The in-place / unpack-hook error variants (SystemError on the H200 runs): their own phase, first.
ERRORS_K="error_raised_in_an_unpack_hook or inplace_write_racing or shared_reload_inplace"
# The sanitizer's tests: the stream, race and in-place tests (the synchronous bitwise variants add nothing there).
RACE_K="race or known_bug or retain_graph or streams- or inplace or exception_mid_forward or error_raised"
# The 8b phase's strategies, most valuable first (the bench rewrites its files after each, so a cap keeps what
# ran): the targets' references and the frontier point (offload_part: 6 of 32 blocks), the account-only control
# (account_only: the engine's default hooks), the rest of the partial sweep, the control with each pack hook, the
# engine with every block kept whole (k = 0), and offload everything (link-bound, measured twice before: ~50 s).
ORDER_8B=none,ac,offload_ac,offload_part,account_only,offload_first4,offload_first8,offload_first10
ORDER_8B+=,account_only_native,account_only_python,offload_first0,offload
SKIP_8B_DRY=ac,offload_ac,account_only,offload_first4,offload_first8,offload_first10,account_only_native
SKIP_8B_DRY+=,offload_first0,offload
skip_reason() {  # why a phase cannot run here ("" if it can)
  case "$1" in
    predict)
      if [ ! -e offload/predict/__init__.py ] && [ ! -e offload/predict.py ]; then
        echo "offload.predict is not in this tree (issues 33/34): no predicted_vs_measured.json"
      elif [ ! -f bench/predicted_vs_measured.py ]; then
        echo "bench/predicted_vs_measured.py (offload.predict's numbers for the measured presets) is not written yet"
      fi ;;
    long) grep -q '^@_strategy("long_context"' bench/strategies.py \
            || echo "bench/strategies.py has no long_context strategy yet (issue 42)" ;;
    plan-1b|plan-8b) [ -n "$DRY" ] && echo "the planner's frontier has no tiny stand-in in --dry-run" ;;
  esac
}

phase_cmd() {  # the command of phase $1, GPU or dry-run
  local tiny=(--steps 1 --warmup 0 --dim 32 --layers 2 --vocab 64 --no-probe --no-plot --quiet --out "$RES")
  local order=none,ac,offload_ac,offload,offload_part,offload_part_bytes,offload_head_excluded,account_only
  order+=,sac,trl,torchtune,compile,compile_offload,offload_sync,save_on_cpu
  local gpu_bench=(--device cuda --steps "$STEPS" --warmup 1 --out "$RES" --strategies "$order")
  local nocompile=(--skip compile,compile_offload)
  [ -n "${COMPILE:-}" ] && nocompile=()
  local off=(--gpu-trace off --gpu-trace-record)
  case "$1:${DRY:+dry}" in
    env:*)        CMD=("$PY" -m bench.env --out "$RES/env$SFX.json") ;;
    errors:)      CMD=("${PYTEST[@]}" -m "gpu and not slow" tests/offload/test_gpu_offload.py -k "$ERRORS_K"
                       --deadline "${TEST_DEADLINE:-90}" "${off[@]}" "$RES/gpu_trace_errors.json"
                       --junitxml="$RES/errors.xml") ;;
    errors:dry)   CMD=("${PYTEST[@]}" -m "emulated and not slow" tests/offload/test_gpu_offload.py -k "$ERRORS_K"
                       --deadline 60 "${off[@]}" "$RES/gpu_trace_errors.json" --junitxml="$RES/errors.xml") ;;
    tests:)       CMD=("${PYTEST[@]}" -m "gpu and not slow" tests -k "not ($ERRORS_K)" --deadline "${TEST_DEADLINE:-90}"
                       "${off[@]}" "$RES/gpu_trace_tests.json" --junitxml="$RES/gpu_tests.xml") ;;
    tests:dry)    CMD=("${PYTEST[@]}" -m "emulated and not slow" tests/offload/test_gpu_offload.py
                       -k "race_d2h_waits or retain_graph" --deadline 60 "${off[@]}" "$RES/gpu_trace_tests.json"
                       --junitxml="$RES/gpu_tests.xml") ;;
    sanitizer:)   CMD=(env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" -m "gpu and not slow" tests/offload/test_gpu_offload.py
                       -k "$RACE_K" --deadline "${TEST_DEADLINE:-90}" --gpu-trace on
                       --gpu-trace-record "$RES/gpu_trace_sanitizer.json" --junitxml="$RES/sanitizer.xml") ;;
    sanitizer:dry) CMD=("${PYTEST[@]}" -m "emulated and not slow" tests/offload/test_gpu_offload.py
                       -k "race_source_block" --deadline 60 --gpu-trace any
                       --gpu-trace-record "$RES/gpu_trace_sanitizer.json" --junitxml="$RES/sanitizer.xml") ;;
    probe:)       CMD=("$PY" -m bench.probe --max-mb 256 --out "$RES") ;;
    probe:dry)    CMD=("$PY" -m bench.probe --device cpu --max-mb 1 --no-contention --out "$RES") ;;
    8b:)          CMD=("$PY" -m bench --preset 8b --seq 4096 --device cuda --steps "$STEPS_8B" --warmup 1 --out "$RES"
                       --strategies "$ORDER_8B" --trace none,offload_part) ;;
    # dry: a few of ORDER_8B run, the others are skipped by name (the bench refuses an unknown name in either list)
    8b:dry)       CMD=("$PY" -m bench --seq 24 --strategies "$ORDER_8B" --trace none,offload_part --no-predict
                       --skip "$SKIP_8B_DRY" "${tiny[@]}") ;;
    plans:)       CMD=("$PY" -m bench --plan --device cuda --preset 8b --seq 4096 --budgets 0.7,0.5
                       --strategies none,ac,offload_ac --steps "$STEPS_PLAN" --warmup 1 --out "$RES") ;;
    plans:dry)    CMD=("$PY" -m bench --plan --seq 16 --budgets 0.7,0.5 --strategies none,ac,offload_ac "${tiny[@]}") ;;
    long:)        CMD=("$PY" -m bench --preset 8b --seq 8192 --device cuda --steps "$STEPS" --warmup 1 --out "$RES"
                       --strategies none,ac,offload_ac,long_context) ;;
    long:dry)     CMD=("$PY" -m bench --seq 32 --strategies none,long_context --no-predict "${tiny[@]}") ;;
    1b-hooks:)    CMD=("$PY" -m bench --preset 1b --device cuda --steps "$STEPS_8B" --warmup 1 --out "$RES"
                       --strategies none,account_only,account_only_native,account_only_python) ;;
    1b-hooks:dry) CMD=("$PY" -m bench --seq 20 --strategies none,account_only,account_only_python --no-predict
                       "${tiny[@]}") ;;
    1b:)          CMD=("$PY" -m bench --preset 1b "${gpu_bench[@]}" "${nocompile[@]}") ;;
    3b:)          CMD=("$PY" -m bench --preset 3b "${gpu_bench[@]}" "${nocompile[@]}") ;;
    8b-8k:)       CMD=("$PY" -m bench --preset 8b --seq 8192 "${gpu_bench[@]}" "${nocompile[@]}") ;;
    1b:dry)       CMD=("$PY" -m bench --emulate --seq 16 --strategies none,offload,offload_ac,offload_part
                       "${tiny[@]}") ;;
    3b:dry)       CMD=("$PY" -m bench --emulate --seq 20 --strategies none,offload "${tiny[@]}") ;;
    8b-8k:dry)    CMD=("$PY" -m bench --emulate --seq 28 --strategies none,offload "${tiny[@]}") ;;
    plan-1b:)     CMD=("$PY" -m bench --device cuda --preset 1b --plan --out "$RES" --steps "$STEPS") ;;
    plan-8b:)     CMD=("$PY" -m bench --device cuda --preset 8b --seq 4096 --plan --out "$RES" --steps "$STEPS") ;;
    predict:)     CMD=("$PY" -m bench.predicted_vs_measured --results "$RES" --quiet) ;;
    predict:dry)  CMD=("$PY" -m bench.predicted_vs_measured --results "$RES" --gpu h100-sxm --quiet) ;;  # a stand-in
    sleep:dry)    CMD=(sleep 600) ;;  # dry-run only: a phase to kill (tests/test_gpu_run.py)
  esac
}

# -------------------------------------------------------------- signals: record, copy, go
CHILD="" PACKER="" CURRENT="" CUR_T0=0 CUR_EST=0 CUR_LIMIT="" CUR_LOAD=""
on_signal() {
  trap - TERM INT
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
  [ -n "$PACKER" ] && { kill "$PACKER" 2>/dev/null; wait "$PACKER" 2>/dev/null; }
  if [ -n "$CURRENT" ]; then
    record "$CURRENT" killed "" "$((SECONDS - CUR_T0))" "$CUR_EST" "$CUR_LIMIT" \
           "the script got SIG$1 during this phase" "$CUR_LOAD" "$(snap)"
  fi
  say "== gpu_run.sh: SIG$1 at $((SECONDS - T0))s; results so far are in ${OUT:-$RES}"
  pack
  exit $((128 + $2))
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT

# -------------------------------------------------------------- the run
say "== gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) device $DEV${DRY:+ (dry run)} run $RUN budget ${BUDGET:-none}s" \
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
  CURRENT=$ph CUR_T0=$SECONDS CUR_EST=$est CUR_LIMIT=$limit CUR_LOAD=$(snap)
  rm -f "$RES/gpu_trace_$ph.json"
  record "$ph" running "" "" "$est" "$limit" "started at $((SECONDS - T0))s" "$CUR_LOAD" ""
  pack
  say "== [$ph] (estimate ${est}s, limit ${limit}s) ${CMD[*]}"
  tees=("${LOGS[@]}")
  case "$ph" in
    errors|sanitizer) : >"$RES/$ph.txt"; tees+=("$RES/$ph.txt") ;;  # one phase's log: a rerun replaces it
    tests) : >"$RES/gpu_tests.txt"; tees+=("$RES/gpu_tests.txt") ;;
  esac
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
  record "$ph" "$st" "$rc" "$secs" "$est" "$limit" "$why" "$CUR_LOAD" "$(snap)"
  say "== [$ph] $st rc=$rc in ${secs}s${why:+ ($why)}"
  pack
done
say "== gpu_run.sh done in $((SECONDS - T0))s, status $status; results in $RES${OUT:+, copied into $OUT}"
pack
exit "$status"
