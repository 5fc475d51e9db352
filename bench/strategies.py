"""Bench strategies: one small function each, all run the same way on one shared model.

A strategy function takes the :class:`BenchEnv` and returns a :class:`Prepared`
whose ``step()`` runs one forward + loss + backward and returns the detached
loss. The harness zeroes gradients, times the step and reads memory; a
strategy only decides how activations are kept (saved, recomputed or moved).

The forward runs inside the memory-saving context and the loss and backward
outside it, as torchtune recipes do; the loss is therefore computed the same
way for every strategy.

A strategy that cannot run here raises :class:`Skip` with the reason, which
is recorded in the results instead of the numbers.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from bench.model import ToyLlama

__all__ = ["BenchEnv", "Prepared", "Skip", "StrategySpec", "STRATEGIES", "DEFAULT_ORDER"]

# min_offload_size that no tensor reaches: the engine runs, records every pack, moves nothing.
_NOTHING = 1 << 62


class Skip(Exception):
    """This strategy cannot run in this environment; the message says why."""


@dataclass
class BenchEnv:
    """What every strategy gets: the shared model and batch, and where the engine should offload from."""

    model: ToyLlama
    tokens: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64
    device: torch.device
    engine_device: str | None
    """``"cpu"`` on a CPU-only machine, so the engine's real pack -> pool -> unpack path runs;
    None on a GPU (the engine then offloads from the current accelerator)."""

    def loss_backward(self, logits: torch.Tensor) -> torch.Tensor:
        """Cross-entropy in float32 and backward; returns the detached loss."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), self.targets.flatten())  # (B*T, V) -> ()
        loss.backward()
        return loss.detach()

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"


@dataclass
class Prepared:
    step: Callable[[], torch.Tensor]
    """One forward + loss + backward; returns the detached loss."""
    engine: Any = None
    """The OffloadActivations whose ledger and pool the harness reports (ours only)."""
    hooks: Any = None
    """The ``saved_tensors_hooks`` instance whose pack hook makes host copies (ours and ``save_on_cpu``):
    the harness measures what that hook allocates, the same way for every arm."""
    isolated: bool = False
    """Run alone (warm-up then measured steps, not interleaved with others): compiled strategies."""
    close: Callable[[], None] | None = None
    """Undo global state (dynamo caches, config patches) after the strategy's last step."""


@dataclass(frozen=True)
class StrategySpec:
    name: str
    description: str
    prepare: Callable[[BenchEnv], Prepared]
    group: str
    """``baseline``, ``ours``, ``control`` or ``peer``."""
    reference: str = "none"
    """Strategy whose loss and grads this one must equal bitwise (compiled ones: ``compile``)."""
    gpu_only: str = ""
    """Why it cannot run without CUDA ("" if it can): the harness skips it before the run starts,
    so the progress bar's total is right from its first tick."""
    reorders_sums: bool = False
    """It changes the order of sums over tokens (tiles), so its loss and grads are judged within
    ``bench.verdict.reordered_tolerance``, not bitwise."""


STRATEGIES: dict[str, StrategySpec] = {}


def _strategy(
    name: str, group: str, description: str, reference: str = "none", gpu_only: str = "", reorders_sums: bool = False
) -> Callable[[Callable[[BenchEnv], Prepared]], Callable]:
    def register(fn: Callable[[BenchEnv], Prepared]) -> Callable[[BenchEnv], Prepared]:
        STRATEGIES[name] = StrategySpec(name=name, description=description, prepare=fn, group=group,
                                        reference=reference, gpu_only=gpu_only, reorders_sums=reorders_sums)
        return fn

    return register


def _offload_module() -> Any:
    try:
        import offload
    except Exception as e:  # ImportError before the engine lands, or anything it raises on import
        raise Skip(f"the offload engine is not importable here: {type(e).__name__}: {e}") from e
    return offload


def _plain_step(env: BenchEnv, ctx_factory: Callable[[], Any] | None, *, checkpoint_blocks: bool) -> Callable:
    model = env.model

    def step() -> torch.Tensor:
        model.checkpoint_blocks = checkpoint_blocks
        if ctx_factory is None:
            logits = model(env.tokens)  # (B, T, V)
        else:
            with ctx_factory():
                logits = model(env.tokens)
        return env.loss_backward(logits)

    return step


# ---------------------------------------------------------------- baselines


@_strategy("none", "baseline", "No memory saving: every saved activation stays on the device.")
def none(env: BenchEnv) -> Prepared:
    return Prepared(step=_plain_step(env, None, checkpoint_blocks=False))


@_strategy("ac", "baseline", "Full activation checkpointing: each block under non-reentrant checkpoint.")
def ac(env: BenchEnv) -> Prepared:
    return Prepared(step=_plain_step(env, None, checkpoint_blocks=True))


def _sac_save_ops() -> frozenset:
    aten = torch.ops.aten
    names = (
        "mm.default",
        "addmm.default",
        "bmm.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
        "_scaled_dot_product_flash_attention_for_cpu.default",
    )
    ops = []
    for name in names:
        packet, overload = name.split(".")
        if hasattr(aten, packet):
            ops.append(getattr(getattr(aten, packet), overload))
    return frozenset(ops)


_SAC_SAVE_OPS = _sac_save_ops()


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul and attention outputs; recompute the cheap elementwise work (norms, RoPE, SiLU)."""
    return CheckpointPolicy.MUST_SAVE if op in _SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@_strategy("sac", "baseline", "Selective checkpointing: save matmul/attention outputs, recompute the rest.")
def sac(env: BenchEnv) -> Prepared:
    model = env.model

    context_fn = functools.partial(create_selective_checkpoint_contexts, _sac_policy)

    def step() -> torch.Tensor:
        model.checkpoint_blocks, model.checkpoint_context_fn = True, context_fn
        try:
            return env.loss_backward(model(env.tokens))
        finally:
            model.checkpoint_blocks, model.checkpoint_context_fn = False, None

    return Prepared(step=step)


# ---------------------------------------------------------------- ours


def _engine_strategy(env: BenchEnv, *, checkpoint_blocks: bool, **kwargs: Any) -> Prepared:
    offload = _offload_module()
    engine = offload.OffloadActivations(device=env.engine_device, **kwargs)
    return Prepared(step=_plain_step(env, lambda: engine, checkpoint_blocks=checkpoint_blocks), engine=engine,
                    hooks=engine)


@_strategy("offload", "ours", "Ours: OffloadActivations with side streams; everything saved is offloaded, head included.")
def offload(env: BenchEnv) -> Prepared:
    return _engine_strategy(env, checkpoint_blocks=False, use_streams=True)


@_strategy("offload_sync", "ours", "Ours without side streams (use_streams=False): copies on the compute stream.")
def offload_sync(env: BenchEnv) -> Prepared:
    return _engine_strategy(env, checkpoint_blocks=False, use_streams=False)


@_strategy("offload_ac", "ours", "Ours on top of full AC: only the checkpoint inputs (and head) are offloaded.")
def offload_ac(env: BenchEnv) -> Prepared:
    return _engine_strategy(env, checkpoint_blocks=True, use_streams=True)


@_strategy(
    "offload_head_excluded",
    "ours",
    "Head study: get_act_offloading_ctx_manager (output head kept on device); compare with `offload`.",
)
def offload_head_excluded(env: BenchEnv) -> Prepared:
    offload = _offload_module()
    engine = offload.get_act_offloading_ctx_manager(env.model, True, device=env.engine_device)
    return Prepared(step=_plain_step(env, lambda: engine, checkpoint_blocks=False), engine=engine, hooks=engine)


@_strategy("offload_verify", "ours",
           "Ours with verify=True: every offloaded span checksummed at pack and checked at reload (debugging).")
def offload_verify(env: BenchEnv) -> Prepared:
    return _engine_strategy(env, checkpoint_blocks=False, use_streams=True, verify=True)


PART_FRACTION = 3 / 16
"""``offload_part*`` offload the first ``max(1, round(PART_FRACTION x blocks))`` blocks (6 of 8B's 32): inside
the predicted frontier on an H200 (6 blocks at 1.001x ``none``, 8 at 1.019x: the most within 1.03x;
``bench/results/predicted/partial_offload_8b_L32_s4096_h200.md``), with the GPU run's sweep measuring 8 and 10."""


def part_blocks(n_layers: int) -> int:
    """How many of ``n_layers`` leading blocks the ``offload_part`` strategies offload."""
    return max(1, min(n_layers, round(PART_FRACTION * n_layers)))


PART_ENGINE_KWARGS: dict[str, dict[str, int]] = {
    "offload_part": {},
    "offload_part_bytes": {"max_fwd_stash_size": 1 << 16, "max_inflight_bytes": 4 << 30},
}
"""The engine settings of each partial offload (bench.predicted_vs_measured predicts them with the same)."""


FIRST_BLOCKS_SWEEP = (0, 4, 8, 10)
"""``offload_first<k>``: the engine on the first ``k`` blocks only, with its default copy schedule. With
``offload_part`` (``part_blocks``: 6 of 32) they make the GPU run's partial sweep k = 0, 4, 6, 8, 10 at 8B width
(``scripts/gpu_run.sh``); k = 0 is the engine installed with every block kept whole (an excluded region)."""


def first_blocks(name: str, n_layers: int) -> tuple[int, dict[str, int]] | None:
    """``(k, engine settings)`` of a strategy that offloads only the first ``k`` of ``n_layers`` blocks
    (``offload_part*``, ``offload_first<k>``); None for any other strategy. ``bench.predicted_vs_measured``
    predicts them with the same ``k`` and settings."""
    if name in PART_ENGINE_KWARGS:
        return part_blocks(n_layers), PART_ENGINE_KWARGS[name]
    if name.startswith("offload_first") and name.removeprefix("offload_first").isdigit():
        return min(n_layers, int(name.removeprefix("offload_first"))), {}
    return None


def _offload_first(env: BenchEnv, name: str) -> Prepared:
    layers = env.model.layers
    k, kwargs = first_blocks(name, len(layers))
    prepared = _engine_strategy(env, checkpoint_blocks=False, use_streams=True, **kwargs)
    # The user's way to offload only the first blocks: keep everything from block k on (and the head after it).
    region = prepared.engine.exclude(layers[k], keep_after=True) if k < len(layers) else None
    prepared.close = region.remove if region is not None else None
    return prepared


@_strategy("offload_part", "ours",
           "Ours on the first 3/16 of the blocks only (engine.exclude(layers[k], keep_after=True)), the engine's "
           "default copy schedule. Offload alone, partly: its best trade-off.")
def offload_part(env: BenchEnv) -> Prepared:
    return _offload_first(env, "offload_part")


@_strategy("offload_part_bytes", "ours",
           "offload_part with the copies in flight bounded by bytes only (max_fwd_stash_size=65536, "
           "max_inflight_bytes=4 GiB): the later blocks' compute hides the first blocks' copies.")
def offload_part_bytes(env: BenchEnv) -> Prepared:
    return _offload_first(env, "offload_part_bytes")


for _k in FIRST_BLOCKS_SWEEP:
    _strategy(f"offload_first{_k}", "ours",
              f"Ours on the first {_k} blocks only (engine.exclude(layers[{_k}], keep_after=True)), the default copy "
              "schedule: a point of the partial sweep" + (" (every block kept whole: the engine's presence)"
                                                          if _k == 0 else "") + ".")(
        functools.partial(_offload_first, name=f"offload_first{_k}"))


@_strategy("long_context", "ours",
           "Ours for long context (offload.long_context): AC + checkpoint inputs offloaded + MLP and loss in tiles "
           "along the sequence; judged within the tolerance of reordered sums.", reorders_sums=True)
def long_context(env: BenchEnv) -> Prepared:
    offload = _offload_module()
    model = env.model
    engine = offload.OffloadActivations(device=env.engine_device, model=model)

    def step() -> torch.Tensor:
        model.checkpoint_blocks = False  # long_context checkpoints the blocks itself
        # Installed per step (the model is shared with the strategies interleaved with this one), and kept
        # through backward: the checkpoints' recompute calls the blocks' (tiled) forwards again.
        with offload.long_context(model, engine=engine, tiled_loss=False, exclude_head=False):
            with engine:  # attached to model(...) calls; the step calls model.hidden_states
                h = model.hidden_states(env.tokens)  # (B, T, C): the head's input, never the logits
            loss = offload.linear_cross_entropy(h, model.output, env.targets, engine=engine)
            loss.backward()
        return loss.detach()

    return Prepared(step=step, engine=engine, hooks=engine)


@_strategy(
    "account_only",
    "control",
    "Control: our engine with min_offload_size beyond any tensor; accounting on, nothing moved.",
)
def account_only(env: BenchEnv) -> Prepared:
    return _engine_strategy(env, checkpoint_blocks=False, use_streams=True, min_offload_size=_NOTHING)


def _account_only_hooks(env: BenchEnv, native: bool) -> Prepared:
    if native:
        from offload import _native

        try:
            _native.load()  # builds it once (about 20 s), before the strategy's steps
        except _native.NativeUnavailable as e:  # no compiler or ninja here: not a defect of the strategy
            raise Skip(f"the native pack hook cannot be built here: {e}") from e
    return _engine_strategy(env, checkpoint_blocks=False, use_streams=True, min_offload_size=_NOTHING,
                            native_hooks=native)


@_strategy("account_only_python", "control",
           "account_only with the pack hook in Python (native_hooks=False), whatever the engine's default.")
def account_only_python(env: BenchEnv) -> Prepared:
    return _account_only_hooks(env, native=False)


@_strategy("account_only_native", "control",
           "account_only with the pack hook's keep path in C++ (native_hooks=True; skipped where it cannot build).")
def account_only_native(env: BenchEnv) -> Prepared:
    return _account_only_hooks(env, native=True)


# ---------------------------------------------------------------- peers


@_strategy("save_on_cpu", "peer", "Peer: torch.autograd.graph.save_on_cpu(pin_memory=True); synchronous, no prefetch.")
def save_on_cpu(env: BenchEnv) -> Prepared:
    # On a CPU-only torch, pin_memory=True still makes a fresh host copy (pinning itself is skipped),
    # so the copy path runs; pin_memory=False would return the tensor itself.
    ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)  # one instance, entered every step, like ours
    return Prepared(step=_plain_step(env, lambda: ctx, checkpoint_blocks=False), hooks=ctx)


def _peer_gpu_only(what: str) -> str:
    return f"{what} is a GPU-only peer (it asks for the CUDA default stream); n/a on CPU"


_COMPILE_GPU_ONLY = ("compile strategies run on GPU only: compile-time offloading moves accelerator tensors to "
                     "host, so on CPU there is nothing to move (and a cold compile costs ~20 s on 2 cores)")


def _gpu_only(env: BenchEnv, what: str) -> None:
    if env.on_cpu:
        raise Skip(_peer_gpu_only(what))


def _load_trl_offload() -> type:
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise Skip(
            "trl is not installed; `pip install --no-deps trl` provides trl/models/activation_offloading.py "
            "(loaded on its own; it needs torch, psutil, accelerate and transformers)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "activation_offloading.py"
    if not path.is_file():
        raise Skip(f"this trl has no {path}")
    file_spec = importlib.util.spec_from_file_location("_bench_trl_activation_offloading", path)
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:
        raise Skip(f"loading {path} failed: {type(e).__name__}: {e}") from e
    return module.OffloadActivations


@_strategy("trl", "peer", "Peer: TRL's OffloadActivations (torchtune's lineage, maintained), streams on.",
           gpu_only=_peer_gpu_only("TRL OffloadActivations"))
def trl(env: BenchEnv) -> Prepared:
    _gpu_only(env, "TRL OffloadActivations")
    cls = _load_trl_offload()
    ctx = cls(use_pin_memory=True, use_streams=True)
    return Prepared(step=_plain_step(env, lambda: ctx, checkpoint_blocks=False))


@_strategy("torchtune", "peer", "Peer: torchtune's OffloadActivations (unmaintained upstream), streams on.",
           gpu_only=_peer_gpu_only("torchtune OffloadActivations"))
def torchtune(env: BenchEnv) -> Prepared:
    _gpu_only(env, "torchtune OffloadActivations")
    if importlib.util.find_spec("torchtune") is None:
        raise Skip("torchtune is not installed")
    try:
        from torchtune.training._activation_offloading import OffloadActivations
    except Exception as e:  # its import chain pins torchdata and an old torchao path
        raise Skip(f"importing torchtune's OffloadActivations failed: {type(e).__name__}: {e}") from e
    ctx = OffloadActivations(use_pin_memory=True, use_streams=True)
    return Prepared(step=_plain_step(env, lambda: ctx, checkpoint_blocks=False))


def _mark_all_for_offload(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    # The partitioner offloads only marked nodes that end up saved for backward, are no views,
    # are contiguous and are no model outputs (torch/_functorch/_activation_offloading, can_offload).
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True
    return gm


def _compile_offload_patch() -> dict[str, Any]:
    cfg = torch._functorch.config
    missing = [k for k in ("enable_activation_offloading", "joint_custom_pass") if not hasattr(cfg, k)]
    if missing:
        raise Skip(f"torch {torch.__version__} has no torch._functorch.config.{'/'.join(missing)}")
    patch: dict[str, Any] = {"enable_activation_offloading": True, "joint_custom_pass": _mark_all_for_offload}
    for flag in ("activation_offload_separate_stream", "activation_offload_sink_wait", "activation_reload_prefetch"):
        if hasattr(cfg, flag):
            patch[flag] = True
    if hasattr(cfg, "enable_autograd_cache"):
        patch["enable_autograd_cache"] = False  # the partitioner (where offloading happens) must run
    return patch


def _compile_gpu_only(env: BenchEnv) -> None:
    if env.on_cpu:
        raise Skip(_COMPILE_GPU_ONLY)


def _compiled(env: BenchEnv, patch: dict[str, Any] | None) -> Prepared:
    _compile_gpu_only(env)
    import torch._dynamo

    torch._dynamo.reset()  # the other compiled strategy's graphs must not be reused
    compiled = torch.compile(env.model)
    model = env.model

    def step() -> torch.Tensor:
        model.checkpoint_blocks = False
        if patch is None:
            logits = compiled(env.tokens)
        else:
            with torch._functorch.config.patch(**patch):
                logits = compiled(env.tokens)
        return env.loss_backward(logits)

    return Prepared(step=step, isolated=True, close=torch._dynamo.reset)


@_strategy("compile", "peer", "Reference for compile_offload: torch.compile(model), nothing offloaded.",
           gpu_only=_COMPILE_GPU_ONLY)
def compile_(env: BenchEnv) -> Prepared:
    return _compiled(env, None)


@_strategy(
    "compile_offload",
    "peer",
    "Peer: PyTorch compile-time activation offloading (torch._functorch.config.enable_activation_offloading).",
    reference="compile",  # compiled kernels round differently from eager; offloading must not
    gpu_only=_COMPILE_GPU_ONLY,
)
def compile_offload(env: BenchEnv) -> Prepared:
    _compile_gpu_only(env)
    return _compiled(env, _compile_offload_patch())


BY_NAME_ONLY = ("offload_verify", "offload_part", "offload_part_bytes",
                *(f"offload_first{k}" for k in FIRST_BLOCKS_SWEEP), "account_only_python", "account_only_native",
                "long_context")
"""Run only when named (``--strategies``): a debugging mode, the partial offloads (the GPU run names them;
on the CPU main job's small model they add nothing to what ``offload`` shows), the account-only control with
its pack hook pinned to one implementation, and long_context (its measured point is ``--max-seq --model
hf_llama``'s)."""
DEFAULT_ORDER: tuple[str, ...] = tuple(n for n in STRATEGIES if n not in BY_NAME_ONLY)
"""All strategies but those of ``BY_NAME_ONLY`` (run by name: ``--strategies
none,offload,offload_verify``), ``none`` first (its step is the correctness reference; ``compile`` is
``compile_offload``'s and runs before it)."""
