import contextlib
import io
import re

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import named_tensors as nt
from named_tensors import BLOCK_OUTPUT, Axis, BlockSeq, NamedArray, Stacked

Batch = Axis("batch", 2)
Embed = Axis("embed", 3)
Mlp = Axis("mlp", 7)  # a size found in no other axis, so residual shapes reveal the block internals
Layers = Axis("layers", 5)


class Block(eqx.Module):
    """A residual two-matmul block with a plain-array gain, a non-array field and optional dropout."""

    w_in: NamedArray
    w_out: NamedArray
    gain: jax.Array
    activation: object = jnp.tanh  # a non-array, non-static field: Stacked must carry it through
    tag_hidden: bool = eqx.field(static=True, default=False)

    def __call__(self, x, *, key=None, layer_index=None, scale=1.0):
        h = nt.dot(x, self.w_in, axis=Embed)
        h = NamedArray(self.activation(h.array), h.axes)
        if self.tag_hidden:
            h = checkpoint_name(h, BLOCK_OUTPUT)
        if key is not None:
            keep = jax.random.bernoulli(key, 0.5, h.array.shape)
            h = NamedArray(jnp.where(keep, h.array * 2.0, 0.0), h.axes)
        out = nt.dot(h, self.w_out, axis=Mlp) * self.gain * scale
        if layer_index is not None:
            out = out / (layer_index.astype(jnp.float32) + 1.0)
        return x + out


class ScanBlock(Block):
    """The same block, also returning a per-layer output (like a KV cache entry)."""

    def __call__(self, x, *, key=None, layer_index=None, scale=1.0):
        y = super().__call__(x, key=key, layer_index=layer_index, scale=scale)
        return y, nt.sum(y, Embed)


def make_block(key, cls=Block, tag_hidden=False):
    k1, k2, k3 = jax.random.split(key, 3)
    return cls(
        nt.random.normal(k1, (Embed, Mlp)),
        nt.random.normal(k2, (Mlp, Embed)) * 0.5,
        jax.random.uniform(k3, ()) + 0.5,
        tag_hidden=tag_hidden,
    )


def reference_fold(blocks, x, key=None, scale=1.0, with_index=False):
    """An independent plain-jnp loop over per-layer raw parameters."""
    xr = x.permute(Batch, Embed).array
    keys = None if key is None else jax.random.split(key, len(blocks))
    outs = []
    for i, b in enumerate(blocks):
        h = jnp.tanh(xr @ b.w_in.permute(Embed, Mlp).array)
        if keys is not None:
            keep = jax.random.bernoulli(keys[i], 0.5, h.shape)
            h = jnp.where(keep, h * 2.0, 0.0)
        out = h @ b.w_out.permute(Mlp, Embed).array * b.gain * scale
        if with_index:
            out = out / (i + 1.0)
        xr = xr + out
        outs.append(xr.sum(axis=1))
    return xr, jnp.stack(outs)


@pytest.fixture(scope="module")
def x():
    return nt.random.normal(jax.random.key(1), (Batch, Embed))


@pytest.fixture(scope="module")
def stack():
    return Stacked.init(Layers, make_block, key=jax.random.key(0))


def test_init_vmaps_make_block_over_the_keys_of_each_layer(stack):
    assert stack.stacked.w_in.axes == (Layers, Embed, Mlp)
    assert stack.stacked.w_out.axes == (Layers, Mlp, Embed)
    assert stack.stacked.gain.shape == (Layers.size,)
    assert stack.stacked.activation is jnp.tanh
    keys = jax.random.split(jax.random.key(0), Layers.size)
    for i, k in enumerate(keys):
        expected = make_block(k)
        np.testing.assert_allclose(stack.stacked.w_in.array[i], expected.w_in.array, rtol=1e-6)
        np.testing.assert_allclose(stack.stacked.gain[i], expected.gain, rtol=1e-6)


def test_fold_matches_blockseq_and_a_plain_loop(stack, x):
    blocks = stack.blocks()
    layer_index = nt.arange(Layers)
    key = jax.random.key(7)
    got = stack(x, key=key, per_layer={"layer_index": layer_index}, scale=0.5)
    seq = stack.unstack()(x, key=key, per_layer={"layer_index": layer_index}, scale=0.5)
    ref, _ = reference_fold(blocks, x, key=key, scale=0.5, with_index=True)
    assert got.axes == (Batch, Embed)
    np.testing.assert_allclose(got.array, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(seq.array, ref, rtol=1e-5, atol=1e-6)


def test_dropout_keys_differ_per_layer_and_change_the_result(stack, x):
    without = stack(x)
    with_key = stack(x, key=jax.random.key(3))
    assert not np.allclose(without.array, with_key.array)
    ref, _ = reference_fold(stack.blocks(), x, key=jax.random.key(3))
    np.testing.assert_allclose(with_key.array, ref, rtol=1e-5, atol=1e-6)


def test_per_layer_inputs_may_carry_the_layers_axis_anywhere(stack, x):
    per_layer_scale = nt.broadcast_to(nt.arange(Layers), (Batch, Layers))  # layers second
    got = stack(x, per_layer={"layer_index": per_layer_scale})
    ref, _ = reference_fold(stack.blocks(), x, with_index=True)
    np.testing.assert_allclose(got.array, ref, rtol=1e-5, atol=1e-6)


def test_scan_returns_per_layer_outputs_along_layers(x):
    stack = Stacked.init(Layers, lambda k: make_block(k, ScanBlock), key=jax.random.key(0))
    final, outs = stack.scan(x)
    seq_final, seq_outs = stack.unstack().scan(x)
    ref_final, ref_outs = reference_fold(stack.blocks(), x)
    assert outs.axes == (Layers, Batch)
    assert seq_outs.axes == (Layers, Batch)
    np.testing.assert_allclose(final.array, ref_final, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs.array, ref_outs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(seq_outs.array, ref_outs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(seq_final.array, ref_final, rtol=1e-5, atol=1e-6)


GRAD_KEY = jax.random.key(5)
_reference_grads: dict[int, tuple] = {}


def reference_value_and_grads(n_layers, x):
    """Loss and per-block gradients of the plain-jnp loop (cached per depth: compiling is the slow part)."""
    if n_layers not in _reference_grads:
        blocks = Stacked.init(Layers.resize(n_layers), make_block, key=jax.random.key(0)).blocks()

        @eqx.filter_jit
        @eqx.filter_value_and_grad
        def loss(blocks, x):
            return jnp.sum(reference_fold(blocks, x, key=GRAD_KEY, with_index=True)[0] ** 2)

        _reference_grads[n_layers] = loss(blocks, x)
    return _reference_grads[n_layers]


@pytest.mark.parametrize(
    ("kind", "policy", "n_layers", "unroll"),
    [("stacked", p, 3, 1) for p in ("none", "full", "save_block_outputs")]
    + [("stacked", "nested", 1, 1), ("stacked", "nested", 7, 1)]
    + [("stacked", "none", 3, 2), ("stacked", "full", 3, True), ("stacked", "nested", 7, 2)]
    + [("blockseq", "none", 3, None), ("blockseq", "full", 3, None)],
)
def test_every_policy_gives_the_same_values_and_gradients(kind, policy, n_layers, unroll, x):
    L = Layers.resize(n_layers)
    if kind == "stacked":
        model = Stacked.init(L, make_block, key=jax.random.key(0), gradient_checkpointing=policy, unroll=unroll)
    else:
        model = BlockSeq.init(L, make_block, key=jax.random.key(0), gradient_checkpointing=policy)

    @eqx.filter_jit
    @eqx.filter_value_and_grad
    def loss(model, x):
        return nt.sum(nt.square(model(x, key=GRAD_KEY, per_layer={"layer_index": nt.arange(L)}))).scalar()

    value, grad = loss(model, x)
    ref_value, ref_grads = reference_value_and_grads(n_layers, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    grad_blocks = grad.blocks() if isinstance(grad, Stacked) else grad.blocks
    assert len(grad_blocks) == n_layers
    for g, g_ref in zip(grad_blocks, ref_grads, strict=True):
        np.testing.assert_allclose(g.w_in.array, g_ref.w_in.array, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g.w_out.array, g_ref.w_out.array, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(g.gain, g_ref.gain, rtol=1e-4, atol=1e-5)


def residual_shapes(fn, model, x):
    """Shapes of the values saved for the backward pass, read from jax's public report."""
    params, static = eqx.partition(model, eqx.is_array)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p, x: fn(eqx.combine(p, static), x), params, x)
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", out.getvalue())]


def hidden_residuals(policy, x, tag_hidden=False, n_layers=5):
    stack = Stacked.init(
        Layers.resize(n_layers),
        lambda k: make_block(k, tag_hidden=tag_hidden),
        key=jax.random.key(0),
        gradient_checkpointing=policy,
    )
    shapes = residual_shapes(lambda s, x: nt.sum(s(x)).scalar(), stack, x)
    return [s for s in shapes if Mlp.size in s and Batch.size in s]  # (.., batch, mlp) activations


def test_no_checkpointing_saves_the_block_internals(x):
    assert hidden_residuals("none", x)


def test_full_checkpointing_saves_no_block_internals(x):
    assert hidden_residuals("full", x, tag_hidden=True) == []


def test_save_block_outputs_keeps_exactly_the_tagged_values(x):
    assert hidden_residuals("save_block_outputs", x) == []
    assert hidden_residuals("save_block_outputs", x, tag_hidden=True) == [(Layers.size, Batch.size, Mlp.size)]


def test_nested_saves_no_block_internals_and_only_group_carries(x):
    assert hidden_residuals("nested", x, n_layers=9) == []
    carries = residual_shapes(
        lambda s, x: nt.sum(s(x)).scalar(),
        Stacked.init(Layers.resize(9), make_block, key=jax.random.key(0), gradient_checkpointing="nested"),
        x,
    )
    carry_like = [s for s in carries if s[-2:] == (Batch.size, Embed.size)]
    # 9 layers: 3 groups of 3; the outer scan keeps one carry per group, never one per layer.
    assert carry_like and all(s[:-2] in ((), (3,)) for s in carry_like)


def test_unstack_and_from_blocks_round_trip(stack, x):
    blocks = stack.blocks()
    assert len(blocks) == Layers.size
    assert blocks[2].w_in.axes == (Embed, Mlp)
    np.testing.assert_array_equal(blocks[2].w_in.array, stack.stacked.w_in.array[2])
    again = Stacked.from_blocks(Layers, blocks)
    assert again.stacked.w_in.axes == stack.stacked.w_in.axes
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stack), strict=True):
        np.testing.assert_array_equal(a, b)
    seq = stack.unstack()
    assert isinstance(seq, BlockSeq)
    restacked = seq.stack()
    np.testing.assert_array_equal(restacked(x).array, stack(x).array)
    # A partitioned stack (e.g. optimizer moments of some leaves only) unstacks too: its holes stay holes.
    kept, _ = eqx.partition(stack, lambda leaf: leaf is stack.stacked.w_in.array)
    parts = kept.unstack().blocks
    assert parts[2].w_in.axes == (Embed, Mlp) and parts[2].w_out.array is None
    np.testing.assert_array_equal(parts[2].w_in.array, stack.stacked.w_in.array[2])


def test_jit_of_a_stacked_model(stack, x):
    np.testing.assert_allclose(eqx.filter_jit(lambda m, x: m(x))(stack, x).array, stack(x).array, rtol=1e-6)


def test_with_gradient_checkpointing_keeps_the_parameters(stack):
    nested = stack.with_gradient_checkpointing("nested")
    assert nested.gradient_checkpointing == "nested" and stack.gradient_checkpointing == "none"
    assert nested.stacked is stack.stacked
    assert stack.unstack().with_gradient_checkpointing("full").gradient_checkpointing == "full"
    with pytest.raises(ValueError, match="Unknown gradient_checkpointing policy 'half'"):
        stack.with_gradient_checkpointing("half")


def scan_unrolls(stack, x):
    """The `unroll` of every scan in the traced program of a call, read from its jaxpr."""
    params, static = eqx.partition(stack, eqx.is_array)
    jaxpr = jax.make_jaxpr(lambda p, x: eqx.combine(p, static)(x))(params, x)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                yield eqn.params["unroll"]
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jaxpr.jaxpr))


def test_unroll_reaches_the_scan_and_keeps_the_parameters(stack, x):
    assert scan_unrolls(stack, x) == [1]
    unrolled = stack.with_unroll(True)
    assert unrolled.stacked is stack.stacked and unrolled.unroll is True and stack.unroll == 1
    assert scan_unrolls(unrolled, x) == [Layers.size]  # jax spells "all of them" as the scan's length
    assert scan_unrolls(stack.with_unroll(2), x) == [2]
    np.testing.assert_allclose(unrolled(x).array, stack(x).array, rtol=1e-6)
    # "nested" unrolls the layers within each group (5 layers: a group of 3 and a tail of 2), not the groups.
    nested = stack.with_gradient_checkpointing("nested").with_unroll(2)
    assert sorted(scan_unrolls(nested, x)) == [1, 2, 2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None])
def test_bad_unroll_is_a_clear_error(stack, bad):
    with pytest.raises(ValueError, match="unroll must be a positive number of layers per scan step"):
        stack.with_unroll(bad)
    with pytest.raises(ValueError, match="unroll must be a positive number"):
        Stacked.init(Layers, make_block, key=jax.random.key(0), unroll=bad)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown gradient_checkpointing policy 'sometimes'"):
        Stacked.init(Layers, make_block, key=jax.random.key(0), gradient_checkpointing="sometimes")
    with pytest.raises(ValueError, match="Unknown gradient_checkpointing policy"):
        BlockSeq.init(Layers, make_block, key=jax.random.key(0), gradient_checkpointing="all")


def test_from_blocks_errors_name_the_problem(stack):
    blocks = list(stack.blocks())
    with pytest.raises(ValueError, match="Got 4 blocks for Axis\\('layers', 5\\)"):
        Stacked.from_blocks(Layers, blocks[:4])
    odd = eqx.tree_at(lambda b: b.w_in, blocks[1], nt.random.normal(jax.random.key(0), (Embed, Mlp.resize(2))))
    with pytest.raises(ValueError, match="Block 1 has a parameter"):
        Stacked.from_blocks(Layers, [blocks[0], odd, *blocks[2:]])
    other_fn = eqx.tree_at(lambda b: b.activation, blocks[3], jnp.sin)
    with pytest.raises(ValueError, match="Block 3 has the non-array field value"):
        Stacked.from_blocks(Layers, [*blocks[:3], other_fn, blocks[4]])


def test_layers_axis_errors():
    with pytest.raises(TypeError, match="Layers must be an Axis"):
        Stacked.init("layers", make_block, key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs at least one layer"):
        BlockSeq.init(Layers.resize(0), make_block, key=jax.random.key(0))
    with pytest.raises(ValueError, match="Got 1 blocks for Axis"):
        BlockSeq((make_block(jax.random.key(0)),), Layers)


def test_from_blocks_refuses_blocks_of_other_structure_or_shapes(stack):
    blocks = list(stack.blocks())
    with pytest.raises(ValueError, match="Block 1 differs in structure from block 0"):
        Stacked.from_blocks(Layers.resize(2), [blocks[0], Shrink(nt.ones(Embed))])
    longer_gain = eqx.tree_at(lambda b: b.gain, blocks[1], jnp.ones(2))
    with pytest.raises(ValueError, match=r"Block 1 has an array of shape \(2,\) where block 0 has \(\)"):
        Stacked.from_blocks(Layers.resize(2), [blocks[0], longer_gain])


def test_per_layer_errors(stack, x):
    with pytest.raises(ValueError, match="per_layer: every NamedArray must have the 'layers' axis"):
        stack(x, per_layer={"layer_index": nt.arange(Batch)})
    with pytest.raises(ValueError, match="'layers' has size 3"):
        stack(x, per_layer={"layer_index": nt.arange(Layers.resize(3))})
    with pytest.raises(ValueError, match="leading dimension of 5"):
        stack(x, per_layer={"layer_index": jnp.arange(3)})
    with pytest.raises(ValueError, match=r"\['scale'\] are given both per layer and for all layers"):
        stack(x, scale=1.0, per_layer={"scale": jnp.ones(5)})
    with pytest.raises(ValueError, match=r"\['key'\] are given both per layer.*split per layer from key="):
        stack(x, per_layer={"key": jax.random.split(jax.random.key(0), 5)})


class Shrink(eqx.Module):
    w: NamedArray

    def __call__(self, x, *, key=None):
        return nt.sum(x * self.w, Embed)


def test_block_must_keep_the_carry_shape(x):
    stack = Stacked.init(Layers, lambda k: Shrink(nt.random.normal(k, (Embed,))), key=jax.random.key(0))
    with pytest.raises(TypeError, match="same structure and axes"):
        stack(x)


def test_scan_needs_blocks_that_return_pairs(stack, x):
    with pytest.raises(TypeError, match=r"return \(carry, per_layer_output\)"):
        stack.scan(x)


def test_layer_index_out_of_range(stack):
    with pytest.raises(IndexError, match="Layer 5 out of range"):
        stack.layer(5)
