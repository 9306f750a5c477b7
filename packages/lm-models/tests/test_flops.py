"""flops_per_token: 6 x the matmul weights actually in the model, plus the attention term, per the docs."""

import jax
import pytest

import lm_models as lm
from named_tensors import Axis

VOCAB = Axis("vocab", 64)


def matmul_weights(model) -> int:
    """Weights of every Linear in the layer stack plus the output head, counted from the built model."""
    blocks = model.blocks.stacked
    linears = [
        leaf
        for leaf in jax.tree.leaves(blocks, is_leaf=lambda x: hasattr(x, "In") and hasattr(x, "weight"))
        if hasattr(leaf, "In")
    ]
    return sum(linear.weight.size for linear in linears) + model.unembedding().size


@pytest.mark.parametrize(
    "config",
    [
        lm.Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4),
        lm.LlamaConfig(seq_len=32, hidden_dim=32, intermediate_dim=40, num_layers=3, num_heads=4, num_kv_heads=2),
        lm.MptConfig(seq_len=8, hidden_dim=32, num_layers=2, num_heads=2, expansion_ratio=3),
    ],
    ids=["gpt2", "llama", "mpt"],
)
def test_flops_per_token_counts_the_model_matmuls_and_attention(config):
    model = config.build(VOCAB, key=jax.random.key(0))
    attention = 4 * config.num_layers * config.seq_len * config.hidden_dim
    assert config.flops_per_token(VOCAB.size) == pytest.approx(3 * (2 * matmul_weights(model) + attention))
    longer = config.flops_per_token(VOCAB.size, seq_len=2 * config.seq_len)
    assert longer - config.flops_per_token(VOCAB.size) == pytest.approx(3 * attention)


def test_gpt2_small_is_about_six_times_its_parameter_count():
    gpt2_small = lm.Gpt2Config(seq_len=1024, hidden_dim=768, num_layers=12, num_heads=12)
    flops = gpt2_small.flops_per_token(50257)
    # 85M matmul weights in the blocks + 38.6M in the tied head, times 6, plus 12 * 12 * 1024 * 768 attention.
    assert flops == pytest.approx(6 * (85_000_000 + 38_597_376) + 12 * 12 * 1024 * 768, rel=0.01)


def test_backpack_counts_more_than_its_transformer():
    backpack = lm.BackpackConfig(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4, num_senses=4)
    gpt2 = lm.Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)
    assert backpack.flops_per_token(64) > gpt2.flops_per_token(64)
