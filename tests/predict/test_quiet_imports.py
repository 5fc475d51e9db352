"""A prediction's output has no third-party import noise: building a Hugging Face model (whose first import
brings torchao through transformers' quantizers) and a peft model inside predict_step, as the bench's presets
do, prints nothing from torchao, torch's pytree deprecations or deprecation warnings (issue 45 item 5). (An
import the caller makes before the prediction prints what it prints before the prediction starts.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import torch
from offload.predict import predict_step

def model_fn():  # the imports inside, as the bench's presets build their models
    import peft, transformers
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

def step_fn(model):
    tokens = torch.randint(0, 128, (1, 16))
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss

p = predict_step(model_fn, step_fn, gpu="h100-sxm", strategy="offload")
print("PEAK", p.peak_bytes)
"""


def test_a_fresh_prediction_prints_no_third_party_import_noise():
    """In a fresh process (imports happen inside the prediction), stderr holds none of torchao's "Failed to
    load", torch's pytree warnings or FutureWarning / DeprecationWarning lines."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PEAK" in out.stdout
    for noise in ("Failed to load", "torchao", "_pytree", "FutureWarning", "DeprecationWarning"):
        assert noise not in out.stderr, out.stderr[-2000:]
