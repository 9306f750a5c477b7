"""Turn metric values (Python, numpy or jax scalars, text, histograms) into plain Python values."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

from trackers.histogram import Histogram

PlainValue = int | float | bool | str | Histogram


class MetricValueError(TypeError):
    """A metric value that no tracker can record (an array, None, a dict...)."""


def plain_scalar(key: str, value: Any) -> int | float | bool:
    """A Python int, float or bool from a Python, numpy or jax scalar (or a one-element array)."""
    if isinstance(value, bool | int | float):
        return value
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        item = value.item()
        if isinstance(item, bool | int | float):
            return item
    shape = getattr(value, "shape", None)
    described = f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(value).__name__}"
    raise MetricValueError(
        f"Metric {key!r} is {described}, which is not a scalar. Log a number (a Python, numpy or jax "
        "scalar), a string, or a trackers.Histogram; summarize arrays with Histogram.from_values(...) "
        "or trackers.summarize_tree(...)."
    )


def _plain_list(values: Any) -> list[float]:
    as_list = values.tolist() if hasattr(values, "tolist") else list(values)
    return [float(v) for v in as_list]


def plain_histogram(key: str, histogram: Histogram) -> Histogram:
    """The same histogram with plain Python lists and numbers (host values of jax or numpy arrays)."""
    edges = _plain_list(histogram.edges)
    counts = _plain_list(histogram.counts)
    if len(edges) != len(counts) + 1:
        raise MetricValueError(
            f"Histogram {key!r} has {len(edges)} edges for {len(counts)} counts; it needs one edge more "
            "than counts (build it with Histogram.from_values or trackers.summarize_tree)."
        )
    return Histogram(
        edges=edges,
        counts=counts,
        min=float(plain_scalar(key, histogram.min)),
        max=float(plain_scalar(key, histogram.max)),
        num=float(plain_scalar(key, histogram.num)),
        sum=float(plain_scalar(key, histogram.sum)),
        sum_squares=float(plain_scalar(key, histogram.sum_squares)),
    )


def plain_value(key: str, value: Any) -> PlainValue:
    """A value any backend can write: a plain scalar, a string, or a Histogram of plain numbers."""
    if isinstance(value, str):
        return value
    if isinstance(value, Histogram):
        return plain_histogram(key, value)
    return plain_scalar(key, value)


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, PlainValue]:
    """Every value of a metrics mapping made plain; keys must be strings."""
    if not isinstance(metrics, Mapping):
        raise MetricValueError(
            f"Metrics must be a mapping of name to value, got a {type(metrics).__name__}: "
            "pass a dict such as {'train/loss': 2.5}."
        )
    plain: dict[str, PlainValue] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise MetricValueError(f"Metric names must be strings, got {key!r} ({type(key).__name__}).")
        plain[key] = plain_value(key, value)
    return plain


def plain_step(step: Any) -> int:
    """A non-negative Python int from a Python, numpy or jax integer."""
    try:
        as_int = operator.index(step)
    except TypeError:
        raise TypeError(
            f"step must be an integer (Python, numpy or jax), got {step!r} ({type(step).__name__})."
        ) from None
    if as_int < 0:
        raise ValueError(f"step must be >= 0, got {as_int}.")
    return as_int


def json_number(value: int | float | bool) -> int | float | bool | None:
    """A value strict JSON can hold: NaN and infinities become None (JSON null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def jsonable(value: Any) -> Any:
    """A strict-JSON copy of hyperparameters or a summary: nesting kept, scalars made plain."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, Histogram):  # before tuples: a Histogram is a NamedTuple
        return {k: jsonable(v) for k, v in plain_histogram("histogram", value)._asdict().items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str):
        return value
    try:
        return json_number(plain_scalar("value", value))
    except MetricValueError:
        return str(value)


def flatten_mapping(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with '/'-joined keys (for backends that show flat tables)."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_mapping(value, f"{name}/"))
        else:
            flat[name] = value
    return flat
