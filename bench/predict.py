"""``python -m bench --predict``: what a training step would need on a named GPU, per strategy, PREDICTED.

    python -m bench --predict --gpu h100-sxm --model llama3.1-8b --seq 16384,32768
    python -m bench --predict --gpu h100-sxm,a100-80gb,l40s --model path/to/config.json --no-max-context
    python -m bench --predict --model qwen2.5-7b --strategies ac,offload_ac --predict-trace trace.json
    python -m bench --predict --model llama3-8b --layers 4     # a quick look: 4 of its 32 blocks
    python -m bench --predict --model llama3-8b --world-size 8 # one rank of FSDP2 over 8 GPUs
    python -m bench --predict --model llama3-8b --seq 8192 --mixed-precision bf16   # fp32 state, bf16 compute
    python -m bench --predict --model llama3-8b --seq 8192 --lora 16                # peft LoRA r=16, bf16 base

``--model`` is a preset (``offload.predict.presets``) or the path of a Hugging Face ``config.json`` (or of
the folder holding one); ``--gpu`` and ``--seq`` take comma lists (one table and one set of files per
pair); ``--strategies`` picks among ``offload.predict.STRATEGIES`` (default none, ac, offload, offload_ac).
For each strategy: predicted peak device memory, whether it fits the GPU's usable memory, bytes offloaded
per step, host bytes per tier, predicted step time, tokens/s, exposed copy time, step time relative to
``none`` and to ``ac``, the host link rate at which every copy would hide
(``TimelineResult.link_bytes_per_s_needed``), the longest context that fits, and how long the prediction
took on this machine (the longest-context search included; each of its probes is a progress line on
stderr). It prints a narrow table (under 100 columns; ``--full``: every column) and writes
``predict_<model>_<gpu>_s<seq>.json``, ``.md`` (every column) and ``.png`` (peak and step per strategy)
into ``--out`` (default: a fresh ``./bench_runs/<time>_predict_<model>/``); ``--predict-trace PATH`` writes each
strategy's predicted timeline as a Chrome trace. Nothing runs on a GPU: the step runs through the real
engine on fake tensors (``offload.predict``). Batch 1, AdamW, bf16 parameters unless told otherwise
(``--mixed-precision bf16``: fp32 parameters, gradients and AdamW state, bf16 compute; ``--lora R``: a bf16
base with peft adapters). Needs ``transformers``: ``pip install -e ".[bench,hf]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.env import default_run_dir

__all__ = ["STRATEGIES", "predict_rows", "add_step_ratios", "main_predict", "format_markdown", "format_short",
           "write_png", "trace_paths", "main_job_section", "lora_model_fn"]

STRATEGIES = ("none", "ac", "offload", "offload_ac")
_GiB = 1 << 30


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5)


def _link_fields(rate: float | None) -> dict[str, Any]:
    """``link_bytes_per_s_needed`` for JSON: ``inf`` (a copy awaited as soon as it is issued never hides)
    is written as null with a note, since JSON has no infinity."""
    if rate is not None and math.isinf(rate):
        return {"link_bytes_per_s_needed": None,
                "link_note": "no copy can hide: each is awaited as soon as it is issued"}
    return {"link_bytes_per_s_needed": rate}


def add_step_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row gains ``step_vs_none`` and ``step_vs_ac``: its predicted step time over that strategy's
    (None where either is missing). Returns ``rows``."""
    steps = {r["strategy"]: r.get("step_seconds") for r in rows}
    for r in rows:
        for base in ("none", "ac"):
            b, s = steps.get(base), r.get("step_seconds")
            r[f"step_vs_{base}"] = s / b if s is not None and b else None
    return rows


def trace_paths(path: str | Path, strategies: Any) -> dict[str, Path]:
    """Where ``--predict-trace PATH`` writes each strategy's Chrome trace: PATH itself for one strategy, else PATH with
    ``_<strategy>`` before its suffix (``trace.json`` -> ``trace_none.json``, ``trace_ac.json``...)."""
    path = Path(path)
    names = list(strategies)
    if len(names) == 1:
        return {names[0]: path}
    return {n: path.with_name(f"{path.stem}_{n}{path.suffix or '.json'}") for n in names}


def predict_rows(model_fn: Any, step_fn: Any, *, gpu: str, seq: int, dtype: torch.dtype | None,
                 strategies=STRATEGIES, batch: int = 1, max_context_limit: int | None = None, progress: bool = True,
                 world_size: int = 1, trace: str | Path | None = None,
                 mixed_precision: torch.dtype | None = None) -> list[dict[str, Any]]:
    """One row per strategy: the prediction at ``seq`` (``batch`` sequences a step), its predicted tokens/s,
    link rate that hides every copy and step time relative to ``none`` and ``ac``, and (with
    ``max_context_limit``) the longest context, each probe of its search a progress line on stderr;
    ``world_size > 1``: of one rank of FSDP2 over that many GPUs; ``trace``: each strategy's predicted
    timeline written there as a Chrome trace (``trace_paths``); ``mixed_precision``: the compute dtype
    (``predict_step``'s)."""
    traces = trace_paths(trace, strategies) if trace is not None else {}
    rows = []
    with _probe_lines(progress):
        for strategy in strategies:
            rows.append(_row(model_fn, step_fn, gpu=gpu, seq=seq, dtype=dtype, strategy=strategy, batch=batch,
                             max_context_limit=max_context_limit, progress=progress, world_size=world_size,
                             mixed_precision=mixed_precision, trace=traces.get(strategy)))
    return add_step_ratios(rows)


@contextlib.contextmanager
def _probe_lines(progress: bool) -> Any:
    """While a table is predicted: ``offload.predict``'s INFO lines (a line per longest-context probe) on stderr."""
    logger = logging.getLogger("offload.predict")
    if not progress:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[predict] %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _row(model_fn: Any, step_fn: Any, *, gpu: str, seq: int, dtype: torch.dtype | None, strategy: str, batch: int,
         max_context_limit: int | None, progress: bool, world_size: int,
         mixed_precision: torch.dtype | None, trace: Path | None = None) -> dict[str, Any]:
    """One strategy's row of ``predict_rows`` (``trace``: where its predicted timeline goes, if anywhere)."""
    from offload.predict import max_context, predict_step

    if progress:
        print(f"[predict] {strategy} at s={seq}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    p = predict_step(model_fn, lambda m: step_fn(m, seq), gpu=gpu, strategy=strategy, optimizer=_adamw,
                     dtype=dtype, world_size=world_size, mixed_precision=mixed_precision)
    row = {**p.to_dict(), "seq": seq, "batch": batch, "predict_seconds": round(time.perf_counter() - t0, 2)}
    row["tokens_per_s"] = batch * seq / p.step_seconds if p.step_seconds else None
    t1 = time.perf_counter()
    row.update(_link_fields(p.link_bytes_per_s_needed))
    row["exposed_copy_floor_seconds"] = p.timeline.exposed_copy_floor_seconds if p.timeline else None
    row["exposed_at_issue_seconds"] = p.timeline.exposed_at_issue_seconds if p.timeline else None
    row["link_search_seconds"] = round(time.perf_counter() - t1, 2)
    if trace is not None and p.timeline is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        p.timeline.write_trace(str(trace))
        row["trace"] = str(trace)
    if max_context_limit:
        grain = min(512, max_context_limit)  # the search's granularity (tokens)
        start = max(grain, min(seq, max_context_limit)) // grain * grain
        longest = max_context(model_fn, step_fn, gpu=gpu, strategy=strategy, optimizer=_adamw, dtype=dtype,
                              start=start, multiple=grain, limit=max_context_limit, world_size=world_size,
                              mixed_precision=mixed_precision, start_prediction=p if start == seq else None)
        row["max_context"] = int(longest)
        row["max_context_reason"] = longest.reason
        row["max_context_seconds"] = round(longest.seconds, 1)
        row["max_context_limit"] = max_context_limit
    return row


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _link(r: dict[str, Any]) -> str:
    if r.get("link_note"):
        return "never (each awaited at issue)"
    rate = r.get("link_bytes_per_s_needed")
    return "n/a" if rate is None else ("no copies" if rate == 0 else f"{rate / 1e9:.1f}")


def _took(r: dict[str, Any]) -> float:
    """Seconds this machine spent on the row: the prediction, the link search and the longest-context search."""
    return r["predict_seconds"] + r.get("link_search_seconds", 0) + r.get("max_context_seconds", 0)


def format_markdown(rows: list[dict[str, Any]], title: str) -> str:
    """A markdown table of the rows, every time column labelled as predicted on the rows' GPU."""
    gpu = rows[0]["gpu"] if rows else "?"
    lines = [f"### {title}", "",
             "| strategy | predicted peak GiB | fits | offloaded GiB/step | host pool GiB | host pageable GiB "
             f"| predicted step s on {gpu} | predicted tokens/s | predicted copies exposed s "
             "| of which awaited at issue s "
             "| predicted step vs none | predicted step vs ac | predicted link GB/s needed to hide the copies "
             "| largest context that fits | prediction took s |",
             "|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mc = r.get("max_context")
        if mc is not None and mc == r.get("max_context_limit"):
            mc = f">= {mc} (the model's position limit)"
        elif mc == 0 and r.get("max_context_reason"):
            mc = f"none: {r['max_context_reason']}"
        lines.append(f"| {r['strategy']} | {r['peak_bytes'] / _GiB:.2f} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['offloaded_bytes'] / _GiB:.2f} | {r['host_bytes']['pool'] / _GiB:.2f} | "
                     f"{r['host_bytes']['pageable'] / _GiB:.2f} | {_num(r.get('step_seconds'))} | "
                     f"{_num(r.get('tokens_per_s'), '.0f')} | {_num(r.get('exposed_copy_seconds'))} | "
                     f"{_num(r.get('exposed_at_issue_seconds'))} | "
                     f"{_ratio(r.get('step_vs_none'))} | {_ratio(r.get('step_vs_ac'))} | {_link(r)} | "
                     f"{mc if mc is not None else 'n/a'} | {_took(r):.1f} |")
    if rows:
        lines += ["", f"PREDICTED, not measured: {rows[0]['gpu_spec']}; usable "
                      f"{rows[0]['usable_bytes'] / _GiB:.2f} GiB. Step times are the timeline's (uncalibrated); "
                      "\"vs none\" / \"vs ac\" are ratios of predicted step times; the link rate is the host link "
                      "(both directions) at which no stream would wait on a copy that can hide behind compute; copies "
                      "awaited as soon as issued (a reload issued at its point of use, backward's first reload) "
                      "stall at any rate: \"of which awaited at issue\" (with an unlimited link: "
                      "`exposed_copy_floor_seconds` in the JSON). Assumptions:", ""]
        seen = dict.fromkeys(a for r in rows for a in r["assumptions"])
        lines += [f"- {a}" for a in seen]
    return "\n".join(lines) + "\n"


SHORT_COLUMNS = ("strategy", "peak GiB", "fits", "offl. GiB", "step s", "tok/s", "vs ac", "exposed s", "max ctx")
"""The default terminal table (``format_short``): under 100 columns; ``--full`` prints ``format_markdown``'s."""
WIDTH = 100
"""Columns the default output fits (a terminal's; tests/predict/test_predict_cli.py)."""


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _context(r: dict[str, Any]) -> str:
    mc = r.get("max_context")
    if mc is None:
        return "n/a"
    if mc == 0 and r.get("max_context_reason"):
        return "none"  # (the reason: --full and the .md)
    return f">={mc}" if mc == r.get("max_context_limit") else str(mc)


def format_short(rows: list[dict[str, Any]], title: str) -> str:
    """The narrow table a terminal shows (``SHORT_COLUMNS``), under a title saying PREDICTED and the GPU,
    and a line naming what ``--full`` and the files add."""
    from offload._format import render_table

    body = [[r["strategy"], f"{r['peak_bytes'] / _GiB:.2f}", "yes" if r["fits"] else "NO",
             f"{r['offloaded_bytes'] / _GiB:.2f}", _num(r.get("step_seconds")), _num(r.get("tokens_per_s"), ".0f"),
             _ratio(r.get("step_vs_ac")), _num(r.get("exposed_copy_seconds")), _context(r)]
            for r in rows]
    gpu = rows[0]["gpu"] if rows else "?"
    usable = f" (usable {rows[0]['usable_bytes'] / _GiB:.1f} GiB)" if rows else ""
    notes = (f"every figure PREDICTED for {gpu}{usable}; exposed s: time compute waits on copies; max ctx: the "
             "longest context that fits (>=: the model's position limit); --full (and the .md): host tiers, the "
             "link rate that hides the copies, what the prediction assumed")
    return "\n".join(_wrapped(title) + [render_table(body, SHORT_COLUMNS).rstrip("\n")] + _wrapped(notes)) + "\n"


def _wrapped(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, WIDTH) or [""]


def write_png(rows: list[dict[str, Any]], title: str, path: Path) -> bool:
    """Predicted peak (with the GPU's usable memory) and predicted step time per strategy, side by side.
    False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r["strategy"] for r in rows]
    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 4))
    colors = ["C0" if r["fits"] else "C3" for r in rows]
    mem.bar(names, [r["peak_bytes"] / _GiB for r in rows], color=colors)
    if rows:
        mem.axhline(rows[0]["usable_bytes"] / _GiB, color="0.3", ls="--", lw=1)
        mem.annotate(f"usable on {rows[0]['gpu']}", (0, rows[0]["usable_bytes"] / _GiB), xytext=(2, 3),
                     textcoords="offset points", fontsize=8, color="0.3")
    mem.set_ylabel("peak device memory, GiB (PREDICTED)")
    mem.set_title("red: does not fit", fontsize=8)
    step.bar(names, [r.get("step_seconds") or 0.0 for r in rows], color="C1")
    step.set_ylabel(f"step time, s (PREDICTED on {rows[0]['gpu'] if rows else '?'})")
    for ax in (mem, step):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def lora_model_fn(model_fn: Any, r: int, *, base_dtype: torch.dtype = torch.bfloat16,
                  fp32_adapters: bool = True) -> Any:
    """``model_fn`` wrapped in peft: the base model cast to ``base_dtype`` and frozen, LoRA rank ``r`` (alpha
    2r, dropout 0) on every linear layer inside its blocks (``offload.planner.find_blocks``: the attention and
    MLP projections of a transformer), the adapters as peft makes them: float32 by default (each adapted
    layer then casts its input to float32 for them, and autograd saves that copy), in ``base_dtype`` with
    ``fp32_adapters=False`` (peft's ``autocast_adapter_dtype=False``). Needs ``peft``."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"bench --predict: --lora {r!r} must be a LoRA rank >= 1 (16 is common)")

    def build() -> torch.nn.Module:
        import peft

        from offload.planner.blocks import find_blocks

        model = model_fn().to(base_dtype)
        names = [f"{b}.{n}" for b, block in find_blocks(model) for n, m in block.named_modules()
                 if n and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D")]
        if not names:
            raise ValueError("bench --predict --lora: the model's blocks hold no linear layer to adapt")
        config = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=names)
        return peft.get_peft_model(model, config, autocast_adapter_dtype=fp32_adapters)

    return build


def _fail(message: str) -> int:
    print(f"python -m bench --predict: {message}", file=sys.stderr)
    return 2


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--predict`` runs, checked before any prediction (ValueError: the message for the user)."""
    from offload.predict import STRATEGIES as ALL, resolve_gpu
    from offload.predict.presets import config_max_positions, model_config, model_label

    name = args.model or "llama3.1-8b"
    cfg = model_config(name, layers=args.layers)
    gpus = []
    for g in (g.strip() for g in str(args.gpu).split(",")):
        try:
            gpus += [resolve_gpu(g).name] if g else []  # ('h100sxm' is h100-sxm; 'h100' names both H100s)
        except ValueError as e:
            raise ValueError(f"--gpu: {str(e).removeprefix('offload.predict: ')}") from None
    if not gpus:
        raise ValueError(f"--gpu {args.gpu!r}: no GPU given (offload.predict.GPUS names them)")
    strategies = (STRATEGIES if args.strategies == "all" else
                  tuple(x.strip() for x in args.strategies.split(",") if x.strip()))
    bad = [x for x in strategies if x not in ALL]
    if bad or not strategies:
        raise ValueError(f"--strategies {args.strategies!r}: {', '.join(bad) or 'none given'} not one of "
                         f"{', '.join(ALL)} (with --predict)")
    limit = config_max_positions(cfg)
    seqs = list(args.seq) if isinstance(args.seq, tuple) else [args.seq or min(8192, limit)]  # (cli._seq_arg)
    over = [q for q in seqs if q > limit]
    if over:
        raise ValueError(f"--seq {over[0]} is beyond {name}'s {limit} positions (its max_position_embeddings)")
    if args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size} must be >= 1")
    return {"name": name, "label": model_label(name), "cfg": cfg, "gpus": gpus, "strategies": strategies,
            "seqs": seqs, "limit": limit}


def main_predict(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--predict``: a preset or a config.json (``--model``), on each ``--gpu`` at each ``--seq``."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:  # every preset and config.json is a Hugging Face model
        from offload.predict.presets import EXTRA

        print(f"python -m bench --predict needs transformers (its models are Hugging Face configs), which is not "
              f'installed: pip install -e ".[bench,{EXTRA}]" (the {EXTRA} extra; .[test] has both)', file=sys.stderr)
        return 2
    from offload.predict.presets import config_model_fn, preset_step_fn

    from bench.workloads import resolve_dtype

    mixed, lora = args.mixed_precision, args.lora
    try:
        st = _settings(args)
        dtype = resolve_dtype(args.dtype) if args.dtype else (None if mixed or lora else torch.bfloat16)
        mixed_precision = resolve_dtype(mixed) if mixed else None
        model_fn = config_model_fn(st["cfg"])
        if lora is not None:
            model_fn = lora_model_fn(model_fn, lora)  # (it refuses a rank below 1)
    except ValueError as e:
        return _fail(str(e).removeprefix("bench --predict: ").removeprefix("bench: "))
    step_fn = preset_step_fn(st["cfg"].vocab_size, batch=args.batch or 1)
    world_size = args.world_size
    # --trace is the measured bench's strategies to profile; with --predict, a PATH as --predict-trace.
    given = args.predict_trace if args.predict_trace is not None else (getattr(args, "trace", "") or None)
    path = Path(given) if given is not None else None
    out = None
    for gpu in st["gpus"]:
        for seq in st["seqs"]:
            stem = (f"predict_{st['label']}_{gpu}_s{seq}" + (f"_x{world_size}" if world_size > 1 else "")
                    + (f"_mp{mixed}" if mixed else "") + (f"_lora{lora}" if lora is not None else ""))
            trace = None
            if path is not None:  # one trace per GPU and length when several are asked for
                trace = path if len(st["gpus"]) * len(st["seqs"]) == 1 else \
                    path.with_name(f"{path.stem}_{gpu}_s{seq}{path.suffix}")
            try:
                rows = predict_rows(model_fn, step_fn, gpu=gpu, seq=seq, dtype=dtype, strategies=st["strategies"],
                                    batch=args.batch or 1, progress=not args.quiet, world_size=world_size,
                                    max_context_limit=None if args.no_max_context else st["limit"], trace=trace,
                                    mixed_precision=mixed_precision)
            except ImportError as e:
                return _fail(f"{e}: --lora needs peft (pip install peft)" if lora is not None else str(e))
            layers = f", {args.layers} blocks" if args.layers else ""
            ranks = f", one rank of FSDP2 over {world_size} GPUs" if world_size > 1 else ""
            what = (f"LoRA r={lora} on the blocks' linear layers, bf16 base, AdamW on the adapters" if lora is not None
                    else "full fine-tune, AdamW")
            title = (f"PREDICTED on {gpu}{ranks}: {st['name']}{layers}, s={seq}, b={args.batch or 1}, {what}, "
                     f"precision: {rows[0]['precision']} (offload.predict; no GPU used)")
            md = format_markdown(rows, title)
            print(md if args.full else format_short(rows, title))
            for r in rows:
                if r.get("trace"):
                    print(f"wrote {r['trace']} (Chrome trace of {r['strategy']}: https://ui.perfetto.dev)")
            if args.no_write:
                continue
            if out is None:
                out = args.out if args.out is not None else default_run_dir("predict", st["label"])
                out.mkdir(parents=True, exist_ok=True)
            cmd = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])
            (out / f"{stem}.json").write_text(json.dumps({"kind": "predicted", "command": cmd, "title": title,
                                                          "model": st["name"], "gpu": gpu,
                                                          "gpu_spec": rows[0]["gpu_spec"], "rows": rows},
                                                         indent=1, default=str))
            png = out / f"{stem}.png"
            drawn = not args.no_plot and write_png(rows, title, png)
            (out / f"{stem}.md").write_text(f"{md}\n" + (f"![peak and step per strategy]({png.name})\n\n" if drawn else "")
                                            + f"Made by `{cmd}`.\n")
            for f in (out / f"{stem}.json", out / f"{stem}.md", *([png] if drawn else [])):
                print(f"wrote {f}")
    return 0


def main_job_section(*, gpu: str = "h100-sxm", layers: int = 4, seq: int = 8192) -> tuple[str, dict[str, Any]]:
    """The CPU main job's short "predicted on an H100" section: the bench's ToyLlama at Llama-3-8B width
    (h=4096, FFN 14336, vocab 128256), ``layers`` blocks, s=8192, b=1, bf16, AdamW, per strategy; as
    (markdown, JSON-ready dict)."""
    import torch.nn.functional as F

    from bench.model import ToyLlama, ToyLlamaConfig

    cfg = ToyLlamaConfig(vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, ffn_dim=14336, max_seq_len=seq,
                         rope_theta=500000.0)

    def step_fn(model: torch.nn.Module, s: int) -> torch.Tensor:
        tokens = torch.randint(0, cfg.vocab_size, (1, s))
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    rows = predict_rows(lambda: ToyLlama(cfg), step_fn, gpu=gpu, seq=seq, dtype=torch.bfloat16, progress=False)
    title = f"PREDICTED on {gpu} (not measured): ToyLlama at Llama-3-8B width, {layers} blocks, s={seq}, b=1, bf16, AdamW"
    return format_markdown(rows, title), {"kind": "predicted", "title": title, "rows": rows}
