"""vmap, scan and fold over a named axis."""

__all__: list[str] = []
