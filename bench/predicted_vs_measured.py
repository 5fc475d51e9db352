"""Predicted next to measured for the bench presets a GPU run measured: the calibration of ``offload.predict``.

    python -m bench.predicted_vs_measured --results bench/results/nvidia-h100-80gb-hbm3
    python -m bench.predicted_vs_measured 1b_L16_s4096_b1_bfloat16.json --out pvm.json
    python -m bench.predicted_vs_measured RESULT.json --gpu h100-sxm     # a CPU stand-in (tests, --dry-run)

For every bench results JSON (``python -m bench --preset 1b|8b``: ``meta``, ``workload``, ``strategies``)
the same workload (the bench's ToyLlama at the measured width, blocks, sequence, batch and dtype; no
optimizer, as the bench runs it) is predicted with ``offload.predict.predict_step`` on the GPU the run
named in ``meta.device_name`` (``DEVICE_GPUS``; ``--gpu`` overrides it). Per strategy: measured and
predicted peak allocated memory, activation bytes, step time, tokens/s and offloaded bytes, and the
ratio predicted / measured of each. Writes ``predicted_vs_measured.json`` and ``.md`` beside it.
``scripts/gpu_run.sh``'s ``predict`` phase runs it after the 1b/8b phases (docs/gpu-run.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.model import ToyLlama
from bench.workloads import Workload

__all__ = ["DEVICE_GPUS", "bench_step_fns", "first_blocks_plan", "gpu_for_device", "compare_file", "compare",
           "format_markdown", "main"]

DEVICE_GPUS: dict[str, str] = {
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
    "NVIDIA GH200 480GB": "gh200",
    "NVIDIA A100-SXM4-80GB": "a100-80gb",
    "NVIDIA A100 80GB PCIe": "a100-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA A100-PCIE-40GB": "a100-40gb",
    "NVIDIA L40S": "l40s",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
}
"""``torch.cuda.get_device_name()`` -> the ``offload.predict.GPUS`` spec it is predicted with."""

METRICS = ("peak_allocated_bytes", "activation_bytes", "step_seconds", "tokens_per_s", "offloaded_bytes")
"""The quantities compared; each gets ``ratio[metric] = predicted / measured``."""

ASSUMPTIONS = (
    "the bench's model and step: ToyLlama at the measured width, blocks, sequence, batch and dtype; forward, "
    "float32 cross-entropy and backward, no optimizer (the bench has none)",
    "measured step time: the median of the measured steps; predicted: the simulated timeline's step",
    "measured memory: max_memory_allocated over the measured steps (activation bytes: that minus what was "
    "allocated before the step); the bench allocates every gradient before the step, the prediction in "
    "backward, so the predicted peak_allocated_bytes is the most the predicted step holds besides gradients "
    "at any moment plus every gradient (the prediction's own peak is peak_allocated_bytes_as_predicted; "
    "activation bytes: the peak less parameters and gradients)",
    "measured offloaded bytes: the ledger's per-step mean; predicted: the engine's ledger on fake tensors",
)


class PredictedVsMeasuredError(ValueError):
    """A measured results file this comparison cannot use; the message says which and how to fix it."""


def gpu_for_device(device_name: str, override: str | None = None) -> str:
    """The ``GPUS`` key for a measured run's ``meta.device_name`` (``override`` wins)."""
    from offload.predict import GPUS

    if override is not None:
        if override not in GPUS:
            raise PredictedVsMeasuredError(f"predicted_vs_measured: --gpu {override!r} is not one of {sorted(GPUS)}")
        return override
    if device_name not in DEVICE_GPUS:
        raise PredictedVsMeasuredError(
            f"predicted_vs_measured: the measured device {device_name!r} has no GPU spec in DEVICE_GPUS "
            f"(bench/predicted_vs_measured.py); add it there, or pass --gpu with one of {sorted(GPUS)}")
    return DEVICE_GPUS[device_name]


def _workload(data: dict[str, Any], path: Path) -> Workload:
    try:
        w = data["workload"]
        return Workload(name=w["name"], dim=w["dim"], n_layers=w["n_layers"], n_heads=w["n_heads"],
                        vocab_size=w["vocab_size"], seq_len=w["seq_len"], batch=w["batch"], dtype=w["dtype"])
    except (KeyError, TypeError) as e:
        raise PredictedVsMeasuredError(
            f"predicted_vs_measured: {path} has no bench workload ({type(e).__name__}: {e}); pass a JSON written "
            "by `python -m bench` (meta, workload, strategies)") from e


def _measured(s: dict[str, Any]) -> dict[str, Any]:
    """The measured side of one strategy, None where the run has no number."""
    if s.get("status") != "ok":
        return {"status": s.get("status"), "reason": s.get("reason")}
    engine = s.get("engine") or {}
    return {"status": "ok", "peak_allocated_bytes": s.get("peak_allocated_bytes"),
            "activation_bytes": s.get("activation_bytes"), "activation_source": s.get("activation_source"),
            "step_seconds": s.get("median_s"), "tokens_per_s": s.get("tokens_per_s"),
            "offloaded_bytes": engine.get("offloaded_bytes", 0) if s.get("engine") is not None else 0}


def bench_step_fns(wl: Workload, grad_elems: list[int] | None = None) -> tuple[Any, Any]:
    """``(model_fn, step_fn)`` for ``offload.predict.predict_step``: the bench's ToyLlama at ``wl``'s width,
    blocks and vocabulary, and the bench's step on it (forward, float32 cross-entropy; no optimizer). Each
    model built appends its trainable element count to ``grad_elems`` when given."""
    cfg = wl.model_config()

    def step_fn(model: torch.nn.Module) -> torch.Tensor:
        tokens = torch.randint(0, cfg.vocab_size, (wl.batch, wl.seq_len))  # (B, T)
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    def model_fn() -> torch.nn.Module:
        model = ToyLlama(cfg)
        if grad_elems is not None:
            grad_elems.append(sum(q.numel() for q in model.parameters() if q.requires_grad))
        return model

    return model_fn, step_fn


def first_blocks_plan(n_blocks: int, k: int, engine_kwargs: dict[str, int]) -> Any:
    """A ``Plan`` offloading the bench ToyLlama's blocks ``0..k-1`` and keeping the rest."""
    from offload.planner.planning import Plan

    return Plan(decisions={f"layers.{i}": "offload" if i < k else "keep" for i in range(n_blocks)},
                budget_bytes=0, predicted_peak_bytes=0, predicted_step_seconds=0.0, cost=None,
                engine_kwargs=dict(engine_kwargs))


def _predictable(name: str, wl: Workload) -> Any:
    """What ``predict_step`` runs for the bench strategy ``name`` (None: not modelled). The partial offloads
    (``offload_part*``, ``offload_first<k>``) are a ``Plan`` offloading the same first blocks with the same
    engine settings; the bench runs one engine around the whole model with the later blocks excluded, so the
    embedding's few saved bytes are the difference."""
    from offload.predict import STRATEGIES

    from bench.strategies import first_blocks

    if name == "offload_head_excluded":
        return "offload"  # offload.predict's "offload" keeps the head, as this strategy does
    if name in ("offload", "offload_ac"):  # the bench's offload the head too
        return functools.partial(_head_offloaded, name)
    if name in STRATEGIES:
        return name
    first = first_blocks(name, wl.n_layers)
    return None if first is None else first_blocks_plan(wl.n_layers, *first)


def _head_offloaded(name: str, model: Any) -> Any:
    """``predict_step``'s ``name`` with the output head offloaded too, as the bench's ``name`` runs it."""
    from offload.predict._strategies import apply_strategy

    return apply_strategy(model, name, None, keep_head=False)


def _predicted(wl: Workload, strategy: Any, gpu: str) -> dict[str, Any]:
    """The predicted side of one strategy on ``gpu`` (``offload.predict.predict_step``)."""
    from offload.predict import predict_step
    from offload.predict._memory import DeviceMemory, replay

    grad_elems: list[int] = []
    model_fn, step_fn = bench_step_fns(wl, grad_elems)
    t0 = time.perf_counter()
    p = predict_step(model_fn, step_fn, gpu=gpu, strategy=strategy, dtype=wl.torch_dtype)
    grads = grad_elems[-1] * wl.torch_dtype.itemsize
    # The bench allocates every gradient before the step; the prediction allocates them in backward. So the
    # bench's peak is the most the predicted step holds besides gradients, at any moment, plus all of them
    # (not the predicted peak topped up with the gradients missing there: that peak comes late in backward,
    # once most gradients exist, while the bench's comes where the activations and temporaries peak).
    peak = replay(p.trace, DeviceMemory()).peak_allocated_bytes_less_gradients + grads
    return {"status": "ok", "peak_allocated_bytes": peak, "peak_allocated_bytes_as_predicted": p.peak_allocated_bytes,
            "peak_bytes_as_predicted": p.peak_bytes,
            "activation_bytes": peak - p.breakdown_at_peak.get("parameter", 0) - grads,
            "step_seconds": p.step_seconds, "tokens_per_s": wl.tokens_per_step / p.step_seconds,
            "exposed_copy_seconds": p.exposed_copy_seconds, "offloaded_bytes": p.offloaded_bytes,
            "fits": p.fits, "assumptions": list(p.assumptions),
            "predict_seconds": round(time.perf_counter() - t0, 2)}


def ratios(predicted: dict[str, Any] | None, measured: dict[str, Any]) -> dict[str, float | None]:
    """``predicted / measured`` per metric; None where either side has no number or the measured is 0."""
    out: dict[str, float | None] = {}
    for m in METRICS:
        p, q = (predicted or {}).get(m), measured.get(m)
        out[m] = p / q if p is not None and q else None
    return out


def compare_file(path: Path, *, gpu: str | None = None, progress: bool = True) -> dict[str, Any]:
    """One measured results file against its prediction, per strategy."""
    from offload.predict import GPUS, STRATEGIES

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PredictedVsMeasuredError(f"predicted_vs_measured: cannot read {path}: {e}") from e
    wl = _workload(data, path)
    meta = data.get("meta") or {}
    key = gpu_for_device(str(meta.get("device_name")), gpu)
    rows = {}
    for s in data.get("strategies") or []:
        name, measured = s["name"], _measured(s)
        strategy = _predictable(name, wl)
        if strategy is None:
            predicted, why = None, f"offload.predict models {STRATEGIES} and the partial offloads, not {name!r}"
        else:
            if progress:
                print(f"[predicted_vs_measured] {path.name}: {name} on {key}", file=sys.stderr)
            predicted, why = _predicted(wl, strategy, key), ""
        rows[name] = {"strategy": name, "measured": measured, "predicted": predicted,
                      "ratio": ratios(predicted, measured), **({"not_predicted": why} if why else {})}
    return {"measured_file": path.name, "device_name": meta.get("device_name"), "gpu": key,
            "gpu_spec": GPUS[key].describe(), "gpu_from": "--gpu" if gpu else "meta.device_name",
            "measured_command": meta.get("command"), "measured_commit": meta.get("git_commit"),
            "workload": {k: data["workload"].get(k) for k in ("name", "dim", "n_layers", "n_heads", "vocab_size",
                                                               "seq_len", "batch", "dtype")},
            "strategies": rows}


def _is_bench_result(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"meta", "workload", "strategies"} <= data.keys() and \
        isinstance(data["strategies"], list)


def compare(paths: list[Path], *, gpu: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Every measured file against its prediction, labelled."""
    return {"kind": "predicted_vs_measured",
            "note": "predicted by offload.predict for the GPU spec named per file; measured by python -m bench",
            "assumptions": list(ASSUMPTIONS), "ratio": "predicted / measured",
            "files": [compare_file(p, gpu=gpu, progress=progress) for p in paths]}


def _fmt(x: Any, kind: str) -> str:
    if x is None:
        return "n/a"
    return {"bytes": f"{x / (1 << 30):.2f}", "s": f"{x * 1e3:.1f}", "ratio": f"{x:.2f}x"}.get(kind, f"{x:.0f}")


def format_markdown(result: dict[str, Any]) -> str:
    """Per file, a table: measured | PREDICTED | ratio for peak, step time and offloaded bytes."""
    out = []
    for f in result["files"]:
        w = f["workload"]
        out += [f"### {f['measured_file']}: measured on {f['device_name']} vs PREDICTED on {f['gpu_spec']}", "",
                f"{w['name']}: h={w['dim']}, {w['n_layers']} blocks, s={w['seq_len']}, b={w['batch']}, {w['dtype']}; "
                f"GPU spec from {f['gpu_from']}.", "",
                "| strategy | peak GiB measured | peak GiB predicted | ratio | step ms measured | step ms predicted "
                "| ratio | offloaded GiB measured | offloaded GiB predicted | ratio |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, r in f["strategies"].items():
            m, p, q = r["measured"], r["predicted"] or {}, r["ratio"]
            if m.get("status") != "ok" and not p:
                continue
            cells = [name]
            for metric, kind in (("peak_allocated_bytes", "bytes"), ("step_seconds", "s"), ("offloaded_bytes", "bytes")):
                cells += [_fmt(m.get(metric), kind), _fmt(p.get(metric), kind), _fmt(q[metric], "ratio")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["Ratios are predicted / measured. PREDICTED numbers are offload.predict's for the named GPU spec, "
            "uncalibrated. Assumptions:", ""] + [f"- {a}" for a in result["assumptions"]]
    return "\n".join(out) + "\n"


def _inputs(args: argparse.Namespace) -> list[Path]:
    paths = [Path(p) for p in args.files]
    if args.results is not None:
        paths += sorted(p for p in Path(args.results).glob("*.json") if _is_bench_result(p))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.predicted_vs_measured", description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="bench results JSONs (python -m bench --preset 1b|8b)")
    ap.add_argument("--results", default=None, help="a results folder: every bench results JSON in it")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON to write (default predicted_vs_measured.json in --results or the cwd); "
                         "the markdown goes beside it")
    ap.add_argument("--gpu", default=None, help="the offload.predict.GPUS spec to predict with, instead of the "
                                                "one mapped from meta.device_name (a CPU stand-in run)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    paths = _inputs(args)
    if not paths:
        print("python -m bench.predicted_vs_measured: no bench results JSON given (pass files or --results DIR "
              "holding `python -m bench` output)", file=sys.stderr)
        return 2
    try:
        result = compare(paths, gpu=args.gpu, progress=not args.quiet)
    except PredictedVsMeasuredError as e:
        print(str(e), file=sys.stderr)
        return 2
    out = args.out or Path(args.results or ".") / "predicted_vs_measured.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    md = format_markdown(result)
    out.with_suffix(".md").write_text(md)
    if not args.quiet:
        print(md)
    print(f"wrote {out}\nwrote {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
