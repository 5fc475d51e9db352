"""TraceProfiler: torch.profiler for plain training loops, with Composer's trace-file handling.

    with TraceProfiler(folder="traces", wait=1, warmup=1, active=2) as tp:
        for batch in data:
            train_step(batch)
            tp.step()
    print(tp.summary())

Trace files are named from templates with Composer's variables that make
sense in a plain loop: ``{run_name}``, ``{rank}``, ``{local_rank}``,
``{world_size}``, ``{local_world_size}``, ``{node_rank}``, and the time
variables ``{step}`` = ``{batch}`` (``step()`` calls so far), ``{epoch}``,
``{batch_in_epoch}`` (``new_epoch()`` starts an epoch), ``{sample}``,
``{sample_in_epoch}``, ``{token}``, ``{token_in_epoch}`` (counted from
``step(samples=..., tokens=...)``). Templates are checked when the profiler
is built, so a typo fails there, not at the first save with the trace lost.
The default ``run_name`` is unique per run (``$TORCHELASTIC_RUN_ID`` under
torchrun, so ranks agree; else a timestamp and a random suffix), so a second
run does not find the first one's folder.
``use_gzip`` appends ``.gz`` (torch writes gzip for that suffix). A memory
timeline (``memory_filename``: ``.html``, ``.json``, ``.json.gz`` or
``.raw.json.gz``) is exported with each trace; it works on CPU too.
``num_traces_to_keep`` really deletes the oldest trace files (Composer's
never filled its list, so nothing was ever deleted). Summary tables (CPU time
and CPU memory, plus CUDA when traced) are written to ``summary_filename`` at
close; with several cycles they cover all of them. They are merged per
operator at the end of each cycle, so memory stays bounded over any number
of cycles (torch's ``acc_events=True`` keeps every event of every cycle).
"""

from __future__ import annotations

import json
import os
import string
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.autograd.profiler_util import EventList, FunctionEventAvg
from torch.profiler import ProfilerActivity

from ._util import get_local_rank, get_local_world_size, get_rank, get_world_size
from .errors import ProfilingError

__all__ = ["TraceProfiler"]

_MEMORY_SUFFIXES = (".html", ".raw.json.gz", ".json.gz", ".json")

_DIST_VARS = ("run_name", "rank", "local_rank", "world_size", "local_world_size", "node_rank")
_TIME_VARS = ("step", "batch", "epoch", "batch_in_epoch", "sample", "sample_in_epoch", "token", "token_in_epoch")


def _default_run_name() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"run-{run_id}"
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _check_template(template: str, setting: str, allowed: tuple[str, ...]) -> None:
    """Fail now, naming the setting, if ``template`` uses a variable it cannot be given."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"TraceProfiler: {setting}={template!r} is not a valid format string ({e})") from e
    for f in fields:
        name = f.split(".")[0].split("[")[0]
        if name not in allowed:
            raise ValueError(
                f"TraceProfiler: {setting}={template!r} uses {{{f}}}, which is not available; "
                f"use one of {', '.join('{' + a + '}' for a in allowed)}"
            )


class TraceProfiler:
    """A ``torch.profiler.profile`` with a schedule, templated file names, pruning and summaries.

    Args:
        folder: directory template for traces and summaries.
        filename: trace file template.
        memory_filename: memory-timeline file template, or None; needs ``profile_memory``,
            ``record_shapes`` and ``with_stack``.
        summary_filename: text file template for the summary tables, or None.
        run_name: value of ``{run_name}``; None (default) is unique per run (see module doc).
        skip_first: ``torch.profiler.schedule`` argument (steps).
        wait: ``torch.profiler.schedule`` argument (steps).
        warmup: ``torch.profiler.schedule`` argument (steps).
        active: ``torch.profiler.schedule`` argument (steps).
        repeat: ``torch.profiler.schedule`` argument (cycles).
        overwrite: allow a non-empty folder (otherwise it must be empty or absent).
        use_gzip: gzip trace files.
        record_shapes: passed to torch.profiler.
        profile_memory: passed to torch.profiler.
        with_stack: passed to torch.profiler.
        with_flops: passed to torch.profiler.
        num_traces_to_keep: newest saved traces kept on disk; -1 keeps all.
        row_limit: rows per summary table.
        activities: defaults to CPU, plus CUDA when available.
    """

    def __init__(
        self,
        *,
        folder: str = "{run_name}/torch_traces",
        filename: str = "rank{rank}.{step}.pt.trace.json",
        memory_filename: str | None = None,
        summary_filename: str | None = "rank{rank}.summary.txt",
        run_name: str | None = None,
        skip_first: int = 0,
        wait: int = 0,
        warmup: int = 1,
        active: int = 4,
        repeat: int = 1,
        overwrite: bool = False,
        use_gzip: bool = False,
        record_shapes: bool = False,
        profile_memory: bool = True,
        with_stack: bool = False,
        with_flops: bool = True,
        num_traces_to_keep: int = -1,
        row_limit: int = 20,
        activities: list[ProfilerActivity] | None = None,
    ) -> None:
        for name, v in (("skip_first", skip_first), ("wait", wait), ("warmup", warmup), ("repeat", repeat)):
            if v < 0:
                raise ValueError(f"TraceProfiler: {name}={v} must be >= 0")
        if active < 1:
            raise ValueError(f"TraceProfiler: active={active} must be >= 1 (steps recorded per cycle)")
        if num_traces_to_keep < -1:
            raise ValueError(f"TraceProfiler: num_traces_to_keep={num_traces_to_keep}: use -1 (keep all) or >= 0")
        _check_template(folder, "folder", _DIST_VARS)
        for setting, tpl in (("filename", filename), ("memory_filename", memory_filename),
                             ("summary_filename", summary_filename)):
            if tpl is not None:
                _check_template(tpl, setting, _DIST_VARS + _TIME_VARS)
        if run_name is None:
            run_name = _default_run_name()
        if use_gzip and not filename.endswith(".gz"):
            filename += ".gz"
        if memory_filename is not None:
            if not memory_filename.endswith(_MEMORY_SUFFIXES):
                raise ValueError(
                    f"TraceProfiler: memory_filename={memory_filename!r} must end with one of {_MEMORY_SUFFIXES}"
                )
            missing = [n for n, v in (("profile_memory", profile_memory), ("record_shapes", record_shapes),
                                      ("with_stack", with_stack)) if not v]
            if missing:
                raise ValueError(
                    f"TraceProfiler: memory_filename={memory_filename!r} needs {missing} set to True "
                    "(the memory timeline is built from allocation events with shapes and stacks)"
                )
        world, local = get_world_size(), get_local_world_size()
        self.fmt: dict[str, Any] = {
            "rank": get_rank(),
            "local_rank": get_local_rank(),
            "world_size": world,
            "local_world_size": local,
            "node_rank": get_rank() // max(1, local),
            "run_name": run_name,
        }
        self.run_name = run_name
        self.folder = Path(folder.format(**self.fmt))
        self.filename = filename
        self.memory_filename = memory_filename
        self.summary_filename = summary_filename
        self.overwrite = overwrite
        self.num_traces_to_keep = num_traces_to_keep
        self.row_limit = row_limit
        self.profile_memory = profile_memory
        if activities is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
        self.activities = activities
        self._schedule = torch.profiler.schedule(
            skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat
        )
        self._kwargs: dict[str, Any] = dict(
            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack, with_flops=with_flops
        )
        # No acc_events: it keeps every event of every cycle (unbounded); _merge_cycle keeps one
        # averaged row per operator instead.
        self._averages: dict[tuple[str, str], FunctionEventAvg] = {}
        self.saved_traces: list[tuple[int, list[Path]]] = []
        """(step, files) of the traces still on disk, oldest first."""
        self.summary_text: str | None = None
        self.summary_path: Path | None = None
        self._prof: torch.profiler.profile | None = None
        self._steps = 0
        self._time = dict.fromkeys(_TIME_VARS, 0)

    # -------------------------------------------------------------- lifecycle
    def __enter__(self) -> TraceProfiler:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        if self._prof is not None:
            raise ProfilingError("TraceProfiler: already started; call stop() first")
        if self.folder.exists() and any(self.folder.iterdir()) and not self.overwrite:
            raise ProfilingError(
                f"TraceProfiler: folder {str(self.folder)!r} is not empty and overwrite=False; "
                "choose an empty folder or pass overwrite=True"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        self._prof = torch.profiler.profile(
            activities=self.activities, schedule=self._schedule, on_trace_ready=self._on_trace_ready, **self._kwargs
        )
        self._prof.__enter__()

    def step(self, *, samples: int = 0, tokens: int = 0) -> None:
        """Mark the end of one training step (``samples``/``tokens`` it processed feed ``{sample}``/``{token}``)."""
        if self._prof is None:
            raise ProfilingError("TraceProfiler: step() called outside start()/stop() (or the `with` block)")
        self._steps += 1
        t = self._time
        t["step"] = t["batch"] = self._steps
        t["batch_in_epoch"] += 1
        t["sample"] += samples
        t["sample_in_epoch"] += samples
        t["token"] += tokens
        t["token_in_epoch"] += tokens
        self._prof.add_metadata_json("global_rank", json.dumps(self.fmt["rank"]))
        with warnings.catch_warnings():
            # torch suggests acc_events=True when a cycle's events are cleared: we merge them instead.
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
            self._prof.step()

    def new_epoch(self) -> None:
        """Start a new epoch: ``{epoch}`` + 1, and the ``*_in_epoch`` counters restart at 0."""
        t = self._time
        t["epoch"] += 1
        t["batch_in_epoch"] = t["sample_in_epoch"] = t["token_in_epoch"] = 0

    def stop(self) -> None:
        """Stop profiling (saving an unfinished active window) and build the summary tables."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        self.summary_text = self._build_summary()
        if self.summary_filename is not None and self.summary_text:
            path = self._name(self.summary_filename)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.summary_text)
            self.summary_path = path

    # ---------------------------------------------------------------- output
    def _name(self, template: str) -> Path:
        return self.folder / template.format(**self._time, **self.fmt)

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        self._merge_cycle(prof)
        files: list[Path] = []
        trace = self._name(self.filename)
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        files.append(trace)
        if self.memory_filename is not None:
            mem = self._name(self.memory_filename)
            mem.parent.mkdir(parents=True, exist_ok=True)
            device = f"cuda:{torch.cuda.current_device()}" if ProfilerActivity.CUDA in self.activities else "cpu"
            with warnings.catch_warnings():
                # Deprecated upstream in favour of a function that does not exist in 2.13; still the
                # only timeline export that works on CPU.
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(mem), device=device)
            files.append(mem)
        self.saved_traces.append((self._steps, files))
        if self.num_traces_to_keep >= 0:
            while len(self.saved_traces) > self.num_traces_to_keep:
                _, old = self.saved_traces.pop(0)
                for p in old:
                    try:
                        os.remove(p)
                    except FileNotFoundError:
                        pass

    def _merge_cycle(self, prof: torch.profiler.profile) -> None:
        """Fold this cycle's per-operator averages into the run's (bounded: one row per operator)."""
        try:
            events = prof.key_averages()
        except (AssertionError, RuntimeError):
            return
        for ev in events:
            key = (ev.key, str(getattr(ev, "device_type", "")))
            acc = self._averages.get(key)
            if acc is None:
                acc = self._averages[key] = FunctionEventAvg()
            acc.add(ev)
            # drop links to this cycle's events so they can be freed
            acc.cpu_children = acc.cpu_parent = None
            acc.stack = []

    def _build_summary(self) -> str:
        if not self._averages:
            return ""  # nothing was recorded (the schedule never reached an active step)
        events = EventList(list(self._averages.values()))
        sorts = ["cpu_time_total"]
        if self.profile_memory:
            sorts.append("self_cpu_memory_usage")
        if ProfilerActivity.CUDA in self.activities:
            sorts.append("cuda_time_total")
            if self.profile_memory:
                sorts.append("self_cuda_memory_usage")
        parts = []
        for key in sorts:
            parts.append(f"== sorted by {key} (rank {self.fmt['rank']}, all recorded cycles) ==")
            parts.append(events.table(sort_by=key, row_limit=self.row_limit))
        return "\n".join(parts) + "\n"

    def summary(self) -> str:
        """The summary tables built at stop() ("" if nothing was recorded)."""
        if self._prof is not None:
            raise ProfilingError("TraceProfiler: summary() is available after stop() / the `with` block")
        return self.summary_text or ""
