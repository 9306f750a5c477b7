"""Indexing and slicing by axis name, and ordering ops (take, pad, roll, sort, top_k, cumsum)."""

__all__: list[str] = []
