"""``native_hooks=True``: the pack hook's keep path in C++ (offload/_native) decides, records and keeps
exactly what the Python hook does, and hands everything else to it.

The extension is built on first use (about 20 s). Where it cannot be built the tests skip with the
reason, except in CI (``CI=true``), where that is a failure: CI must test it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from torch import nn

from offload import OffloadActivations, OffloadConfig, OffloadError, _native, add_pack_observer
from offload import _handles, _observers, _packing
from offload.ledger import PackRecord
from offload import get_act_offloading_ctx_manager

from _installed import linked_install
from offload_testkit import (
    RECORD_FIELDS,
    assert_pack_matches_general,
    assert_same_grads,
    compiled_toy_reference,
    loss_of,
    make_inputs,
    make_model,
    no_gc,
    pack_case_strategies,
    require_native,
    run_step,
    twin_of,
)

INPLACE = "modified by an inplace operation"


@pytest.fixture(scope="module", autouse=True)
def native_built():
    return require_native()


def _timing_free(summary: dict) -> dict:
    out = {k: v for k, v in summary.items() if not k.endswith("_seconds") and k not in ("pool", "bandwidth")}
    if "tiers" in out:  # per tier: bytes and counts, not seconds
        out["tiers"] = {t: {k: v for k, v in row.items() if "seconds" not in k} for t, row in out["tiers"].items()}
    return out


@settings(max_examples=60, deadline=None)
@given(**pack_case_strategies())
def test_native_pack_decides_and_records_as_the_general_path(kinds, min_size, excluded, after_head, with_model,
                                                           dtype, in_backward):
    """For random mixes of 25 kinds of saved tensors (activations and their views, leaves, weights,
    frozen weights and views of both, aliases, flagged tensors, empty, scalar, meta, nested, quantized,
    sparse, conjugate and negative views, a running module's buffer), under every size / region / head /
    in-backward state (offload candidates included: min_size 0 and 16): the C++
    hook's records, totals, unique bytes and unpacked values are the general path's."""
    assert_pack_matches_general(kinds, min_size, excluded, after_head, with_model, dtype, in_backward, native=True)


def _engine(model: nn.Module | None, native: bool, **kw) -> OffloadActivations:
    """A CPU engine; with ``model``, torchtune's ctx manager for it (its output head excluded)."""
    if model is not None:
        return get_act_offloading_ctx_manager(model, True, device="cpu", native_hooks=native, **kw)
    return OffloadActivations(device="cpu", native_hooks=native, **kw)


@pytest.mark.parametrize("min_size", [0, 1024, 1 << 40], ids=["offload_all", "default", "keep_all"])
@pytest.mark.parametrize("kind", ["mlp", "conv", "toy", "toy_tied"])
def test_native_training_steps_match_the_python_hook(kind, min_size):
    """Three steps of each model: bitwise the no-offload twin's loss and grads, and the Python hook's
    ledger (every record, every total) and pool; head exclusion on for the toy LMs."""
    models = [make_model(kind) for _ in range(2)]
    twin = twin_of(models[0])
    head = kind.startswith("toy")
    engines = [_engine(m if head else None, native, min_offload_size=min_size)
               for m, native in zip(models, (False, True))]
    for step in range(3):
        inputs = make_inputs(kind, seed=20 + step)
        want = run_step(twin, inputs)
        for model, ctx in zip(models, engines):
            got = run_step(model, inputs, ctx)
            assert torch.equal(got, want), (kind, step, ctx.config.native_hooks)
            assert_same_grads(model, twin)
        for m in (*models, twin):
            m.zero_grad(set_to_none=True)
    recs = [list(e.ledger.records) for e in engines]
    assert len(recs[0]) == len(recs[1]) > 0
    fields = [f for f in RECORD_FIELDS if f != "storage_key"]  # addresses: two runs, two allocations
    for a, b in zip(*recs):
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    sums = [_timing_free(e.ledger.summary()) for e in engines]
    assert sums[0] == sums[1]
    assert engines[0].pool.stats()["allocations"] == engines[1].pool.stats()["allocations"]
    reasons = set(sums[1]["kept_by_reason"])
    if head:
        assert "after_head" in reasons or "excluded_region" in reasons, reasons


def test_native_hook_is_what_enter_pushes_and_it_holds_nothing_after_exit():
    """__enter__ pushes the C++ hook (recognised as the engine's own); after __exit__ nothing holds the
    engine: an engine built per step is freed by reference counting (Rule 10)."""
    ctx = OffloadActivations(device="cpu", native_hooks=True)
    with ctx:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert type(top[0]).__name__ == "builtin_function_or_method" and ctx._owns_pack_hook(top[0])
        assert not OffloadActivations(device="cpu")._owns_pack_hook(top[0])
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    a = torch.randn(64, requires_grad=True)
    with no_gc():
        ctx = OffloadActivations(device="cpu", native_hooks=True, min_offload_size=1 << 30)
        with ctx:
            y = a.exp()  # kept: a saved output
        y.sum().backward()
        ref = weakref.ref(ctx)
        del ctx, y
        assert ref() is None


def test_native_kept_saved_output_forms_no_cycle():
    """A kept saved output (exp saves its result) is freed by refcount: the handle holds an alias with
    no grad_fn, and forward-only steps free their graphs at once (issue 12 item 4)."""
    a = torch.randn(256, requires_grad=True)
    ctx = OffloadActivations(device="cpu", native_hooks=True, min_offload_size=1 << 30)
    with no_gc():
        for _ in range(3):
            with ctx:
                y = a.exp().tanh()
            ref = weakref.ref(y)
            del y
            assert ref() is None
            assert ctx._step_ref() is None, "a handle of the freed graph is still alive"


def test_native_kept_tensor_modified_in_place_raises_autograd_error():
    """Rule 6 on the C++ path: the alias shares the version counter, so autograd's in-place error is
    raised at backward, as without offloading (issue 12 item 1)."""
    a = torch.randn(64, requires_grad=True)
    with OffloadActivations(device="cpu", native_hooks=True, min_offload_size=1 << 30):
        x = a.exp()
        out = (x * x).sum()
    x.masked_fill_(a > 0, 0.5)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.backward()


def test_native_offloaded_tensor_modified_in_place_raises_autograd_error():
    """Rule 6 on the C++ hook's offload path: the version tracker it makes shares the saved tensor's
    version counter, so an in-place write after the save is caught at backward even though the
    offloaded tensor itself is gone."""
    a = torch.randn(64, requires_grad=True)
    with OffloadActivations(device="cpu", native_hooks=True, min_offload_size=0) as ctx:
        x = a.exp()
        out = (x * x).sum()
    assert ctx.ledger.summary()["offloaded_bytes"] > 0
    x.masked_fill_(a > 0, 0.5)
    with pytest.raises(RuntimeError, match=INPLACE):
        out.backward()


@pytest.mark.parametrize("kind", ["contiguous", "strided_view"])
def test_native_offload_handle_tracks_the_version_and_holds_no_storage(kind):
    """The handle of a tensor the C++ hook offloads: its version tracker is an empty tensor (the source's
    bytes can be freed) that follows the source's version; its host copy holds the source's bytes;
    the record is the Python hook's."""
    base = torch.randn(4, 64, requires_grad=True) * 2
    t = base if kind == "contiguous" else base[:, ::2]
    engines = [OffloadActivations(device="cpu", native_hooks=native, min_offload_size=0) for native in (True, False)]
    with engines[0], engines[1]:
        hooks = (engines[0]._native.hook_for(engines[0], engines[0]._thread()), engines[1]._pack)
        handles = [hook(t) for hook in hooks]
    for h in handles:
        assert type(h) is _handles._Offloaded
        assert type(h.tracker) is torch.Tensor and h.tracker.untyped_storage().nbytes() == 0
        assert h.tracker._version == t._version
        assert (h.version, h.layout) == (handles[1].version, handles[1].layout)
    recs = [e.ledger.records[-1] for e in engines]
    assert {f: getattr(recs[0], f) for f in RECORD_FIELDS} == {f: getattr(recs[1], f) for f in RECORD_FIELDS}
    with torch.no_grad():
        t.mul_(3)
    assert all(h.tracker._version == t._version != h.version for h in handles)


def test_native_hands_observed_and_foreign_thread_packs_to_python():
    """While an observer is registered on the engine the Python hook runs (it notifies), not for another
    engine's observer; a pack on a thread other than __enter__'s (autograd's device threads) reads that
    thread's state through the Python hook."""
    ctx = OffloadActivations(device="cpu", native_hooks=True, min_offload_size=1 << 30)
    other = OffloadActivations(device="cpu")
    other_handle = other.add_observer(lambda e: None)  # the process-wide count is not zero from here on
    seen = []
    calls = []
    real = OffloadActivations._pack

    def spy(self, t):
        calls.append(threading.get_ident())
        return real(self, t)

    a = torch.randn(8, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(OffloadActivations, "_pack", spy)
        with ctx:
            a.exp().sum().backward()
        assert calls == []  # kept tensors: the C++ hook alone
        handle = ctx.add_observer(seen.append)
        with ctx:
            a.exp().sum().backward()
        assert len(calls) == 1 and len(seen) == 1
        handle.remove()
        with ctx:
            a.exp().sum().backward()
        assert len(calls) == 1  # the C++ hook again
        with add_pack_observer(seen.append), ctx:  # this thread's observers see every engine's packs
            a.exp().sum().backward()
        assert len(calls) == 2 and len(seen) == 2
        with ctx:
            hook = torch._C._autograd._top_saved_tensors_default_hooks(False)[0]
            ctx._thread().excluded_depth = 1  # the entering thread's state: "excluded_region" there
            out = []
            th = threading.Thread(target=lambda: out.append(hook(a.sin())))
            th.start()
            th.join()
            ctx._thread().excluded_depth = 0
        assert len(calls) == 3 and calls[-1] != threading.get_ident()
    assert ctx.ledger.records[-1].reason == "too_small"  # the other thread's own (fresh) state
    other_handle.remove()


def test_native_hooks_setting_is_checked_and_unavailability_is_explained(monkeypatch, caplog, recwarn):
    """native_hooks is "auto", True or False; True where it cannot be built raises, saying why and what to
    do; "auto" there runs the Python hook, with one log line and no warning (nobody asked for it)."""
    with pytest.raises(TypeError, match="native_hooks='yes'.*'auto', True or False"):
        OffloadConfig(native_hooks="yes")
    assert OffloadConfig.from_dict({"native_hooks": True}).native_hooks is True
    assert OffloadConfig.__dataclass_fields__["native_hooks"].default in ("auto", True, False)  # (the test options)

    def unavailable(announce=True):
        raise _native.NativeUnavailable("RuntimeError: Ninja is required to load C++ extensions")

    _fresh_native_state(monkeypatch)
    monkeypatch.setattr(_native, "load", unavailable)
    with pytest.raises(OffloadError, match="native_hooks=True.*Ninja is required.*native_hooks=False"):
        OffloadActivations(device="cpu", native_hooks=True)
    caplog.set_level("INFO", logger="offload._native")
    ctx = OffloadActivations(device="cpu", native_hooks="auto")
    _native._background.join(30)
    a = torch.randn(8, requires_grad=True)
    with ctx:
        assert getattr(_top_pack_hook(), "__func__", None) is OffloadActivations._pack
        y = a.exp().sum()
    y.backward()
    said = [r for r in caplog.records if "cannot be built here" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO" and "Ninja is required" in said[0].getMessage()
    OffloadActivations(device="cpu", native_hooks="auto")  # the failure is remembered: no second line
    assert len([r for r in caplog.records if "cannot be built here" in r.getMessage()]) == 1
    assert not [w for w in recwarn if "native" in str(w.message)]


def _fresh_native_state(monkeypatch) -> None:
    """offload._native as in a process that has not loaded, built or tried to build it yet (restored after)."""
    for name, value in (("_module", None), ("_failure", None), ("_background", None), ("_announced", None)):
        monkeypatch.setattr(_native, name, value)


def _top_pack_hook():
    return torch._C._autograd._top_saved_tensors_default_hooks(False)[0]


def test_native_auto_builds_in_the_background_and_the_next_enter_switches(monkeypatch, caplog):
    """native_hooks="auto" while the extension builds: the constructor does not wait for the build, the
    Python hook runs, and the first `with` after the build finished pushes the C++ hook; the ledger records
    the same either way (the hooks decide and record alike)."""
    built = _native.load()
    _fresh_native_state(monkeypatch)
    release = threading.Event()

    def slow_load(announce=True):
        assert not announce and release.wait(30)
        _native._module = built
        return built

    monkeypatch.setattr(_native, "load", slow_load)
    monkeypatch.setattr(_native, "is_built", lambda: False)
    caplog.set_level("INFO", logger="offload._native")
    ctx = OffloadActivations(device="cpu", native_hooks="auto", min_offload_size=1 << 30)
    twin = OffloadActivations(device="cpu", native_hooks=False, min_offload_size=1 << 30)
    assert ctx._native is None and [r.levelname for r in caplog.records if "background" in r.getMessage()] == ["INFO"]
    a = torch.randn(8, requires_grad=True)
    hooks = []
    for step in range(2):
        for eng in (ctx, twin):
            with eng:
                hooks.append(_top_pack_hook())
                y = a.exp().sin().sum()
            y.backward()
        if step == 0:
            release.set()
            _native._background.join(30)
    assert getattr(hooks[0], "__func__", None) is OffloadActivations._pack  # step 0: building
    assert built.is_hook_of(hooks[2], ctx)  # step 1: built
    fields = ("step", "decision", "reason", "nbytes", "shape", "dtype", "module", "storage_nbytes")
    recs = [[tuple(getattr(r, f) for f in fields) for r in e.ledger.records] for e in (ctx, twin)]
    assert len(recs[0]) == 4 and recs[0] == recs[1]
    assert ctx.ledger.summary()["kept_by_reason"] == twin.ledger.summary()["kept_by_reason"]


def _built_copy(tmp_path: Path) -> Path:
    """A copy of the built extension's folder, under a new extensions root (``root / name``): a child
    process given ``TORCH_EXTENSIONS_DIR=root`` only loads it."""
    import shutil

    _native.load()
    copy = tmp_path / "ext" / _native._build_name()
    shutil.copytree(_native.build_dir(), copy)
    return copy


def _load_in_child(copy: Path, code: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child Python from the repository, with ``copy`` (``_built_copy``) as its extension
    and ``env`` over this environment; the finished process (``subprocess.TimeoutExpired`` past ``timeout``)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(copy.parent), **env)
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_build(tmp_path):
    """A build killed midway leaves torch's `lock` file in the build directory, on which torch's own
    cpp_extension.load waits forever; the next process that builds or loads the extension removes it (no
    live build holds it) and loads (a subprocess, with a timeout: before the fix it hung)."""
    copy = _built_copy(tmp_path)
    lock = copy / "lock"
    lock.write_text("")  # what FileBaton leaves when its process is killed during the build
    code = "import logging; logging.basicConfig(); from offload import _native; _native.load(); print('loaded')"
    try:
        done = _load_in_child(copy, code, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the next load waited on the stale build lock")
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert not lock.exists() and "removed" in done.stderr and "was killed or whose process ended" in done.stderr


def test_the_build_finds_the_ninja_package_where_path_has_no_ninja(tmp_path):
    """ninja is a dependency, but its binary sits beside the interpreter's scripts, which are not on PATH for
    a virtual environment's Python run without activating it; torch's build runs `ninja` from PATH (also to
    load a built extension in a new process), so the build puts the package's binary on PATH, and restores
    PATH after (a subprocess whose PATH has no ninja: before, "Ninja is required to load C++ extensions")."""
    import shutil

    pytest.importorskip("ninja")
    copy = _built_copy(tmp_path)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and shutil.which("ninja", path=d) is None)
    code = ("import logging, os, shutil; logging.basicConfig(level=logging.INFO); before = os.environ['PATH']; "
            "assert shutil.which('ninja') is None, 'ninja still on PATH'; from offload import _native; "
            "_native.load(); assert os.environ['PATH'] == before, 'PATH not restored'; print('loaded')")
    done = _load_in_child(copy, code, timeout=300, PATH=path)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert "ninja package's binary" in done.stderr


def test_installs_linked_to_one_source_share_its_build(tmp_path):
    """Two link farms over the same files load one build: the second neither rebuilds nor touches it. Before,
    torch's build file named the source by the path it was reached through, so every new path rebuilt the
    extension (~40 s: each docs block of tests/test_readme.py paid it)."""
    copy = _built_copy(tmp_path)
    code = ("import sys, offload; from offload import _native; assert offload.__file__.startswith(sys.argv[1]), "
            "offload.__file__; _native.load(); print('loaded')")
    stamps = []
    for farm in ("a", "b"):
        site = linked_install(tmp_path / farm)
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(copy.parent), PYTHONPATH=str(site))
        done = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
        stamps.append({f.name: f.stat().st_mtime_ns for f in copy.iterdir() if f.suffix in (".so", ".o", ".ninja")})
    assert stamps[0] and stamps[1] == stamps[0], "the second path rebuilt the extension"
    assert [d.name for d in copy.parent.iterdir()] == [copy.name], "a path built an extension of its own"
    assert str(tmp_path) not in (copy / "build.ninja").read_text()


def test_a_build_lock_held_by_a_live_build_is_waited_for_not_broken(tmp_path):
    """While another live process builds (it holds the advisory lock), torch's lock file is not touched:
    the next build waits, and gives up with a reason after its deadline; once the holder is gone the
    lock file is stale and removed."""
    fcntl = pytest.importorskip("fcntl")
    where = tmp_path / "build"
    where.mkdir()
    (where / "lock").write_text("")
    with open(where / _native._OUR_LOCK, "a+") as holder:  # a second open file: what another process holds
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.warns(UserWarning, match="waiting for another process"), \
                pytest.raises(_native.NativeUnavailable, match="another process .* building .* for over 0 s"):
            with _native.build_lock(where, wait_s=0.3):
                pass
        assert (where / "lock").exists()
        fcntl.flock(holder, fcntl.LOCK_UN)
    with _native.build_lock(where, wait_s=0.3):
        assert not (where / "lock").exists()


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="an earlier build's compiler is seen through /proc")
def test_a_stale_lock_is_removed_only_once_an_earlier_builds_compiler_ends(tmp_path):
    """A process that ends during its build (a short script under "auto": the build runs on a daemon thread)
    leaves torch's lock and a free advisory lock, but torch's ninja and the compiler run on in the build
    directory. The next build waits for them (a warning first; past its deadline it gives up, naming them, and
    leaves the lock), and removes the lock once they are gone: two builds never write one directory."""
    where = tmp_path / "build"
    where.mkdir()
    (where / "lock").write_text("")
    orphan = subprocess.Popen(["sleep", "60"], cwd=where)  # what ninja is once the process that ran it ended
    try:
        with pytest.warns(UserWarning, match=rf"compiler of an earlier build .*pids \[{orphan.pid}\]"), \
                pytest.raises(_native.NativeUnavailable, match=rf"pids \[{orphan.pid}\]\) has been running .* 0 s"):
            with _native.build_lock(where, wait_s=0.3):
                pass
        assert (where / "lock").exists()
    finally:
        orphan.kill()
        orphan.wait()
    finishing = subprocess.Popen(["sleep", "1"], cwd=where)
    with pytest.warns(UserWarning, match="compiler of an earlier build"):
        with _native.build_lock(where, wait_s=60):
            assert finishing.poll() == 0 and not (where / "lock").exists()


def test_native_pass_through_engine_uses_the_python_hook():
    """A pass-through engine (no device) keeps the Python hook: it records reason 'disabled'."""
    if torch.accelerator.is_available():
        pytest.skip("pass-through needs a machine without an accelerator")
    with pytest.warns(UserWarning, match="pass-through"):
        ctx = OffloadActivations(device=None, native_hooks=True)
    a = torch.randn(8, requires_grad=True)
    with ctx:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)[0]
        assert getattr(top, "__func__", None) is OffloadActivations._pack
        a.exp().sum().backward()
    assert {r.reason for r in ctx.ledger.records} == {"disabled"}


def test_native_constants_match_the_engine_module():
    """configure() got the engine's own objects (identity compares in C++ rely on it)."""
    consts = _native._constants()
    assert consts["observer_count"] is _observers._observer_count
    assert consts["step_type"] is _handles._Step
    assert consts["parameter"] is _packing._PARAMETER


def test_native_loss_of_toy_under_autocast_matches():
    """bf16 autocast on CPU: casts saved inside autocast go through the C++ hook, bitwise the twin."""
    model = make_model("toy")
    twin = twin_of(model)
    inputs = make_inputs("toy")
    ctx = get_act_offloading_ctx_manager(model, True, device="cpu", native_hooks=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with ctx:
            got = loss_of(model, inputs)
        got.backward()
        want = loss_of(twin, inputs)
        want.backward()
    assert torch.equal(got, want)
    assert_same_grads(model, twin)


def test_native_under_torch_compile_bitwise():
    """A torch.compile'd toy Llama under the C++ hook (kept and offloaded saves mixed): the compiled
    twin's loss and grads bit for bit, and the Python hook's records."""
    torch._dynamo.reset()
    try:
        model, compiled, inputs, want, ref = compiled_toy_reference()
        records = []
        for native in (True, False):
            model.zero_grad(set_to_none=True)
            ctx = OffloadActivations(device="cpu", native_hooks=native)
            with ctx:
                got = loss_of(compiled, inputs)
            got.backward()
            assert torch.equal(got, want)
            for n, p in model.named_parameters():
                assert torch.equal(p.grad, ref[n]), (native, n)
            records.append([(r.reason, r.decision, r.nbytes, r.shape) for r in ctx.ledger.records])
        assert records[0] == records[1] and {"too_small"} <= {r[0] for r in records[0]}
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("use_streams", [True, False], ids=["streams", "sync"])
def test_gpu_native_matches_the_python_hook(use_streams):
    """On CUDA (pinned pool, side-stream copies): the C++ hook's steps are bitwise the no-offload twin's
    and its ledger is the Python hook's, record by record, with the head excluded."""
    models = [make_model("toy").cuda() for _ in range(2)]
    twin = twin_of(models[0])
    engines = [get_act_offloading_ctx_manager(m, True, native_hooks=n, use_streams=use_streams)
               for m, n in zip(models, (False, True))]
    for step in range(3):
        x, y = make_inputs("toy", seed=30 + step)
        inputs = (x.cuda(), y.cuda())
        want = run_step(twin, inputs)
        for model, ctx in zip(models, engines):
            got = run_step(model, inputs, ctx)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (step, ctx.config.native_hooks)
            assert_same_grads(model, twin)
        for m in (*models, twin):
            m.zero_grad(set_to_none=True)
    fields = [f for f in RECORD_FIELDS if f != "storage_key"]
    recs = [[{f: getattr(r, f) for f in fields} for r in e.ledger.records] for e in engines]
    assert recs[0] == recs[1] and any(r["decision"] == "offloaded" for r in recs[1])
    sums = [_timing_free(e.ledger.summary()) for e in engines]
    for s in sums:
        s.pop("peak_inflight_bytes")  # when copies complete: timing on a GPU
    assert sums[0] == sums[1]


def test_native_kept_records_are_untracked_at_once():
    """The C++ hook logs the same tuple the Python hook logs (shape as a tuple) and takes it off the
    cycle collector's lists at once: the records ring never reaches the old generation."""
    import gc

    ctx = OffloadActivations(device="cpu", native_hooks=True, min_offload_size=1 << 30)
    a = torch.randn(64, requires_grad=True)
    with ctx:
        y = a.exp().sin().sum()
    logged = [r for r in ctx.ledger._records if type(r) is tuple]
    assert len(logged) >= 2 and not any(gc.is_tracked(r) or gc.is_tracked(r[3]) for r in logged)
    assert all(type(r[3]) is tuple for r in logged)
    y.backward()


def test_native_offload_records_are_every_field_the_python_hooks_and_untracked():
    """An offload candidate's PackRecord, filled slot by slot by the C++ hook (no generated __init__),
    has every field the Python hook's record has, defaults included, before and after backward, and
    is off the cycle collector's lists (its fields are atoms)."""
    import dataclasses
    import gc

    assert _native.load().records_made_directly()
    a = torch.randn(4, 64, requires_grad=True)
    engines = [OffloadActivations(device="cpu", native_hooks=native, min_offload_size=0) for native in (True, False)]
    outs = []
    for ctx in engines:
        with ctx:
            # exp and tanh save their outputs; sin a strided view of a fresh storage (a gathered copy)
            outs.append(a.exp().tanh().sum() + (a * 2)[:, ::4].sin().sum())
    timing = {"seq", "d2h_s", "h2d_s", "storage_key"}  # (two runs: their own order, clocks and addresses)
    fields = [f.name for f in dataclasses.fields(PackRecord) if f.name not in timing]

    def offloaded(ctx):
        return [r for r in ctx.ledger.records if r.decision == "offloaded"]

    for when in ("forward", "backward"):
        recs = [offloaded(ctx) for ctx in engines]
        assert len(recs[0]) == len(recs[1]) >= 2
        for a_rec, b_rec in zip(*recs):
            assert type(a_rec) is type(b_rec) is PackRecord
            assert {f: getattr(a_rec, f) for f in fields} == {f: getattr(b_rec, f) for f in fields}, when
            assert (a_rec.d2h_s is None) == (b_rec.d2h_s is None) and (a_rec.h2d_s is None) == (b_rec.h2d_s is None)
        assert not any(gc.is_tracked(r) for r in recs[0])
        if when == "forward":
            for out in outs:
                out.backward()


def test_native_record_layout_falls_back_to_calling_the_class():
    """Where the record class is not a plain slots dataclass (a default factory, too few fields, a
    __post_init__), the C++ hook is told to call the class instead of filling slots: the class's own
    __init__ (and its __post_init__) then makes every offload candidate's record."""
    module = _native.load()
    assert _native._record_fields(PackRecord) is not None

    @dataclasses.dataclass
    class WithFactory:
        x: list = dataclasses.field(default_factory=list)

    assert _native._record_fields(WithFactory) is None

    @dataclasses.dataclass(slots=True, eq=False)
    class Posted(PackRecord):
        def __post_init__(self) -> None:
            self.h2d_s = -1.0  # (set by nothing else before backward)

    consts = _native._constants()
    try:
        module.configure({**consts, "pack_record_fields": consts["pack_record_fields"][:5]})
        assert not module.records_made_directly()
        module.configure({**consts, "pack_record": Posted, "pack_record_fields": _native._record_fields(Posted)})
        assert not module.records_made_directly()
        ctx = OffloadActivations(device="cpu", native_hooks=True, min_offload_size=0)
        a = torch.randn(64, requires_grad=True)
        with ctx:
            a.exp().sum()
        recs = [r for r in ctx.ledger.records if r.decision == "offloaded"]
        assert recs and all(type(r) is Posted and r.h2d_s == -1.0 for r in recs)
    finally:
        module.configure(consts)
    assert module.records_made_directly()


def test_native_build_failure_is_remembered_and_names_the_compiler_error(monkeypatch):
    """A failed build says which compiler error stopped it (not ninja's last line), and is not retried
    by every engine built afterwards in the process."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "_failure", None)
    calls = []

    def broken(**kwargs):
        calls.append(kwargs["name"])
        # What torch raises: its message carries ninja's output, which ends in ninja's own line.
        raise RuntimeError(f"Error building extension '{kwargs['name']}': [1/2] c++ -MMD -c pack.cpp -o pack.o\n"
                           "pack.cpp:10:3: error: 'Foo' was not declared in this scope\n"
                           "ninja: build stopped: subcommand failed.\n")

    monkeypatch.setattr(cpp_extension, "load", broken)
    for _ in range(2):
        with pytest.raises(_native.NativeUnavailable, match="error: 'Foo' was not declared"):
            _native.load()
    assert len(calls) == 1 and calls[0].startswith("offload_native_pack_") and not _native.available()
    with pytest.raises(OffloadError, match="native_hooks=True.*'Foo' was not declared"):
        OffloadActivations(device="cpu", native_hooks=True)


def test_native_hooks_default_follows_the_test_option(hooks):
    """``pytest --python-hooks`` (CI's second pass) makes every engine the tests build use the Python hook,
    ``--native-hooks`` the C++ hook; without either the default is "auto", which the session resolved
    before the first test: the C++ hook wherever it builds."""
    option = hooks
    want = {"native": True, "python": False, "auto": "auto"}[option]
    assert OffloadConfig().native_hooks == want
    ctx = OffloadActivations(device="cpu")
    assert ctx.config.native_hooks == want
    native = option == "native" or (option == "auto" and _native.loaded() is not None)
    with ctx:
        assert (getattr(_top_pack_hook(), "__func__", None) is not OffloadActivations._pack) is native


def test_native_auto_leaves_a_subclass_its_own_pack():
    """An engine whose class overrides _pack runs it under the default ("auto"): the C++ hook would keep
    tensors without calling it."""
    calls = []

    class Counting(OffloadActivations):
        def _pack(self, t):
            calls.append(1)
            return super()._pack(t)

    ctx = Counting(device="cpu", native_hooks="auto", min_offload_size=1 << 30)
    a = torch.randn(8, requires_grad=True)
    with ctx:
        y = a.exp().sum()
    y.backward()
    assert ctx._native is None and len(calls) == 1 and ctx.ledger.records[-1].reason == "too_small"


def test_native_hook_follows_a_ledger_reset_and_new_steps_inside_one_with():
    """The C++ hook caches the ledger's logs and the step it marked used: after ledger.reset() (new logs)
    and across steps closed while the engine stays entered, its records and totals are the Python hook's."""
    a = torch.randn(64, requires_grad=True)
    got = []
    for native in (True, False):
        ctx = OffloadActivations(device="cpu", native_hooks=native, min_offload_size=1 << 30)
        with ctx:
            for i in range(3):
                y = (a.exp() * a).sin().sum()
                if i == 1:
                    ctx.ledger.reset()
                y.backward()
                y = a.tanh().sum()  # packed after the backward closed the step
                y.backward()
        recs = [(r.step, r.decision, r.reason, r.nbytes, r.shape, r.dtype) for r in ctx.ledger.records]
        got.append((recs, _timing_free(ctx.ledger.summary()), [s.kept_count for s in ctx.ledger.step_totals]))
    assert got[0] == got[1] and got[0][0]


def test_native_module_names_follow_renames_and_deaths_inside_one_with():
    """The C++ hook reuses the last module name it found while the naming generation stands: a model
    registered mid-entry (which renames a module already named) and a named module's death (a new module
    may land on its address) inside one ``with`` give every record the Python hook's module name."""
    import gc

    from offload import modules as om

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8))

        def forward(self, x):
            return (x * self.w).sin() * self.w

    class Other(Block):
        pass

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    x = torch.randn(8, requires_grad=True)
    got = []
    for native in (True, False):
        inner, names = Block(), []
        ctx = OffloadActivations(device="cpu", native_hooks=native, min_offload_size=1 << 30)
        with ctx:
            if native:
                assert _native.loaded().is_hook_of(_top_pack_hook(), ctx)
            inner(x).sum().backward()  # its own root: "Block"
            inner(x).sum().backward()  # (the cached name)
            outer = Wrapper(inner)
            om.register_model(outer)  # renamed "Wrapper.inner" inside the same entry
            inner(x).sum().backward()
            doomed = Block()
            doomed(x).sum().backward()
            old = id(doomed)
            del doomed
            gc.collect()
            for _ in range(500):  # CPython reuses freed memory: a new module on the dead one's address
                fresh = Other()
                if id(fresh) == old:
                    fresh(x).sum().backward()
                    names.append("found")
                    break
                del fresh
        got.append(([(r.step, r.module) for r in ctx.ledger.records], names))
        del outer
    assert got[0] == got[1]
    recs, found = got[0]
    by_step: dict[int, set[str]] = {}
    for step, module in recs:
        by_step.setdefault(step, set()).add(module)
    assert [by_step[s] for s in sorted(by_step)][:4] == [{"Block"}, {"Block"}, {"Wrapper.inner"}, {"Block"}]
    if found:  # (where the allocator gave the address back)
        assert by_step[max(by_step)] == {"Other"} and len(by_step) == 5


def test_native_innermost_pack_hook_is_torchs_top_pack_hook():
    """``innermost_pack_hook`` (module calls' check of NOTE [ Nested hooks ] rule 3) returns what
    ``torch._C._autograd._top_saved_tensors_default_hooks(False)`` returns first: None with no hooks and
    while the hooks are deferred for tracing, else the innermost pack hook, through nesting and unwinding,
    on each thread its own; no reference is leaked."""
    import sys

    read = _native.load().innermost_pack_hook
    top = torch._C._autograd._top_saved_tensors_default_hooks

    def agrees() -> bool:
        t = top(False)
        return read() is (None if t is None else t[0])

    assert read() is None and agrees()
    packs = [lambda t: t for _ in range(3)]
    with torch.autograd.graph.saved_tensors_hooks(packs[0], lambda t: t):
        assert read() is packs[0] and agrees()
        with torch.autograd.graph.saved_tensors_hooks(packs[1], lambda t: t):
            assert read() is packs[1] and agrees()
            tracing = torch._C._autograd._saved_tensors_hooks_set_tracing(True)
            try:
                assert read() is None and agrees()
            finally:
                torch._C._autograd._saved_tensors_hooks_set_tracing(tracing)
            other: list = []
            thread = threading.Thread(target=lambda: other.append(read()))
            thread.start()
            thread.join()
            assert other == [None]
            counts = []
            for n in (1, 100):
                for _ in range(n):
                    read()
                counts.append(sys.getrefcount(packs[1]))
            assert counts[0] == counts[1], counts
        assert read() is packs[0] and agrees()
    assert read() is None
