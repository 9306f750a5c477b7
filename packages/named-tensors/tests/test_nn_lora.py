"""LoRA against plain jax.numpy: the forward, merging, zero-initialised B, gradients, targets, sharding, dropout."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import Linear, LoraConfig, LoraLinear

Batch, Pos, Embed = Axis("batch", 2), Axis("position", 3), Axis("embed", 8)
Heads, HeadSize, Mlp, Layers = Axis("heads", 2), Axis("head_size", 3), Axis("mlp", 5), Axis("layers", 3)


class Block(eqx.Module):
    """A toy block with linears named like a transformer's."""

    q_proj: Linear
    v_proj: Linear
    up: Linear

    @staticmethod
    def init(key):
        kq, kv, ku = jax.random.split(key, 3)
        return Block(
            Linear.init(Embed, (Heads, HeadSize), key=kq),
            Linear.init(Embed, (Heads, HeadSize), key=kv, use_bias=False),
            Linear.init(Embed, Mlp, key=ku),
        )

    def __call__(self, x, *, key=None):
        q, v = self.q_proj(x), self.v_proj(x)
        mixed = nt.dot(q, v, axis=HeadSize) + nt.sum(self.up(x), Mlp)
        return x + nt.broadcast_to(nt.sum(mixed, Heads), x.axes) * 0.1


class Model(eqx.Module):
    blocks: nt.Stacked
    head: Linear

    def __call__(self, x):
        return self.head(self.blocks(x))


@eqx.filter_jit
def run(model, x):
    return model(x)


def make_model(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    blocks = nt.Stacked.init(Layers, Block.init, key=k1)
    return Model(blocks, Linear.init(Embed, Axis("out", 4), key=k2))


def x_input(seed=1):
    return nt.random.normal(jax.random.key(seed), (Batch, Pos, Embed))


def randomise_b(model, seed=2):
    """Non-zero B matrices, so that the adapters change the output."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def fill(path, leaf):
        if path.endswith("lora_b"):
            return NamedArray(jax.random.normal(next(keys), leaf.array.shape) * 0.3, leaf.axes)
        return leaf

    return jax.tree_util.tree_map_with_path(lambda p, x: fill(nt.path_str(p), x), model, is_leaf=nt.is_named)


def test_forward_is_w_x_plus_scaled_b_a_x():
    linear = Linear.init(Embed, (Heads, HeadSize), key=jax.random.key(0))
    config = LoraConfig(r=4, alpha=6.0, target_modules=r".*")
    lora = randomise_b(nt.nn.apply_lora(linear, config, key=jax.random.key(1)))
    assert isinstance(lora, LoraLinear) and lora.lora_a.axis_names == ("lora_rank", "embed")
    assert lora.lora_b.axis_names == ("heads", "head_size", "lora_rank")
    x = x_input()
    w = linear.weight.array  # (heads, head_size, embed)
    a, b = lora.lora_a.array, lora.lora_b.array
    expected = (
        jnp.einsum("bpe,hse->bphs", x.array, w)
        + linear.bias.array[None, None]
        + (6.0 / 4) * jnp.einsum("hsr,bpr->bphs", b, jnp.einsum("re,bpe->bpr", a, x.array))
    )
    out = nt.permute(lora(x), ("batch", "position", "heads", "head_size"))
    np.testing.assert_allclose(out.array, expected, atol=1e-5, rtol=1e-5)
    bound = 1 / np.sqrt(Embed.size)
    assert float(jnp.abs(a).max()) <= bound and float(jnp.abs(a).max()) > 0.5 * bound


def test_zero_b_is_the_base_model_and_merge_matches():
    model = make_model()
    config = LoraConfig(r=2, alpha=4.0, target_modules=["q_proj", "up"])
    lora = nt.nn.apply_lora(model, config, key=jax.random.key(3))
    assert nt.nn.lora_paths(lora) == ["blocks.stacked.q_proj", "blocks.stacked.up"]
    x = x_input()
    np.testing.assert_array_equal(run(lora, x).array, run(model, x).array)  # B starts at zero: exactly the base model
    trained = randomise_b(lora)
    out = run(trained, x)
    assert float(jnp.abs(out.array - run(model, x).array).max()) > 1e-3
    merged = nt.nn.merge_lora(trained)
    assert nt.nn.lora_paths(merged) == [] and isinstance(merged.blocks.stacked.q_proj, Linear)
    np.testing.assert_allclose(run(merged, x).array, out.array, atol=1e-5, rtol=1e-5)
    # Stacked adapters lead with the layers axis, so each layer has its own.
    a = trained.blocks.stacked.q_proj.lora_a
    assert a.axis_names == ("layers", "lora_rank", "embed")
    assert not np.allclose(a.array[0], a.array[1])


def test_gradients_reach_only_the_adapters():
    lora = nt.nn.apply_lora(make_model(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), key=jax.random.key(4))
    adapters, frozen = nt.partition(lora, nt.nn.lora_params)
    assert nt.count_parameters(lora, nt.nn.lora_params) == 2 * Layers.size * (2 * 8 + 6 * 2)
    x = x_input()

    def loss(adapters, frozen):
        return nt.sum(nt.combine(adapters, frozen)(x) ** 2).array

    grads = jax.jit(jax.grad(loss))(adapters, frozen)
    b_grads = [g for p, g in _leaves(grads) if p.endswith("lora_b")]
    a_grads = [g for p, g in _leaves(grads) if p.endswith("lora_a")]
    assert len(b_grads) == len(a_grads) == 2
    assert all(float(jnp.abs(g.array).max()) > 0 for g in b_grads)
    assert all(float(jnp.abs(g.array).max()) == 0 for g in a_grads)  # B = 0 blocks A's gradient at first
    optimizer = optax.sgd(1e-2)
    state = optimizer.init(eqx.filter(adapters, eqx.is_array))
    updates, _ = optimizer.update(grads, state)
    stepped = nt.combine(eqx.apply_updates(adapters, updates), frozen)
    for (p, before), (_, after) in zip(_leaves(lora), _leaves(stepped), strict=True):
        changed = not np.array_equal(before.array, after.array)
        assert changed == p.endswith("lora_b"), p  # the base weights do not move


def _leaves(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=nt.is_named)
    return [(nt.path_str(p), x) for p, x in flat if isinstance(x, NamedArray)]


def test_targets_by_suffix_regex_and_clear_errors():
    model = make_model()
    assert nt.nn.select_targets(model, ["stacked.v_proj"]) == ["blocks.stacked.v_proj"]
    assert nt.nn.select_targets(model, r"blocks\..*_proj") == ["blocks.stacked.q_proj", "blocks.stacked.v_proj"]
    assert nt.nn.select_targets(model, ["head"]) == ["head"]
    with pytest.raises(ValueError, match=r"\['k_proj'\] match no Linear layer.*'blocks.stacked.q_proj'"):
        nt.nn.apply_lora(model, LoraConfig(target_modules=["q_proj", "k_proj"]), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"lora\.r must be a positive integer"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora = nt.nn.apply_lora(model, LoraConfig(target_modules=["head"]), key=jax.random.key(0))
        nt.nn.apply_lora(lora, LoraConfig(target_modules=["head"]), key=jax.random.key(0))


def test_adapters_shard_by_axis_name():
    lora = nt.nn.apply_lora(make_model(), LoraConfig(r=2, target_modules=["q_proj"]), key=jax.random.key(0))
    mesh = nt.make_mesh({"data": 4, "model": 2})
    specs = nt.infer_sharding(lora, {"embed": "data", "heads": "model"}, mesh)
    q = specs.blocks.stacked.q_proj
    assert q.lora_a.array.spec == jax.sharding.PartitionSpec(None, None, "data")  # layers, lora_rank, embed
    assert q.lora_b.array.spec == jax.sharding.PartitionSpec(None, "model", None, None)  # ..., rank
    assert q.base.weight.array.spec == jax.sharding.PartitionSpec(None, "model", None, "data")


def test_dropout_needs_a_key_and_is_reproducible():
    config = LoraConfig(r=2, dropout=0.5, target_modules=["q_proj"])
    lora = randomise_b(nt.nn.apply_lora(make_model(), config, key=jax.random.key(0)))
    x = x_input()
    plain = run(lora, x)
    keyed = nt.nn.with_lora_dropout_keys(lora, jax.random.key(9))
    assert keyed.blocks.stacked.q_proj.dropout_key.shape == (Layers.size,)  # one key per stacked layer
    first, again = run(keyed, x), run(keyed, x)
    np.testing.assert_allclose(first.array, again.array, atol=1e-6)
    assert float(jnp.abs(first.array - plain.array).max()) > 1e-4
    cleared = nt.nn.with_lora_dropout_keys(keyed, None)
    np.testing.assert_array_equal(run(cleared, x).array, plain.array)
