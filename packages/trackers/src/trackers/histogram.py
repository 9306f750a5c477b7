"""A histogram metric value that every backend understands."""

from __future__ import annotations

from typing import Any, NamedTuple


class Histogram(NamedTuple):
    """Bucket edges and counts of a set of values, with the moments TensorBoard shows.

    A NamedTuple so that jax treats it as a pytree: it can be built inside jit and passed to `jit_log`.
    `edges` has one more entry than `counts`.
    """

    edges: Any
    counts: Any
    min: Any
    max: Any
    num: Any
    sum: Any
    sum_squares: Any

    @classmethod
    def from_values(cls, values: Any, bins: int = 32) -> Histogram:
        """Histogram of an array-like of numbers, computed on the host with numpy."""
        import numpy as np

        flat = np.asarray(values, dtype=np.float64).reshape(-1)
        if flat.size == 0:
            raise ValueError("Histogram.from_values needs at least one value; got an empty array.")
        counts, edges = np.histogram(flat, bins=bins)
        return cls(
            edges=edges.tolist(),
            counts=counts.tolist(),
            min=float(flat.min()),
            max=float(flat.max()),
            num=int(flat.size),
            sum=float(flat.sum()),
            sum_squares=float(np.dot(flat, flat)),
        )
