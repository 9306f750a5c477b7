"""Random arrays over named axes, from explicit keys."""

__all__: list[str] = []
