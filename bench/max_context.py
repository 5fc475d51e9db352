"""``python -m bench --predict --max-context``: the longest context per card and strategy, PREDICTED.

    python -m bench --predict --max-context --out bench/results/predicted
    python -m bench --predict --max-context --layers 4 --no-write    # a quick look: 4 of the 32 blocks

For Llama-3.1-8B, full fine-tune in mixed precision (fp32 weights, gradients and AdamW state; the step
computed in bf16: ``predict_step(mixed_precision=torch.bfloat16)``) and LoRA (peft, r=16 on every linear
layer of the blocks, bf16 base, AdamW on the adapters), per card
(``CARDS``) and strategy (``STRATEGIES``): the largest context that fits (a multiple of ``GRANULARITY``
tokens, batch 1), the predicted step time there, the host memory its offloaded bytes need (pinned /
pageable / disk, under ``HOSTS``' stated host of each card) and the link and disk rates that moves them
at. Nothing runs on a GPU: every number is ``offload.predict``'s, for the spec each card names.

Method (NOTE [ Fitted context ]). A full-depth prediction costs ~6 s plus ~0.2 s per thousand tokens on
a 2-core machine, so the table is not searched point by point. Per workload and strategy the step is
predicted at full depth at ``FIT_SEQS``; on each trace the peak of the forward and backward and the peak
of the optimizer step are read separately (``phase_peaks``). The first grows linearly with the context
(flash attention, fixed-size tiles; checked: the three points lie on a line within ``LINEAR_RTOL``), the
second does not grow; the step time is a quadratic (attention) and the offloaded bytes a line through
them. Each card's context is the largest multiple of ``GRANULARITY`` whose fitted peak fits its usable
memory. One row, ``VERIFY`` (LoRA, long_context, h100-sxm: Unsloth's published setting), is then
predicted directly at its fitted context, and the file shows both peaks.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CARDS", "STRATEGIES", "WORKLOADS", "HOSTS", "Fit", "fit_workload", "table_rows", "phase_peaks",
           "run_max_context", "format_markdown", "write_png", "main_max_context"]

CARDS = ("h100-sxm", "a100-80gb", "a100-40gb", "l40s", "rtx-4090", "h200", "gh200")
STRATEGIES = ("none", "ac", "offload_ac", "long_context")
FIT_SEQS = (16384, 32768, 49152)
"""Context lengths the fits are predicted at: past the lengths where the tiles reach their fixed size
(MLP: 4,096 tokens; loss: 523 tokens of a 128,256 vocabulary)."""
GRANULARITY = 1024
LINEAR_RTOL = 0.01
"""How far the middle fit point may lie off the line through the outer two (relative) before the fit is
refused (the peak would not be linear in the context: a regime change between the fit points)."""
VERIFY = ("lora", "h100-sxm", "long_context")
_GiB = 1 << 30
_GB = 1e9


@dataclass(frozen=True)
class Host:
    """The host a card's row assumes: RAM per GPU, how much of it the pinned pool may take, the disk."""

    ram_bytes: int
    source: str
    pinned_fraction: float = 0.5
    """Of the RAM, for the pinned pool (assumption: the rest serves the OS, data loading and pageable)."""
    usable_fraction: float = 0.9
    """Of the RAM, for pinned + pageable together (the engine's ``virtual_memory_safe_pct`` default)."""
    disk_bytes_per_s: float = 6e9
    """The disk tier's rate each way (assumption: one PCIe Gen4 NVMe SSD, ~7 GB/s read, ~6 GB/s write)."""

    def split(self, nbytes: int) -> dict[str, int]:
        """``nbytes`` of offloaded activations across the tiers in the engine's order: pinned, pageable, disk."""
        pinned = min(nbytes, int(self.ram_bytes * self.pinned_fraction))
        pageable = min(nbytes - pinned, int(self.ram_bytes * self.usable_fraction) - pinned)
        return {"pinned": pinned, "pageable": pageable, "disk": nbytes - pinned - pageable}


HOSTS: dict[str, Host] = {
    "h100-sxm": Host(256 * _GiB, "DGX H100: 2 TB of RAM for 8 GPUs (NVIDIA datasheet)"),
    "h200": Host(256 * _GiB, "DGX H200: 2 TB of RAM for 8 GPUs (NVIDIA datasheet)"),
    "a100-80gb": Host(256 * _GiB, "DGX A100 640GB: 2 TB of RAM for 8 GPUs (NVIDIA datasheet)"),
    "a100-40gb": Host(128 * _GiB, "DGX A100 320GB: 1 TB of RAM for 8 GPUs (NVIDIA datasheet)"),
    "gh200": Host(480 * _GiB, "GH200: 480 GB LPDDR5X on the Grace CPU, one GPU (NVIDIA datasheet)"),
    "l40s": Host(192 * _GiB, "assumption: a 4-GPU L40S server with 768 GB of RAM"),
    "rtx-4090": Host(128 * _GiB, "assumption: a workstation with 128 GB of RAM"),
}
"""Each card's host (assumptions named; datasheet figures per GPU where a reference system exists)."""


# -- the workloads ------------------------------------------------------------------------------------


def _base_model_fn(layers: int | None) -> Callable[[], nn.Module]:
    from offload.predict.presets import PRESETS, preset_model_fn

    name = "llama3.1-8b" if "llama3.1-8b" in PRESETS else "llama3-8b"  # same shapes; 3.1 adds RoPE scaling
    return preset_model_fn(name, layers=layers)


LORA_RANK = 16


def _lora_model_fn(layers: int | None, fp32_adapters: bool = True) -> Callable[[], nn.Module]:
    """peft's LoRA r=16 (alpha 32, dropout 0) on every linear layer of the blocks, the base in bf16 and frozen
    (``bench.predict.lora_model_fn``, as ``--predict --lora 16`` builds it); the adapters in fp32 as peft makes
    them by default, or in bf16."""
    from bench.predict import lora_model_fn

    return lora_model_fn(_base_model_fn(layers), LORA_RANK, fp32_adapters=fp32_adapters)


def _lora_bf16_model_fn(layers: int | None) -> Callable[[], nn.Module]:
    return _lora_model_fn(layers, fp32_adapters=False)


def _labels_step(model: nn.Module, seq: int) -> torch.Tensor:
    tokens = torch.randint(0, 128256, (1, seq))
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    model_fn: Callable[[int | None], Callable[[], nn.Module]]
    step_fn: Callable[[nn.Module, int], torch.Tensor]
    mixed_precision: torch.dtype | None = None
    """``predict_step``'s: the compute dtype of a mixed-precision step (fp32 state)."""


WORKLOADS: dict[str, Workload] = {
    "full": Workload("full", "Llama-3.1-8B full fine-tune, mixed precision (fp32 weights/grads/AdamW, bf16 "
                     "compute)", _base_model_fn, _labels_step, torch.bfloat16),
    "lora": Workload("lora", "Llama-3.1-8B LoRA r=16 (peft) on every linear of the blocks, bf16 base, AdamW on the "
                     "adapters (fp32, peft's default)", _lora_model_fn, _labels_step),
    "lora_bf16": Workload("lora_bf16", "Llama-3.1-8B LoRA r=16 (peft) on every linear of the blocks, bf16 base and "
                          "bf16 adapters (autocast_adapter_dtype=False), AdamW on the adapters", _lora_bf16_model_fn,
                          _labels_step),
}


# -- one prediction, its phases -----------------------------------------------------------------------


def phase_peaks(trace: Any) -> dict[str, int]:
    """Peak device bytes (allocated + held) of each phase of a captured step: ``step`` (forward and
    backward) and ``optimizer``, replayed in program order as ``offload.predict`` does."""
    from offload.predict._memory import Replay

    r = Replay()
    peaks = {"step": 0, "optimizer": 0}
    phase = "step"
    for item in trace.items:
        p = getattr(item, "phase", None)
        if p is not None:
            phase = "optimizer" if p == "optimizer" else "step"
        r.feed(item)
        if r.memory.in_use_bytes > peaks[phase]:
            peaks[phase] = r.memory.in_use_bytes
    return peaks


def _predict(w: Workload, strategy: str, seq: int, layers: int | None) -> Any:
    from offload.predict import predict_step

    return predict_step(w.model_fn(layers), lambda m: w.step_fn(m, seq), gpu="h100-sxm", strategy=strategy,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-5),
                        mixed_precision=w.mixed_precision)


@dataclass
class Fit:
    """One workload and strategy, predicted at ``seqs`` (full depth) and fitted (NOTE [ Fitted context ])."""

    workload: str
    strategy: str
    seqs: list[int]
    step_peaks: list[int]
    optimizer_peak: int
    host_bytes: list[int]
    """Bytes copied to the host per step (all held at the end of forward: what the host tiers must hold)."""
    step_seconds: list[float]
    """Predicted on h100-sxm's clock; each card's time is this one's trace replayed on its spec."""
    card_seconds: dict[str, list[float]] = field(default_factory=dict)
    predict_seconds: float = 0.0

    def _line(self, ys: Sequence[float]) -> tuple[float, float]:
        (x0, x1), (y0, y1) = (self.seqs[0], self.seqs[-1]), (ys[0], ys[-1])
        slope = (y1 - y0) / (x1 - x0)
        return y0 - slope * x0, slope

    def linear(self) -> float:
        """How far the middle point lies off the line through the outer two, relative to it."""
        a, b = self._line(self.step_peaks)
        mid = a + b * self.seqs[1]
        return abs(self.step_peaks[1] - mid) / mid

    def peak(self, seq: int) -> float:
        a, b = self._line(self.step_peaks)
        return max(a + b * seq, self.optimizer_peak)

    def host(self, seq: int) -> float:
        a, b = self._line(self.host_bytes)
        return max(0.0, a + b * seq)

    def seconds(self, seq: int, card: str) -> float:
        """The quadratic through the three predicted step times on ``card``."""
        ys = self.card_seconds.get(card, self.step_seconds)
        (x0, x1, x2) = self.seqs
        return sum(y * math.prod((seq - xj) / (xi - xj) for xj in (x0, x1, x2) if xj != xi)
                   for xi, y in zip((x0, x1, x2), ys))

    def longest(self, usable: int) -> tuple[int, str]:
        """(the largest multiple of ``GRANULARITY`` that fits ``usable`` bytes, or 0 and why not)."""
        if self.optimizer_peak > usable:
            return 0, f"the optimizer step alone peaks at {self.optimizer_peak / _GiB:.1f} GiB"
        a, b = self._line(self.step_peaks)
        if a + b * GRANULARITY > usable:
            return 0, f"even {GRANULARITY} tokens peak at {(a + b * GRANULARITY) / _GiB:.1f} GiB"
        return int((usable - a) / b) // GRANULARITY * GRANULARITY, ""


def fit_workload(w: Workload, strategy: str, *, layers: int | None = None, seqs: Sequence[int] = FIT_SEQS,
                 cards: Sequence[str] = CARDS, progress: bool = True) -> Fit:
    """Predict ``w`` under ``strategy`` at ``seqs`` and keep what the fits need (per card: step times)."""
    from offload.predict import GPUS, simulate

    t0 = time.perf_counter()
    fit = Fit(w.name, strategy, list(seqs), [], 0, [], [])
    for seq in seqs:
        if progress:
            print(f"[max-context] {w.name} {strategy} s={seq}", file=sys.stderr, flush=True)
        p = _predict(w, strategy, seq, layers)
        peaks = phase_peaks(p.trace)
        fit.step_peaks.append(peaks["step"])
        fit.optimizer_peak = max(fit.optimizer_peak, peaks["optimizer"])
        fit.host_bytes.append(int(p.ledger_summary["d2h_bytes"]) if p.ledger_summary else 0)
        fit.step_seconds.append(p.step_seconds)
        for card in cards:
            fit.card_seconds.setdefault(card, []).append(simulate(p.trace, GPUS[card]).step_seconds)
    fit.predict_seconds = round(time.perf_counter() - t0, 1)
    if fit.linear() > LINEAR_RTOL:
        raise RuntimeError(f"bench --max-context: {w.name}/{strategy}: the step's peak is not linear in the "
                           f"context over {list(seqs)} ({fit.linear():.1%} off): fit points too short?")
    return fit


# -- the table ------------------------------------------------------------------------------------------


def _rates(card: str, split: dict[str, int]) -> tuple[str, float]:
    """(the slowest host tier in use and its rate in words, that rate in bytes/s each way)."""
    from offload.predict import GPUS

    spec, host = GPUS[card], HOSTS[card]
    link = min(spec.h2d_bytes_per_s, spec.d2h_bytes_per_s)
    if split["disk"]:
        return f"disk {host.disk_bytes_per_s / _GB:.0f} GB/s (assumed NVMe)", host.disk_bytes_per_s
    if split["pageable"]:
        rate = link * spec.pageable_fraction
        return f"pageable {rate / _GB:.0f} GB/s ({spec.link})", rate
    if any(split.values()):
        return f"pinned {link / _GB:.0f} GB/s ({spec.link})", link
    return "no copies", math.inf


def table_rows(fits: Sequence[Fit], cards: Sequence[str] = CARDS) -> list[dict[str, Any]]:
    """One row per (workload, card, strategy): the fitted longest context and what it needs there."""
    from offload.predict import GPUS

    rows = []
    for f in fits:
        for card in cards:
            usable = GPUS[card].usable_bytes
            seq, why = f.longest(usable)
            row: dict[str, Any] = {"workload": f.workload, "card": card, "strategy": f.strategy,
                                   "max_context": seq, "limit": why, "usable_bytes": usable}
            if seq:
                host = int(f.host(seq))
                split = HOSTS[card].split(host)
                step = f.seconds(seq, card)
                rate_text, rate = _rates(card, split)
                slowest = split["disk"] or split["pageable"] or host
                row.update(peak_bytes=int(f.peak(seq)), step_seconds=step, tokens_per_s=seq / step,
                           host_bytes=host, host_split=split, runs_at=rate_text,
                           rate_needed_bytes_per_s=slowest / step if slowest else 0.0,
                           tier_bound_step_seconds=2 * slowest / rate if slowest and rate < math.inf else 0.0)
            rows.append(row)
    return rows


def _cell_context(r: dict[str, Any]) -> str:
    return f"{r['max_context']:,}" if r["max_context"] else f"does not fit: {r['limit']}"


def format_markdown(res: dict[str, Any]) -> str:
    """The table, per workload, every figure labelled PREDICTED with the card it assumes."""
    out = []
    for wname, w in res["workloads"].items():
        out += [f"### {w['title']}", "",
                "| card | strategy | largest context (tokens) | predicted peak GiB | predicted step s | "
                "predicted tokens/s | host GiB needed: pinned / pageable / disk | host tier it runs at | "
                "rate needed GB/s | tier-bound step s |",
                "|---|---|---:|---:|---:|---:|---|---|---:|---:|"]
        for r in (r for r in res["rows"] if r["workload"] == wname):
            if not r["max_context"]:
                out.append(f"| {r['card']} | {r['strategy']} | {_cell_context(r)} | | | | | | | |")
                continue
            sp = r["host_split"]
            out.append(
                f"| {r['card']} | {r['strategy']} | {r['max_context']:,} | {r['peak_bytes'] / _GiB:.1f} | "
                f"{r['step_seconds']:.1f} | {r['tokens_per_s']:,.0f} | {sp['pinned'] / _GiB:.1f} / "
                f"{sp['pageable'] / _GiB:.1f} / {sp['disk'] / _GiB:.1f} | {r['runs_at']} | "
                f"{r['rate_needed_bytes_per_s'] / _GB:.1f} | {r['tier_bound_step_seconds']:.1f} |")
        out.append("")
    v = res.get("verify")
    if v:
        out += [f"Verified: {v['workload']} / {v['strategy']} on {v['card']} predicted directly at "
                f"{v['seq']:,} tokens: peak {v['peak_bytes'] / _GiB:.2f} GiB (fitted {v['fitted_peak_bytes'] / _GiB:.2f}),"
                f" {'fits' if v['fits'] else 'does NOT fit'} in {v['usable_bytes'] / _GiB:.2f} GiB; step "
                f"{v['step_seconds']:.1f} s (fitted {v['fitted_step_seconds']:.1f}).", ""]
    out += ["PREDICTED by offload.predict (fake tensors, no GPU), not measured; per card the spec of "
            "`offload.predict.GPUS` and the host of `bench.max_context.HOSTS`. " + res["method"], ""]
    out += [f"- {card}: {h}" for card, h in res["hosts"].items()]
    return "\n".join(out) + "\n"


def write_png(res: dict[str, Any], path: Path) -> bool:
    """Largest context per card (bars per strategy, log scale), one panel per workload, with the published
    anchors (not ours) on the LoRA panel."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(res["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 4.8), squeeze=False)
    for ax, wname in zip(axes[0], names):
        rows = [r for r in res["rows"] if r["workload"] == wname]
        cards = list(dict.fromkeys(r["card"] for r in rows))
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        width = 0.8 / len(strategies)
        for i, s in enumerate(strategies):
            ys = [next(r["max_context"] for r in rows if r["card"] == c and r["strategy"] == s) for c in cards]
            xs = [j + i * width for j in range(len(cards))]
            ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, label=s, color=f"C{i}")
            ax.set_xlim(-0.5, len(cards) - 0.1)
        for j, c in enumerate(cards):  # no bars: a card where no strategy fits at any length
            if not any(r["max_context"] for r in rows if r["card"] == c):
                ax.annotate("does not fit", (j + 0.4 - width / 2, 0.02), xycoords=("data", "axes fraction"),
                            rotation=90, ha="center", va="bottom", fontsize=7, color="dimgray")
        if wname.startswith("lora"):
            for value, text in ((342_733, "Unsloth, published: 342,733 (QLoRA, H100 80GB)"),
                                (500_000, "ALST, published: 500K (H100)")):
                ax.axhline(value, color="gray", ls="--", lw=0.8)
                ax.annotate(text, (0, value), xytext=(2, 2), textcoords="offset points", fontsize=7, color="dimgray")
        ax.set_yscale("log")
        ax.set_ylim(bottom=1000)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cards))], cards, rotation=30, fontsize=8)
        ax.set_ylabel("largest context, tokens (PREDICTED)")
        ax.set_title(res["workloads"][wname]["title"], fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _verify(fits: Sequence[Fit], rows: list[dict[str, Any]], layers: int | None, progress: bool) -> dict | None:
    """Predict the ``VERIFY`` row directly at its fitted context; where that does not fit, step down by the
    overshoot over the fitted slope (at most three times) and correct the row."""
    from offload.predict import GPUS

    wname, card, strategy = VERIFY
    fit = next((f for f in fits if (f.workload, f.strategy) == (wname, strategy)), None)
    row = next((r for r in rows if (r["workload"], r["card"], r["strategy"]) == VERIFY), None)
    if fit is None or row is None or not row["max_context"]:
        return None
    seq, usable = row["max_context"], GPUS[card].usable_bytes
    slope = fit._line(fit.step_peaks)[1]
    for _ in range(3):
        if progress:
            print(f"[max-context] verifying {wname} {strategy} on {card} at s={seq}", file=sys.stderr, flush=True)
        p = _predict(WORKLOADS[wname], strategy, seq, layers)
        if p.peak_bytes <= usable:
            break
        seq -= max(GRANULARITY, math.ceil((p.peak_bytes - usable) / slope / GRANULARITY) * GRANULARITY)
    from offload.predict import simulate

    v = {"workload": wname, "card": card, "strategy": strategy, "seq": seq, "peak_bytes": p.peak_bytes,
         "fitted_peak_bytes": int(fit.peak(seq)), "usable_bytes": usable, "fits": p.peak_bytes <= usable,
         "step_seconds": simulate(p.trace, GPUS[card]).step_seconds, "fitted_step_seconds": fit.seconds(seq, card),
         "offloaded_bytes": p.offloaded_bytes, "tiling": (p.ledger_summary or {}).get("tiling")}
    if v["fits"] and seq != row["max_context"]:
        row.update(max_context=seq, peak_bytes=p.peak_bytes, step_seconds=v["step_seconds"],
                   tokens_per_s=seq / v["step_seconds"], limit="verified below the fit")
    return v


def run_max_context(*, workloads: Sequence[str] = tuple(WORKLOADS), strategies: Sequence[str] = STRATEGIES,
                    cards: Sequence[str] = CARDS, layers: int | None = None, seqs: Sequence[int] = FIT_SEQS,
                    verify: bool = True, progress: bool = True) -> dict[str, Any]:
    """The fits, the table's rows and the verified row (module docstring), JSON-ready."""
    t0 = time.perf_counter()
    fits = [fit_workload(WORKLOADS[w], s, layers=layers, seqs=seqs, cards=cards, progress=progress)
            for w in workloads for s in strategies]
    rows = table_rows(fits, cards)
    v = _verify(fits, rows, layers, progress) if verify else None
    return {"kind": "predicted", "layers": layers or 32, "fit_seqs": list(seqs), "granularity": GRANULARITY,
            "workloads": {w: {"title": WORKLOADS[w].title} for w in workloads},
            "hosts": {c: f"{HOSTS[c].ram_bytes / _GiB:.0f} GiB RAM per GPU ({HOSTS[c].source}); pinned pool up to "
                         f"{HOSTS[c].pinned_fraction:.0%}, pinned + pageable up to {HOSTS[c].usable_fraction:.0%} "
                         f"of it; disk {HOSTS[c].disk_bytes_per_s / _GB:.0f} GB/s each way (assumed)" for c in cards},
            "method": (f"Largest context: the largest multiple of {GRANULARITY} tokens (batch 1) whose fitted peak fits the "
                       "card's usable memory (its memory less its reserve); fits from full-depth predictions at "
                       f"{', '.join(f'{s:,}' for s in seqs)} tokens (peak of forward + backward: a line; optimizer step: "
                       "constant; step time: the quadratic through the three, replayed per card; host bytes: a line). "
                       "Step times assume every copy pinned; the tier columns say which host tier the bytes "
                       "need on the card's host and the step's lower bound from moving them through it. Llama-3.1's "
                       "trained positions end at 131,072; longer contexts run RoPE beyond them, as the published "
                       "long-context runs do."),
            "fits": [asdict(f) for f in fits], "rows": rows, "verify": v,
            "seconds": round(time.perf_counter() - t0, 1)}


def main_max_context(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--predict --max-context``: the table, its markdown and JSON and PNG in ``--out``."""
    from bench.env import default_run_dir, run_metadata

    res = run_max_context(layers=args.layers, progress=not args.quiet)
    text = format_markdown(res)
    print(text)
    if args.no_write:
        return 0
    res = {"meta": run_metadata("cpu", argv), **res}
    cmd = res["meta"]["command"]
    stem = "max_context_llama3.1-8b" + (f"_L{args.layers}" if args.layers else "")
    out = args.out if args.out is not None else default_run_dir("max_context", "llama3.1-8b")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    md = [f"# Longest context per card, PREDICTED ({stem})", "", f"Made by `{cmd}` in {res['seconds']:.0f} s.", "",
          text]
    if not args.no_plot and write_png(res, out / f"{stem}.png"):
        md += [f"![largest context per card]({stem}.png)", ""]
    (out / f"{stem}.md").write_text("\n".join(md))
    for suffix in ("json", "md", "png"):
        if (out / f"{stem}.{suffix}").exists():
            print(f"wrote {out / f'{stem}.{suffix}'}")
    return 0
