"""offload.predict: what a training step would need on a GPU this machine does not have.

The user's real step runs through the real engine on fake tensors (shapes only), and the
result is replayed against a named GPU spec. Everything here is a prediction, labelled as one,
with the spec it assumed (DESIGN.md, "Prediction").
"""

from ._errors import PredictError
from ._cost import HostCost
from ._predict import LongestContext, Prediction, max_context, predict_step
from ._stalls import Stall
from ._strategies import STRATEGIES
from ._timeline import TimelineResult, simulate
from .gpus import GPUS, GPUSpec, resolve_gpu

__all__ = [
    # predicting a step
    "predict_step", "max_context", "LongestContext", "Prediction", "PredictError", "STRATEGIES",
    # GPU specs
    "GPUS", "GPUSpec", "resolve_gpu",
    # the predicted timeline of a trace
    "simulate", "TimelineResult", "Stall", "HostCost",
]
