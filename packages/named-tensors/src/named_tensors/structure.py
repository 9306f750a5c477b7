"""Changing axes: einsum, rearrange, flatten and unflatten, split, concatenate, stack."""

__all__: list[str] = []
