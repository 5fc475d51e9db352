"""``python -m bench``: every strategy on one workload, side by side, in one run.

    python -m bench                                  # CPU: tiny preset, all strategies (~2 min on 2 idle cores)
    python -m bench --preset 8b --seq 8192           # GPU: 8B-shaped blocks, as many as fit
    python -m bench --strategies none,ac,offload_ac --steps 5
    python -m bench --list                           # presets and strategies

Writes ``<run_id>.json``, ``<run_id>.md`` and ``<run_id>.png`` into a fresh run folder
``./bench_runs/<UTC time>_bench_<run_id>/`` under the current directory (gitignored; never
into the package), or into ``--out`` (``--out bench/results/cpu`` refreshes the files the
README cites). It prints a short table first (per strategy: step time x none with its 95% CI,
activation memory, gradients verdict); ``--full`` prints every other column too. The JSON and
markdown are rewritten after every strategy (strategies not yet finished are listed as
``pending``), so a run killed midway keeps what it measured; a strategy that fails is recorded
with its error and the others run on.
Exit status: 0 when every strategy has its result (errors included), 1 for stream-ordering
hazards (``--emulate``), 2 for bad arguments, 3 when the run stopped early (a CUDA context left
unusable by an error): ``meta.partial`` in the JSON lists what is missing and the command to rerun it.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import torch

from bench.env import default_device, default_run_dir, run_metadata
from bench.harness import BenchConfig, run_bench
from bench.probe import measure_ceiling
from bench.report import format_tables, write_all
from bench.results import BenchResult, to_jsonable
from bench.strategies import DEFAULT_ORDER, STRATEGIES
from bench.targets import evaluate_targets
from bench.workloads import PRESETS, Workload, resolve_dtype
from offload.sizes import to_bytes
from bench.plan_models import PLAN_MODELS
from offload.predict.presets import PRESETS as _PRESETS

__all__ = ["main", "parse_args", "config_from_args"]

_CPU_DEFAULTS = {"steps": 20, "warmup": 2, "order": "interleaved"}
_GPU_DEFAULTS = {"steps": 6, "warmup": 2, "order": "sequential"}
_EMULATED_DEFAULTS = {"steps": 2, "warmup": 1, "order": "sequential"}
_MiB = 1 << 20
EMULATED_STRATEGIES = ("none", "offload", "offload_ac", "offload_head_excluded", "offload_sync")
"""--emulate's default: the strategies that run our engine (and the reference they are compared with)."""


def _mib_or_size(option: str) -> Callable[[str], int]:
    """argparse type of a budget option: bytes from a bare number of MiB (as the option always read it), or
    from a size with a unit through offload's one size parser (NOTE [ Sizes ] in offload/sizes.py)."""
    def parse(text: str) -> int:
        try:
            mib = Decimal(text.strip())
        except InvalidOperation:  # not a bare number: a size with a unit ("2GB"), or no size at all
            try:
                return to_bytes(text, option, owner="bench", minimum=1)
            except (TypeError, ValueError) as e:  # argparse names the program and the option before it
                raise argparse.ArgumentTypeError(f"{str(e).removeprefix('bench: ')} Here a bare number means "
                                                 "MiB (0.25, 512).") from None
        if not mib.is_finite() or mib * _MiB < 1:
            raise argparse.ArgumentTypeError(f"{option}={text!r}: a budget must be a positive number of MiB "
                                             "(0.25, 512) or a size with a unit ('2GB', '1.5GiB')")
        return int(mib * _MiB)
    return parse


def _seq_arg(text: str) -> int | tuple[int, ...]:
    """argparse type of ``--seq``: a length, or (``--predict`` only) a comma list of them."""
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq {text!r} must be a number of tokens (or, with --predict, a comma "
                                         "list: 16384,32768)") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"--seq {text!r} must be positive")
    return vals[0] if len(vals) == 1 else vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: tiny on CPU, 1b on GPU")
    p.add_argument("--seq", type=_seq_arg, default=None,
                   help="sequence length (tokens); --predict: a comma list (16384,32768)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step")
    p.add_argument("--layers", type=int, default=None, help="number of blocks (turns off fit-to-memory for 8b)")
    p.add_argument("--dim", type=int, default=None, help="hidden size (heads are adjusted to keep head_dim)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: preset's; bf16 on GPU)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per strategy (CPU 20, GPU 6)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per strategy (CPU 2, GPU 2)")
    p.add_argument("--strategies", default="all",
                   help=f"comma list or 'all' ({','.join(DEFAULT_ORDER)}); --predict: of offload.predict.STRATEGIES")
    p.add_argument("--skip", default="", help="comma list of strategies to leave out (e.g. compile,compile_offload)")
    p.add_argument("--order", choices=("interleaved", "sequential"), default=None,
                   help="interleave strategies step by step (CPU default) or run them one after another (GPU)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: a new ./bench_runs/<time>_bench_<run_id>/; "
                        "bench/results/<device> refreshes the files the README cites)")
    p.add_argument("--trace", default="",
                   help="comma list of strategies (of those run) that get one more step under torch.profiler after "
                        "their measured ones: the chrome trace is written beside the results "
                        "(trace_<run_id>_<strategy>.json.gz) and summarised in them: GPU idle time, the copies and "
                        "where the exposed ones land (bench/trace_summary.py); with --predict: a PATH, as "
                        "--predict-trace")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--no-probe", action="store_true", help="skip the copy-ceiling measurement")
    p.add_argument("--no-write", action="store_true",
                   help="print only; write no files (else the JSON and markdown are rewritten after every strategy)")
    p.add_argument("--quiet", action="store_true", help="no progress indicator")
    p.add_argument("--full", action="store_true",
                   help="print every column (step ms and spread, tok/s, peak and host MiB, engine accounting, the "
                        "targets' measurements) after the short table; the .md and .json always hold them")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads; default 1 on CPU (a bench on a shared machine with 2+ threads "
                        "waits on descheduled workers: step-time spread then exceeds the median), torch's own "
                        "choice on GPU; 0 = torch's own choice")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list presets and strategies, then exit")
    p.add_argument("--emulate", action="store_true",
                   help="CPU only: run our engine's strategies on offload.testing's emulated accelerator (the "
                        "side-stream path, late data, every op checked for stream ordering); the JSON's "
                        "meta.emulator counts hazards (exit 1 if any). Times are not meaningful there.")
    p.add_argument("--plan", action="store_true", help="planner frontier vs fixed strategies (bench/plan.py)")
    p.add_argument("--max-seq", action="store_true", help="longest sequence per arm under one budget (bench/plan.py)")
    p.add_argument("--budgets", default="0.25,0.5,0.75", help="--plan: budgets as fractions of activation memory")
    p.add_argument("--predict", action="store_true",
                   help="predict a --model's step on --gpu per strategy, without a GPU (bench/predict.py; needs the "
                        "hf extra: pip install -e '.[bench,hf]')")
    p.add_argument("--gpu", default="h100-sxm", help="--predict: a GPU of offload.predict.GPUS, or a comma list")
    p.add_argument("--predict-trace", default=None, metavar="PATH",
                   help="--predict (or --predict --trace PATH): write each strategy's predicted timeline there as a Chrome trace "
                        "(PATH_<strategy>.json for several)")
    p.add_argument("--world-size", type=int, default=1,
                   help="--predict: one rank of FSDP2 over this many GPUs (1: a single GPU)")
    p.add_argument("--no-max-context", action="store_true", help="--predict: skip the longest-context search")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None,
                   help="--predict: mixed precision: parameters, gradients and AdamW state in fp32, the step computed "
                        "in this dtype (autocast; FSDP2's MixedPrecisionPolicy with --world-size > 1)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="--predict: peft LoRA r=R on the blocks' linear layers, bf16 base, AdamW on the adapters")
    p.add_argument("--max-context", action="store_true",
                   help="--predict: the longest context per card and strategy for Llama-3.1-8B, full fine-tune and "
                        "LoRA (bench/max_context.py)")
    p.add_argument("--no-predict", action="store_true", help="CPU main job: skip the 'predicted on an H100' section")
    p.add_argument("--model", default=None,
                   help=f"--plan / --max-seq: the model planned, one of {', '.join(PLAN_MODELS)} (default toy; "
                        "bench/plan_models.py; shaped by --dim/--layers/--seq/...); --predict: a preset "
                        f"({', '.join(_PRESETS)}; default llama3.1-8b) or the path of a Hugging Face config.json")
    p.add_argument("--budget-mib", dest="budget_bytes", type=_mib_or_size("--budget-mib"), default=None, metavar="SIZE",
                   help="--max-seq: device budget, a number of MiB (512) or a size with a unit ('2GB', '1.5GiB'); "
                        "default: the no-plan peak at --seq")
    p.add_argument("--tiers", action="store_true",
                   help="host tiers: host-only vs host + disk at 25/50%% host budgets (bench/tiers.py)")
    p.add_argument("--host-budget", dest="host_budget_bytes", type=_mib_or_size("--host-budget"), default=None,
                   metavar="SIZE",
                   help="--max-seq: host pool budget, a number of MiB (0.25) or a size with a unit ('2GB', "
                        "'512MiB'); compares offload with and without the disk tier")
    p.add_argument("--disk-dir", default=None, help="--tiers: directory for the disk tier (default: a temp dir)")
    return p.parse_args(argv)


GPU_PRESETS = ("1b", "3b", "8b")
"""Presets sized for a GPU (bf16, s=4096, 16-32 blocks of h>=2048): hours per step on a CPU."""


def _needs_gpu(what: str) -> str:
    return (f"{what} needs a CUDA GPU, and torch.cuda.is_available() is False on this machine.\n"
            "  On CPU run:   python -m bench                          (tiny preset, ~1-2 min on 2 cores)\n"
            "           or:  python -m bench --seq 512 --layers 8      (a larger CPU run)\n"
            "  On a machine with a CUDA GPU, this same command runs as given.")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration; ValueError (saying what to run instead) for GPU-only requests on CPU."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(_needs_gpu("--device cuda"))
    device = args.device or default_device()
    if args.preset in GPU_PRESETS and device == "cpu":
        raise ValueError(_needs_gpu(f"--preset {args.preset}"))
    on_gpu = device == "cuda"
    preset = args.preset or ("1b" if on_gpu else "tiny")
    wl: Workload = PRESETS[preset]
    changes: dict = {}
    if isinstance(args.seq, tuple):
        raise ValueError(f"--seq {','.join(map(str, args.seq))}: one length per run (a comma list is for --predict)")
    if args.seq is not None:
        changes["seq_len"] = args.seq
    if args.batch is not None:
        changes["batch"] = args.batch
    if args.layers is not None:
        changes.update(n_layers=args.layers, fit_layers=False)
    if args.dim is not None:
        head_dim = wl.dim // wl.n_heads
        changes.update(dim=args.dim, n_heads=max(1, args.dim // head_dim))
    if args.vocab is not None:
        changes["vocab_size"] = args.vocab
    if args.dtype is not None:
        resolve_dtype(args.dtype)
        changes["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(args.dtype, args.dtype)
    wl = wl.replace(**changes)
    defaults = _GPU_DEFAULTS if on_gpu else _CPU_DEFAULTS
    if args.emulate and device != "cpu":
        raise ValueError("--emulate runs on the CPU (an emulated accelerator made of CPU tensors); drop "
                         "--device cuda, or drop --emulate to measure the GPU itself")
    if args.strategies == "all" and args.emulate:
        names = EMULATED_STRATEGIES
    elif args.strategies == "all":
        names = DEFAULT_ORDER
    else:
        names = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = sorted(skip - set(STRATEGIES))
    if unknown:
        raise ValueError(f"--skip names unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    names = tuple(n for n in names if n not in skip)
    trace = tuple(n.strip() for n in args.trace.split(",") if n.strip())
    if any(n not in names for n in trace):
        raise ValueError(f"--trace {args.trace}: {[n for n in trace if n not in names]} not among the strategies "
                         f"run ({','.join(names)}); add them to --strategies or trace one of those")
    if trace and not args.no_write and args.out is None:  # the traces go beside the results: fix the folder now
        args.out = default_run_dir("bench", str(wl.run_id))
    if args.emulate:
        defaults = _EMULATED_DEFAULTS
    return BenchConfig(
        workload=wl,
        strategies=names,
        device=device,
        steps=args.steps if args.steps is not None else defaults["steps"],
        warmup=args.warmup if args.warmup is not None else defaults["warmup"],
        order=args.order or defaults["order"],
        seed=args.seed,
        progress=not args.quiet,
        trace=trace,
        trace_dir=None if args.no_write else args.out,
    )


def _list() -> str:
    lines = ["presets:"]
    for name, wl in PRESETS.items():
        lines.append(f"  {name:<5} h={wl.dim} layers={wl.n_layers}{'(fit)' if wl.fit_layers else ''} "
                     f"heads={wl.n_heads} vocab={wl.vocab_size} s={wl.seq_len} b={wl.batch} {wl.dtype}")
    lines.append("strategies:")
    for name, spec in STRATEGIES.items():
        lines.append(f"  {name:<22} [{spec.group}] {spec.description}")
    return "\n".join(lines)


def _run_emulated(cfg: BenchConfig, args: argparse.Namespace, meta: dict) -> BenchResult:
    """The strategies on offload.testing's emulated accelerator (late data + checker); hazards in meta.emulator."""
    from offload.testing import EmulatedAccelerator

    writer = _Writer(args)
    with EmulatedAccelerator(late=True) as acc:
        result = run_bench(cfg, meta, None, on_update=writer.partial)
    e = result.meta["emulator"] = acc.summary()
    e["note"] = ("offload.testing.EmulatedAccelerator(late=True): streams emulated on CPU tensors, every aten op "
                 "checked for stream ordering; step times include the checker and mean nothing here")
    print(format_tables(result, full=args.full))
    print(f"emulator: {e['ops_checked']} ops checked, {e['late_ops_run']} side-stream ops run late, "
          f"{e['hazards']} hazard(s)")
    for text in e["hazard_reports"]:
        print(text, file=sys.stderr)
    writer.final(result)
    if e["hazards"]:
        raise _Hazards(e["hazards"])
    return result


@contextlib.contextmanager
def _sigterm_as_exit() -> Any:
    """SIGTERM (a time limit's kill) raises SystemExit, so the results file is rewritten once more
    saying which strategies the kill left out (the default action would end the process at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class _Hazards(Exception):
    """--emulate found ordering hazards (the exit status says so)."""


def main(argv: list[str] | None = None) -> int:
    """Run the bench; returns the process exit code (see the module docstring)."""
    args = parse_args(argv)
    if args.list:
        print(_list())
        return 0
    if args.predict and args.max_context:
        from bench.max_context import main_max_context

        return main_max_context(args, argv)
    if args.predict:
        from bench.predict import main_predict

        return main_predict(args, argv)
    try:
        cfg = config_from_args(args)
        if args.model is not None and args.model not in PLAN_MODELS:
            raise ValueError(f"--model {args.model!r} is for --predict (a preset or a config.json); --plan and "
                             f"--max-seq plan one of {', '.join(PLAN_MODELS)}")
        args.model = args.model or "toy"
    except ValueError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else (1 if cfg.device == "cpu" else 0)
    if threads < 0:
        print(f"python -m bench: --threads={threads} must be >= 0 (0 = torch's own choice)", file=sys.stderr)
        return 2
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if args.tiers or (args.max_seq and args.host_budget_bytes is not None):
            from bench.tiers import main_max_seq_host, main_tiers

            return (main_tiers if args.tiers else main_max_seq_host)(cfg.workload, cfg.device, args, argv)
        if args.plan or args.max_seq:
            from bench.plan import main_max_seq, main_plan

            return (main_plan if args.plan else main_max_seq)(cfg.workload, cfg.device, args, argv)
        with _sigterm_as_exit():
            result = _run(cfg, args, argv)
        if "partial" in result.meta:
            print(f"python -m bench: stopped before every strategy ran; missing: "
                  f"{', '.join(result.meta['partial']['missing'])} (rerun: {result.meta['partial']['rerun']})",
                  file=sys.stderr)
            return 3
    except _Hazards as e:
        print(f"python -m bench --emulate: {e} stream-ordering hazard(s) (reports above)", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(before)  # main() is also called in-process (tests)
    return 0


class _Writer:
    """Writes the results files: after every strategy (JSON and markdown, so a run killed midway
    leaves what it finished, the rest listed as pending), and once more at the end (with the PNG).
    The folder is chosen at the first write, from the workload the run really measures."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out_dir: Path | None = None

    def _dir(self, result: BenchResult) -> Path:
        if self.out_dir is None:
            self.out_dir = (self.args.out if self.args.out is not None
                            else default_run_dir("bench", str(result.workload["run_id"])))
        return self.out_dir

    def partial(self, result: BenchResult) -> None:
        if not self.args.no_write:
            result.targets = to_jsonable(evaluate_targets(result))
            write_all(result, self._dir(result), plot=False)

    def final(self, result: BenchResult, extra_markdown: str = "") -> None:
        """The last write; ``extra_markdown`` (the predicted-on-H100 section) ends the markdown file."""
        if not self.args.no_write:
            for path in write_all(result, self._dir(result), plot=not self.args.no_plot):
                if extra_markdown and path.suffix == ".md":
                    path.write_text(path.read_text() + "\n" + extra_markdown)
                print(f"wrote {path}")


def _run(cfg: BenchConfig, args: argparse.Namespace, argv: list[str] | None) -> BenchResult:
    meta = run_metadata(cfg.device, argv if argv is not None else sys.argv[1:])
    if args.emulate:
        return _run_emulated(cfg, args, meta)
    if not args.no_probe and cfg.progress:
        print("[bench] measuring the copy ceiling (bench.probe)", file=sys.stderr)
    ceiling = None if args.no_probe else measure_ceiling(cfg.device, progress=cfg.progress)
    writer = _Writer(args)
    result = run_bench(cfg, meta, ceiling, on_update=writer.partial)
    result.targets = to_jsonable(evaluate_targets(result))
    print(format_tables(result, full=args.full))
    predicted = _predicted_section(cfg, args)
    if predicted:
        result.meta["predicted_on_h100"] = predicted[1]
    writer.final(result, predicted[0] if predicted else "")
    return result


def _predicted_section(cfg: BenchConfig, args: argparse.Namespace) -> tuple[str, dict] | None:
    """On CPU: what the same strategies would need on an H100 at a realistic size, PREDICTED (a few seconds):
    (markdown, JSON rows); the markdown goes to the run's .md, the rows to its JSON's meta."""
    if cfg.device != "cpu" or args.no_predict:
        return None
    from bench.predict import main_job_section

    section = main_job_section()
    print(section[0])
    return section
