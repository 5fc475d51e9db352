"""The shared toy Llama for the integration tests of the planner callbacks."""

from bench.model import ToyLlama, ToyLlamaConfig

__all__ = ["ToyLlama", "ToyLlamaConfig"]
