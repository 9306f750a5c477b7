"""Behaviour every model family shares: causality, scan == unrolled, sharded == unsharded, remat, training."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 64)

TINY = {
    "gpt2": lambda **kw: lm.Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, **kw),
    "llama": lambda **kw: lm.LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, **kw
    ),
    "mpt": lambda **kw: lm.MptConfig(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, clip_qkv=2.0, **kw),
    "backpack": lambda **kw: lm.BackpackConfig(
        seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, num_senses=4, sense_intermediate_scale=2, **kw
    ),
}
FAMILIES = sorted(TINY)


@pytest.mark.parametrize("family", FAMILIES)
def test_changing_a_token_changes_no_earlier_logit(family, ids_of):
    model = TINY[family]().build(VOCAB, key=jax.random.key(0))
    ids = ids_of(1)
    t = 9
    changed = nt.named(ids.array.at[:, t].set((ids.array[:, t] + 1) % VOCAB.size), ids.axes)
    both = nt.stack("pair", [ids, changed])
    logits = np.asarray(jax.jit(lambda m, x: m(x).array)(model, both))
    assert logits.shape == (2, 2, 16, VOCAB.size)
    np.testing.assert_array_equal(logits[0, :, :t], logits[1, :, :t])
    assert np.abs(logits[0, :, t:] - logits[1, :, t:]).max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_scanned_layers_equal_unrolled_layers(family, ids_of):
    config = TINY[family]()
    scanned = config.build(VOCAB, key=jax.random.key(3))
    unrolled = dataclasses.replace(config, scan_layers=False).build(VOCAB, key=jax.random.key(3))
    assert isinstance(scanned.blocks, nt.Stacked) and isinstance(unrolled.blocks, nt.BlockSeq)
    ids = ids_of(2)
    np.testing.assert_allclose(scanned(ids).array, unrolled(ids).array, atol=1e-6, rtol=0)
    # The converters give the other layout with the same weights.
    np.testing.assert_allclose(lm.unstack_layers(scanned)(ids).array, unrolled(ids).array, atol=1e-6, rtol=0)
    restacked = lm.stack_layers(unrolled)
    assert restacked.config.scan_layers and isinstance(restacked.blocks, nt.Stacked)
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_unrolled_scan_keeps_the_weights_and_the_outputs(family, ids_of):
    config = TINY[family]()
    scanned = config.build(VOCAB, key=jax.random.key(3))
    unrolled_scan = dataclasses.replace(config, scan_unroll=True).build(VOCAB, key=jax.random.key(3))
    assert isinstance(unrolled_scan.blocks, nt.Stacked) and unrolled_scan.blocks.unroll is True
    for a, b in zip(jax.tree.leaves(unrolled_scan), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_array_equal(a, b)
    ids = ids_of(2)
    loss = jax.jit(jax.value_and_grad(lambda m, x: lm.next_token_loss(m, x).scalar()))
    (value, grads), (ref_value, ref_grads) = loss(unrolled_scan, ids), loss(scanned, ids)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6)
    # Restacking per-layer blocks follows the config's unroll.
    per_layer = dataclasses.replace(config, scan_layers=False, scan_unroll=2).build(VOCAB, key=jax.random.key(3))
    assert lm.stack_layers(per_layer).blocks.unroll == 2


PARAMETER_MAPPING = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}
COMPUTE_MAPPING = {"batch": "data", "mlp": "model", "heads": "model", "kv_heads": "model"}


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_and_tensor_parallel_sharding_gives_the_same_logits(family, ids_of):
    model = TINY[family]().build(VOCAB, key=jax.random.key(4))
    ids = ids_of(3, batch=4)
    expected = np.asarray(model(ids).array)
    mesh = nt.make_mesh({"data": 4, "model": 2})
    sharded_model = nt.shard_tree(model, PARAMETER_MAPPING, mesh)
    embeddings = jax.tree.leaves(sharded_model)[0]
    assert embeddings.sharding.spec == jax.sharding.PartitionSpec(None, "data"), "(vocab, embed): embed on data"
    up_weight = next(
        leaf
        for leaf in jax.tree.leaves(sharded_model.blocks, is_leaf=nt.is_named)
        if isinstance(leaf, nt.NamedArray) and leaf.axis_names == ("layers", "mlp", "embed")
    )
    assert up_weight.array.sharding.spec == jax.sharding.PartitionSpec(None, "model", "data")
    with nt.axis_mapping(COMPUTE_MAPPING, mesh=mesh):
        sharded_ids = nt.shard_tree(ids)
        logits = jax.jit(lambda m, x: nt.shard(m(x)))(sharded_model, sharded_ids)
    assert logits.array.sharding.spec[0] == "data"
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_jit_grad_works_and_agrees_under_every_checkpointing_policy(family, ids_of):
    ids = ids_of(4)
    grads = {}
    built = TINY[family]().build(VOCAB, key=jax.random.key(5))
    for policy in nt.CHECKPOINT_POLICIES:
        model = lm.with_gradient_checkpointing(built, policy)
        assert model.blocks.gradient_checkpointing == policy
        loss_fn = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x: lm.next_token_loss(m, x).array))
        loss, grad = loss_fn(model, ids)
        assert np.isfinite(loss)
        grads[policy] = grad
    reference = jax.tree.leaves(grads["none"])
    for policy, grad in grads.items():
        for a, b in zip(jax.tree.leaves(grad), reference, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5, err_msg=f"policy {policy!r}")


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_falls_on_a_repeated_sequence(family):
    model = TINY[family]().build(VOCAB, key=jax.random.key(6))
    pattern = jnp.tile(jnp.arange(4, dtype=jnp.int32) * 7, 4)
    ids = nt.named(jnp.stack([pattern, pattern]), ("batch", "position"))
    optimizer = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, ids):
        def loss_of(p):
            return lm.next_token_loss(eqx.combine(p, static), ids).array

        loss, grad = jax.value_and_grad(loss_of)(params)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 step count with floats
            updates, opt_state = optimizer.update(grad, opt_state)
            return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state, ids)
        losses.append(float(loss))
    assert losses[0] > 3.0  # about log(64) at initialisation
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    ("family", "embeddings"),
    [("gpt2", "token_embeddings"), ("mpt", "wte"), ("backpack", "transformer.token_embeddings")],
)
def test_the_tied_families_share_one_head_over_their_token_embeddings(family, embeddings, ids_of):
    model = TINY[family]().build(VOCAB, key=jax.random.key(5))
    assert isinstance(model, lm.TiedHeadModel)
    table = model
    for name in embeddings.split("."):
        table = getattr(table, name)
    assert model.unembedding() is table.weight
    ids = ids_of(6)
    hidden, _ = model.activations(ids)
    expected = jnp.einsum("bpe,ve->bpv", nt.permute(hidden, ("batch", "position", "embed")).array, table.weight.array)
    np.testing.assert_allclose(np.asarray(model(ids).array), np.asarray(expected), atol=1e-5, rtol=1e-5)
