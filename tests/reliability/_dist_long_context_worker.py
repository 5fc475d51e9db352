"""One rank of the FSDP2 + ``offload.long_context`` check (run as a script, one process per rank).

A tiny Hugging Face Llama, each decoder layer and the root ``fully_shard``-ed, trains two steps under
``offload.long_context`` (blocks checkpointed with offloaded inputs, tiled MLP, tiled labels= loss) next to
its plain sharded twin; the rank writes the losses, the largest gradient difference (full tensors,
relative to each gradient's largest entry) and the tiles' counts to ``<out>/long_context_rank<r>.json``.

    python tests/reliability/_dist_long_context_worker.py RANK WORLD INIT_METHOD OUT [mlps]

With ``mlps``, each layer's MLP is ``fully_shard``-ed on its own too (the tiled module is then an FSDP unit).
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run(rank: int, world: int, shard_mlps: bool) -> dict:
    import transformers

    import offload

    warnings.simplefilter("ignore")  # transformers' notices on the tiny config
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    base = transformers.LlamaForCausalLM(cfg).train()
    ref, tiled = copy.deepcopy(base), copy.deepcopy(base)
    for m in (ref, tiled):
        for layer in m.model.layers:
            if shard_mlps:
                fully_shard(layer.mlp, mesh=mesh)
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    handle = offload.long_context(tiled, mlp_tokens=16, loss_tokens=16, device="cpu", min_offload_size=0)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(10 + rank))
    losses: dict[str, list[float]] = {"plain": [], "long_context": []}
    worst = 0.0
    for _ in range(2):
        for name, m in (("plain", ref), ("long_context", tiled)):
            m.zero_grad()
            with handle.engine if m is tiled else torch.enable_grad():
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses[name].append(float(loss))
        for (n, p), (_, q) in zip(ref.named_parameters(), tiled.named_parameters()):
            a, b = _full(p.grad), _full(q.grad)
            worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)))
    return {"losses": losses, "worst_grad_rel": worst, "mlp": handle.mlp.stats(), "loss": handle.loss.stats(),
            "offloaded": handle.engine.ledger.summary()["offloaded_count"]}


def main() -> int:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    shard_mlps = sys.argv[5:] == ["mlps"]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = {"error": None, **run(rank, world, shard_mlps)}
    except Exception:
        result = {"error": traceback.format_exc()}
    (out / f"long_context_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
