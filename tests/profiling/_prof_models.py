"""Small models with hand-computable saved-tensor bytes, shared by the profiling tests."""

from __future__ import annotations

import torch
from torch import nn


F32 = 4


class MLP(nn.Sequential):
    """Linear(8,16) -> ReLU -> Linear(16,4), no bias; input (2, 8) that does not require grad.

    Saved per forward (float32):
      0 (Linear): x                         2*8*4  =  64 B   (grad of W0 only needs x)
      1 (ReLU):   its output r              2*16*4 = 128 B
      2 (Linear): r again (same storage)    128 B logical, 0 new unique
                  W2.t() (a Parameter view) 16*4*4 = 256 B, static
    => logical 320, unique 192, static 256, packed 576.
    """

    LOGICAL = 64 + 128 + 128
    UNIQUE = 64 + 128
    STATIC = 16 * 4 * F32
    PER_MODULE_LOGICAL = {"MLP.0": 64, "MLP.1": 128, "MLP.2": 128}
    PER_MODULE_UNIQUE = {"MLP.0": 64, "MLP.1": 128, "MLP.2": 0}

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 4, bias=False))

    @staticmethod
    def batch() -> torch.Tensor:
        return torch.randn(2, 8)
