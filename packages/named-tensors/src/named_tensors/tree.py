"""Tree utilities over modules of NamedArrays: parameter counts, maps, partition and combine."""

__all__: list[str] = []
