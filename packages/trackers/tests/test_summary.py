"""summarize_tree against numpy: norms, largest magnitudes and histograms per leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import trackers


class _NamedLike:
    """Stands for a named_tensors.NamedArray leaf: data in `.array`, names in `.axes`."""

    def __init__(self, array, axes):
        self.array = array
        self.axes = axes


def test_matches_numpy_per_leaf_and_in_total():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 4)).astype(np.float32)
    b = rng.normal(size=(4,)).astype(np.float32)
    tree = {"layer": {"w": jnp.asarray(w), "b": jnp.asarray(b)}, "count": jnp.asarray(3)}

    summary = trackers.summarize_tree(tree, "grad", bins=None)

    assert set(summary) == {
        "grad/norm/total",
        "grad/norm/layer/w",
        "grad/norm/layer/b",
        "grad/max/layer/w",
        "grad/max/layer/b",
    }
    assert float(summary["grad/norm/layer/w"]) == pytest.approx(np.linalg.norm(w), rel=1e-6)
    assert float(summary["grad/max/layer/b"]) == pytest.approx(np.abs(b).max())
    total = np.sqrt(np.sum(w.astype(np.float64) ** 2) + np.sum(b.astype(np.float64) ** 2))
    assert float(summary["grad/norm/total"]) == pytest.approx(total, rel=1e-6)


def test_histogram_matches_numpy_inside_jit():
    values = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, -9.0], dtype=np.float32)
    summary = jax.jit(lambda t: trackers.summarize_tree(t, "params", bins=5))([jnp.asarray(values)])
    histogram = summary["params/hist/0"]
    # 5 bins over [-9, 9]: no value sits on an inner edge, where float32 and float64 rounding could differ
    counts, edges = np.histogram(values, bins=5)
    assert isinstance(histogram, trackers.Histogram)
    assert np.asarray(histogram.counts).tolist() == counts.tolist()
    assert np.asarray(histogram.edges) == pytest.approx(edges)
    assert float(histogram.num) == values.size
    assert float(histogram.sum_squares) == pytest.approx(float(np.dot(values, values)))
    assert (float(histogram.min), float(histogram.max)) == (-9.0, 9.0)


def test_named_array_leaves_and_low_precision():
    tree = {"embed": _NamedLike(jnp.ones((2, 3), dtype=jnp.bfloat16), ("vocab", "embed"))}
    summary = trackers.summarize_tree(tree, "params", bins=2)
    assert float(summary["params/norm/embed"]) == pytest.approx(np.sqrt(6.0))
    assert summary["params/norm/embed"].dtype == jnp.float32
    # all values equal: the histogram still has a range, as numpy's does
    assert np.asarray(summary["params/hist/embed"].counts).sum() == 6


class _Axis:
    def __init__(self, name, size):
        self.name, self.size = name, size


def test_split_axis_reports_each_layer_of_a_stack_and_per_leaf_can_be_off():
    rng = np.random.default_rng(1)
    stacked = rng.normal(size=(4, 3, 2)).astype(np.float32)  # (embed, layers, mlp): the layer axis is not first
    bias = rng.normal(size=(2,)).astype(np.float32)
    leaf = _NamedLike(jnp.asarray(stacked), (_Axis("embed", 4), _Axis("layers", 3), _Axis("mlp", 2)))
    tree = {"w": leaf, "b": jnp.asarray(bias)}

    summary = trackers.summarize_tree(tree, "grads", bins=4, split_axis="layers")
    for i in range(3):
        np.testing.assert_allclose(
            float(summary[f"grads/norm/w/layer_{i}"]), np.linalg.norm(stacked[:, i, :]), rtol=1e-6
        )
        assert int(np.sum(np.asarray(summary[f"grads/hist/w/layer_{i}"].counts))) == 8
    assert "grads/norm/w" not in summary and "grads/norm/b" in summary
    total = np.sqrt(np.sum(stacked.astype(np.float64) ** 2) + np.sum(bias.astype(np.float64) ** 2))
    np.testing.assert_allclose(float(summary["grads/norm/total"]), total, rtol=1e-6)

    only_total = trackers.summarize_tree(tree, "grads", bins=None, per_leaf=False, split_axis="layers")
    assert set(only_total) == {"grads/norm/total"}
    np.testing.assert_allclose(float(only_total["grads/norm/total"]), total, rtol=1e-6)
