"""Qwen3-MoE beyond the HF parity tests: dense and sparse layers mixed, their auxiliary losses, FLOPs, training,
YAML and config errors; gpt-oss's and Llama 4's YAML defaults and config errors, and Llama 4's scanned NoPE layers."""

import dataclasses

import draccus
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 41)
BASE = dict(seq_len=16, hidden_dim=24, intermediate_dim=20, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
# Layers 1 and 3 sparse (decoder_sparse_step 2), but 3 dense too (mlp_only_layers): only layer 1 routes.
MIXED = lm.Qwen3MoeConfig(
    **BASE, moe_intermediate_dim=6, n_routed_experts=5, num_experts_per_tok=3, decoder_sparse_step=2,
    mlp_only_layers=(3,), norm_topk_prob=False, lbl_coef=0.1, rzl_coef=0.01, scan_layers=False,
)  # fmt: skip


def test_mixed_layers_hold_their_own_mlps_and_average_the_aux_losses_over_the_sparse_layers(ids_of):
    assert MIXED.dense_layers() == (0, 2, 3)
    model = MIXED.build(VOCAB, key=jax.random.key(0))
    assert isinstance(model.blocks, nt.BlockSeq)
    kinds = [type(b.mlp).__name__ for b in model.blocks.blocks]
    assert kinds == ["GatedMLP", "MixtureOfExperts", "GatedMLP", "GatedMLP"]
    assert model.blocks.blocks[0].mlp.gate.weight.axes[0] == Axis("mlp", 20)
    assert model.blocks.blocks[1].mlp.experts.gate.axes[1:] == (Axis("mlp", 6), Axis("embed", 24))
    assert not model.blocks.blocks[1].mlp.normalize_weights
    ids = ids_of(1, vocab=VOCAB.size)
    _, aux = eqx.filter_jit(lambda m, x: m.activations_and_aux(x, router_load=True))(model, ids)
    load = np.asarray(aux.pop(nt.nn.ROUTER_LOAD))
    # Without router_load, the aux dict is the losses alone, as before.
    _, plain = eqx.filter_eval_shape(lambda m, x: m.activations_and_aux(x), model, ids)
    assert set(plain) == {"router_aux_loss", "router_z_loss"}

    # The one sparse layer's own losses, from its input: the aux losses are its, not diluted by the dense layers.
    def layer1_input(m, x):
        h = m.embed_tokens.embed(x)
        positions = nt.arange(x.resolve_axis("position"), dtype=jnp.int32)
        h, _ = m.blocks.blocks[0](h, None, positions, key=None, inference=True, cache_offset=0)
        normed = m.blocks.blocks[1].pre_mlp_norm(_after_attention(m.blocks.blocks[1], h))
        router = nt.permute(m.blocks.blocks[1].mlp.router.weight, ("embed", "experts")).array
        logits = nt.permute(normed, ("batch", "position", "embed")).array @ router
        return m.blocks.blocks[1].mlp(normed)[1], logits

    def _after_attention(block, h):
        positions = nt.arange(h.resolve_axis("position"), dtype=jnp.int32)
        out, _ = block.self_attn(block.pre_attn_norm(h), None, positions)
        return h + out

    expected, logits = eqx.filter_jit(layer1_input)(model, ids)
    assert set(aux) == {"router_aux_loss", "router_z_loss"}
    for name in aux:
        np.testing.assert_allclose(aux[name], expected[name], rtol=1e-6)
    # 3 of 5 experts: balanced routing gives 3, a fresh router is close to it.
    assert 2.7 < float(aux["router_aux_loss"]) < 3.6
    # The load: the sparse layer's row alone (the dense layers' zeros left out), the share of its router's choices
    # that each expert took, against softmax and top-3 in plain jax.numpy counted with numpy.
    assert load.shape == (1, 5)
    _, chosen = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), 3)
    counts = np.bincount(np.asarray(chosen).reshape(-1), minlength=5)
    np.testing.assert_allclose(load[0], counts / counts.sum(), atol=1e-7)


def test_mixed_layers_train_with_the_loss_falling():
    model = MIXED.build(Axis("vocab", 64), key=jax.random.key(6))
    pattern = jnp.tile(jnp.arange(4, dtype=jnp.int32) * 7, 4)
    ids = nt.named(jnp.stack([pattern, pattern]), ("batch", "position"))
    optimizer = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grad = jax.value_and_grad(lambda p: lm.next_token_loss(eqx.combine(p, static), ids).array)(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grad, opt_state)
            return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(25):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[0] > 3.0 and losses[-1] < 0.5 * losses[0], losses


def test_flops_count_each_layer_by_its_mlp():
    all_dense = dataclasses.replace(MIXED, mlp_only_layers=(1, 3))
    h, experts, k = BASE["hidden_dim"], 5, 3
    dense_mlp, active_experts = 3 * h * BASE["intermediate_dim"], 3 * k * h * 6 + h * experts
    assert MIXED.flops_per_token(41) - all_dense.flops_per_token(41) == pytest.approx(6 * (active_experts - dense_mlp))


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"scan_layers": True}, r"layers \[0, 2, 3\] have a dense MLP.*set scan_layers: false"),
        ({"mlp_only_layers": (4,)}, r"mlp_only_layers must list layers from 0 to num_layers - 1 = 3, got 4"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
        ({"num_experts_per_tok": 6}, "6 experts per token"),
    ],
)
def test_bad_qwen3_moe_configs_are_clear_errors(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        dataclasses.replace(MIXED, **change)


@dataclasses.dataclass(frozen=True)
class AppConfig:
    model: lm.LmConfig = dataclasses.field(default_factory=lm.Gpt2Config)


def test_the_yaml_section_decodes_with_qwen3_30b_a3b_defaults():
    section = {"type": "qwen3_moe", "mlp_only_layers": [0], "scan_layers": False}
    config = draccus.decode(AppConfig, yaml.safe_load(yaml.safe_dump({"model": section}))).model
    assert type(config) is lm.Qwen3MoeConfig and config.mlp_only_layers == (0,)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_dim) == (128, 8, 768)
    shapes = eqx.filter_eval_shape(lambda: config.build(Axis("vocab", 151936), key=jax.random.key(0)))
    # Qwen3-30B-A3B has 30.5B parameters; one dense layer instead of experts takes about 0.56B off.
    total = sum(x.size for x in jax.tree.leaves(shapes))
    assert 29.5e9 < total < 30.5e9, total


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"attn_backend": "jax_flash"}, "attention sinks are computed by our plain attention kernel only"),
        ({"use_flash_attention": True}, "attention sinks are computed by our plain attention kernel only"),
        ({"swiglu_limit": 0.0}, "swiglu_limit must be positive"),
        ({"lbl_coef": -1.0}, "lbl_coef must be >= 0"),
    ],
)
def test_bad_gpt_oss_configs_are_clear_errors(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        lm.GptOssConfig(**BASE, n_routed_experts=4, num_experts_per_tok=2, **change)


def test_gpt_oss_yaml_section_decodes_with_gpt_oss_20b_defaults():
    config = draccus.decode(AppConfig, yaml.safe_load(yaml.safe_dump({"model": {"type": "gpt_oss"}}))).model
    assert type(config) is lm.GptOssConfig and config.rope.type == "yarn" and not config.rope.truncate
    spec = config.decoder_spec()
    assert spec.layer_windows[:3] == (128, None, 128) and spec.attention_sinks
    shapes = eqx.filter_eval_shape(lambda: config.build(Axis("vocab", 201088), key=jax.random.key(0)))
    total = sum(x.size for x in jax.tree.leaves(shapes))
    # gpt-oss-20b: 20.9B parameters.
    assert 20.5e9 < total < 21.5e9, total


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"attn_backend": "jax_flash"}, r"chunked attention \(attention_chunk_size\) is computed by our plain"),
        ({"use_flash_attention": True}, r"set attn_backend: default .* or attention_chunk_size: null"),
        ({"moe_layers": [0, 4]}, r"Llama4Config.moe_layers must list layers from 0 to num_layers - 1 = 3, got 4"),
        ({"nope_layers": [True]}, r"Llama4Config.nope_layers must list layers .* got True"),
        ({"attention_chunk_size": 0}, r"attention_chunk_size must be a positive integer"),
        ({"lbl_coef": -1.0}, r"lbl_coef must be >= 0"),
        ({"interleave_moe_layer_step": 2}, r"layers \[0, 2\] have a dense MLP .* set scan_layers: false"),
    ],
)
def test_bad_llama4_configs_are_clear_errors(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        lm.Llama4Config(**BASE, moe_intermediate_dim=6, n_routed_experts=3, **change)


def test_llama4_yaml_section_decodes_with_scout_defaults_and_counts_the_shared_expert():
    config = draccus.decode(AppConfig, yaml.safe_load(yaml.safe_dump({"model": {"type": "llama4"}}))).model
    assert type(config) is lm.Llama4Config and config.rope.type == "llama3"
    assert config.sparse_layers() == tuple(range(48)) and config.nope_layer_list() == tuple(range(3, 48, 4))
    shapes = eqx.filter_eval_shape(lambda: config.build(Axis("vocab", 202048), key=jax.random.key(0)))
    total = sum(x.size for x in jax.tree.leaves(shapes))
    # Scout's text model, counted by hand: per layer q/o 2 x 5120 x 5120, k/v 2 x 5120 x 1024, 16 experts and a
    # shared one of 3 x 5120 x 8192 each, a router and two norms; embeddings, head and the final norm.
    layer = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 17 * 3 * 5120 * 8192 + 16 * 5120 + 2 * 5120
    assert total == 48 * layer + 2 * 202048 * 5120 + 5120
    # Active: attention, the shared expert and one routed expert per layer, the routers and the head (about 17B).
    active = 48 * (2 * 5120 * 5120 + 2 * 5120 * 1024 + 2 * 3 * 5120 * 8192 + 16 * 5120) + 202048 * 5120
    flops = config.flops_per_token(202048, seq_len=1)
    assert 6 * active <= flops < 6 * active * 1.001, (flops, 6 * active)
    # At 16384 positions: 36 chunked layers score 8192 keys per query, the 12 NoPE layers all 16384 (4 x heads x
    # head size per key, forward and backward).
    attention = 3 * 4 * 40 * 128 * (36 * 8192 + 12 * 16384)
    assert config.flops_per_token(202048, seq_len=16384) - flops == pytest.approx(attention - 3 * 4 * 40 * 128 * 48)


def test_a_scanned_llama4_gives_each_layer_its_own_rope_or_nope_as_the_unrolled_one_does(ids_of):
    # The unrolled stack is what the transformers parity test checks; here the scan must slice the per-layer NoPE
    # flag the same way: layers 1 and 3 NoPE (temperature-tuned from position 1 on), 0 and 2 chunked.
    config = lm.Llama4Config(
        **BASE, moe_intermediate_dim=6, n_routed_experts=3, num_experts_per_tok=2, no_rope_layer_interval=2,
        attention_chunk_size=5, floor_scale=2, attn_scale=1.0,
    )  # fmt: skip
    all_rope = dataclasses.replace(config, no_rope_layer_interval=5)

    def structure(c):  # the model's shape, without running its eager initialiser
        return jax.tree.structure(eqx.filter_eval_shape(lambda: c.build(VOCAB, key=jax.random.key(0))))

    shapes = jax.tree.leaves(eqx.filter_eval_shape(lambda: config.build(VOCAB, key=jax.random.key(0))))
    rng = np.random.default_rng(3)
    leaves = [jnp.asarray(rng.normal(0.0, 0.3, x.shape), jnp.float32) for x in shapes]
    scanned = jax.tree.unflatten(structure(config), leaves)
    assert isinstance(scanned.blocks, nt.Stacked)
    ids = ids_of(0, 2, 16, VOCAB.size)
    forward = eqx.filter_jit(lambda m, x: m(x).array)
    logits = forward(scanned, ids)
    np.testing.assert_allclose(forward(lm.unstack_layers(scanned), ids), logits, atol=1e-5, rtol=0)
    assert not np.allclose(forward(jax.tree.unflatten(structure(all_rope), leaves), ids), logits, atol=1e-3)
