"""Scan over layers: Stacked and BlockSeq, with gradient checkpointing policies."""

__all__: list[str] = []
