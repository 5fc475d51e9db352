"""Re-export: ``SpanSet`` lives in ``offload._spans`` (the engine's ledger counts unique bytes with it too)."""

from offload._spans import SpanSet

__all__ = ["SpanSet"]
