"""attn_backend: jax.nn.dot_product_attention (XLA's on CPU) computes the logits, loss and gradients ours does;
cuDNN without a GPU, a KV cache or a bias fall back to ours with one note; bad values are named."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from lm_models import attention_backend
from named_tensors import Axis, nn
from named_tensors.nn import fused_attention

VOCAB = Axis("vocab", 64)


def mistral(**kw) -> lm.MistralConfig:
    """Grouped-query attention with a window shorter than the sequence: the fused kernel's hardest case here."""
    return lm.MistralConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2, sliding_window=5,
        **kw,
    )  # fmt: skip


def loss_and_grads(config, ids, **inputs):
    model = config.build(VOCAB, key=jax.random.key(3))
    return jax.jit(jax.value_and_grad(lambda m, x: lm.next_token_loss(m, x, **inputs).array))(model, ids)


@pytest.mark.parametrize(
    "config",
    [mistral(), lm.Gpt2Config(seq_len=16, hidden_dim=32, num_layers=2, num_heads=4)],
    ids=["mistral-window-gqa", "gpt2"],
)
def test_the_xla_kernel_gives_our_loss_and_gradients(config, ids_of, monkeypatch):
    ids = ids_of(5)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["implementation"])
        return fused_attention(*args, **kwargs)

    monkeypatch.setattr(nn, "fused_attention", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback note: the fused kernel computes these layers
        fused_loss, fused_grads = loss_and_grads(dataclasses.replace(config, attn_backend="xla"), ids)
    assert calls and set(calls) == {"xla"}  # traced once for the scanned layer stack
    loss, grads = loss_and_grads(dataclasses.replace(config, attn_backend="vanilla"), ids)
    np.testing.assert_allclose(fused_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_what_the_fused_kernel_cannot_compute_falls_back_to_ours_with_a_note(ids_of, monkeypatch):
    monkeypatch.setattr(attention_backend, "_noted", set())
    ids = ids_of(6)
    loss, _ = loss_and_grads(mistral(attn_backend="vanilla"), ids)
    with pytest.warns(UserWarning, match=r"attention: cudnn cannot compute these layers \(no NVIDIA GPU here"):
        cudnn_loss, _ = loss_and_grads(mistral(attn_backend="cudnn"), ids)
    assert float(cudnn_loss) == float(loss)  # ours, to the bit
    # generation uses a KV cache: the xla backend's layers fall back there, and the tokens are ours
    model = mistral(attn_backend="xla").build(VOCAB, key=jax.random.key(4))
    plain = mistral(attn_backend="vanilla").build(VOCAB, key=jax.random.key(4))
    prompt = ids_of(7)["position", :4]
    with pytest.warns(UserWarning, match=r"xla cannot compute these layers \(a KV cache\)"):
        tokens = lm.generate(model, prompt, 5, temperature=0.0)
    np.testing.assert_array_equal(tokens.array, lm.generate(plain, prompt, 5, temperature=0.0).array)
    # on this CPU the default is ours, with no note
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default_loss, _ = loss_and_grads(mistral(), ids)
    assert float(default_loss) == float(loss)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"attn_backend": "nvte"}, r"'nvte' \(TransformerEngine attention\) is not built here"),
        ({"attn_backend": "flash3"}, r"attn_backend must be one of \['default', 'vanilla', 'jax_flash'"),
        ({"attn_backend": "xla", "use_flash_attention": True}, r"use_flash_attention is true but attn_backend"),
    ],
)
def test_bad_backends_are_named(keys, message):
    with pytest.raises(ValueError, match=message):
        mistral(**keys)
    with pytest.raises(ValueError, match=message):
        lm.LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, **keys)


def test_kernels_chosen_for_a_gpu_that_is_not_here_trace_as_ours_blockwise(ids_of, monkeypatch):
    """What `lm-train plan --devices 8xH100` traces on this CPU: cuDNN's kernel, which cannot be traced here,
    stands in as ours blockwise (the same loss), and no scores are built; the notes are kept, not shown."""
    monkeypatch.setattr(attention_backend, "_noted", set())
    config = lm.LlamaConfig(seq_len=16, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
    model = config.build(VOCAB, key=jax.random.key(5))
    ids = ids_of(8)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)

    def loss(m):
        return lm.next_token_loss(m, ids).array.astype(jnp.float32)

    def score_sized(m) -> list[tuple[int, ...]]:
        """The outputs shaped (batch, ..., position, key_position): materialised attention scores."""
        eqns = jax.make_jaxpr(jax.grad(loss))(m).eqns
        return [o.aval.shape for e in eqns for o in e.outvars if o.aval.shape[-2:] == (16, 16)]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # notes are kept in the choices, not shown
        with lm.kernels_for("gpu") as gpu:
            planned_loss = jax.jit(lambda m: loss(m))(bf16)
        # A new function each time: jax reuses a function's trace for the same shapes, kernels and all.
        with lm.kernels_for("gpu") as gpu_f32:
            jax.make_jaxpr(lambda m: loss(m))(model)
        with lm.kernels_for("tpu") as tpu:
            jax.make_jaxpr(lambda m: loss(m))(model)
    assert gpu.chosen == {("fused", "cudnn")} and gpu.notes == []
    assert gpu_f32.chosen == {("vanilla",)} and gpu_f32.notes == [
        "attention: cudnn cannot compute these layers (float32 compute; cuDNN's kernel needs bfloat16 or float16 "
        "(trainer.mp)); they use ours instead"
    ]
    assert tpu.chosen == {("vanilla",)} and tpu.notes == [
        "attention: splash cannot compute these layers (sequence length 16; the splash kernel needs a multiple of "
        "128); they use ours instead"
    ]
    # The stand-in computes the same loss as the CPU's own kernel does on the same bf16 model.
    np.testing.assert_allclose(float(planned_loss), float(jax.jit(loss)(bf16)), rtol=2e-2)
    with lm.kernels_for("gpu"):
        assert score_sized(bf16) == []
    assert score_sized(bf16)  # the CPU's default, ours, builds them


def _packed_rows(batch: int, length: int) -> dict:
    """Loss inputs of rows that pack documents of different lengths (the first row ends in padding, id -1)."""
    first = np.r_[np.zeros(40), np.ones(60), np.full(length - 100, -1)]
    second = np.r_[np.zeros(90), np.ones(length - 90)]
    raw = np.stack([first, second][:batch]).astype(np.int32)
    starts = [np.flatnonzero(np.r_[True, row[1:] != row[:-1]]) for row in raw]
    positions = np.stack([np.arange(length) - s[np.searchsorted(s, np.arange(length), "right") - 1] for s in starts])
    segments = nt.named(jnp.asarray(raw), ("batch", "position"))
    return {
        "attn_mask": nn.AttentionMask.packed(segments),
        "positions": nt.named(jnp.asarray(positions), ("batch", "position")),
    }


def test_splash_gives_our_loss_and_gradients_and_is_a_tpus_default(ids_of, monkeypatch):
    """attn_backend: splash runs the Pallas kernel (interpreted on this CPU, with a note): our loss and gradients,
    grouped-query attention, a window and packed rows (their segment ids) included. On a TPU it is the default,
    packed rows too; a mask it cannot take (padding, or the whole packed mask as one array) falls back."""
    monkeypatch.setattr(attention_backend, "_noted", set())
    config = dataclasses.replace(mistral(), seq_len=128, sliding_window=50)
    ids = ids_of(9, length=128)
    packed = _packed_rows(ids.axis_size("batch"), 128)
    with pytest.warns(UserWarning, match="splash runs in Pallas's interpreter off a TPU"):
        splash_loss, splash_grads = loss_and_grads(dataclasses.replace(config, attn_backend="splash"), ids, **packed)
    # Ours, given the same mask as one (batch, position, key_position) array.
    dense = dict(packed, attn_mask=packed["attn_mask"].materialize())
    loss, grads = loss_and_grads(dataclasses.replace(config, attn_backend="vanilla"), ids, **dense)
    np.testing.assert_allclose(splash_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(splash_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    unpacked_loss, _ = loss_and_grads(dataclasses.replace(config, attn_backend="vanilla"), ids)
    assert abs(float(unpacked_loss) - float(loss)) > 1e-3  # the packing matters to the loss compared

    model = config.build(VOCAB, key=jax.random.key(3))
    padding = nn.length_mask(nt.named(jnp.asarray([128, 100]), ("batch",)), Axis("key_position", 128))
    chosen = {}
    for name, mask in [("none", None), ("packed", packed["attn_mask"]), ("dense", dense["attn_mask"]),
                       ("padded", nn.and_masks(packed["attn_mask"], padding))]:  # fmt: skip
        with lm.kernels_for("tpu") as tpu:
            jax.make_jaxpr(lambda m, mask=mask: lm.next_token_loss(m, ids, attn_mask=mask).array)(model)
        chosen[name] = (tpu.chosen, tpu.notes)
    assert chosen["none"] == chosen["packed"] == ({("fused", "splash")}, [])
    for name in ("dense", "padded"):
        assert chosen[name][0] == {("vanilla",)}
        assert "an attention mask other than packed rows' segment ids" in chosen[name][1][0]


def gemma(version: int, **kw):
    """Local (window 50) and global layers in one scan: the window is a per-layer (traced) value."""
    base = dict(seq_len=128, hidden_dim=32, intermediate_dim=48, num_layers=2, num_heads=4, num_kv_heads=2)
    base.update(head_dim=8, sliding_window=50, sliding_window_pattern=2)  # remat and a rolled scan: a TPU's way
    if version == 2:
        return lm.Gemma2Config(**base, attn_logit_softcapping=2.0, final_logit_softcapping=None, **kw)
    return lm.Gemma3Config(**base, rope_local_base_freq=100.0, **kw)


@pytest.mark.parametrize(
    ("version", "backend"),
    [(3, "xla"), (3, "splash"), (2, "splash")],
    ids=["gemma3-xla", "gemma3-splash", "gemma2-splash"],
)
def test_per_layer_windows_and_soft_caps_run_on_the_fused_kernels(version, backend, ids_of):
    """Gemma's local and global layers: each layer's window picks, at run time, the fused kernel built for it, so
    the fused kernels compute a scanned stack whose windows differ (and splash soft-caps Gemma 2's scores). Our
    loss and gradients; on a TPU (GPU) the default is splash (cuDNN, where there is no soft cap) with no note."""
    config = gemma(version)
    ids = ids_of(10, length=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused_loss, fused_grads = loss_and_grads(dataclasses.replace(config, attn_backend=backend), ids)
    assert not [w for w in caught if "cannot compute" in str(w.message)]
    loss, grads = loss_and_grads(dataclasses.replace(config, attn_backend="vanilla"), ids)
    np.testing.assert_allclose(fused_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
    unwindowed, _ = loss_and_grads(dataclasses.replace(config, attn_backend="vanilla", sliding_window=None), ids)
    assert abs(float(unwindowed) - float(loss)) > 1e-4  # the windows matter to the loss compared

    model = config.build(VOCAB, key=jax.random.key(3))
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
    for platform, kernel in (("tpu", ("fused", "splash")), ("gpu", ("fused", "cudnn"))):
        with lm.kernels_for(platform) as chosen:
            jax.make_jaxpr(lambda m: lm.next_token_loss(m, ids).array)(bf16)
        if platform == "gpu" and version == 2:
            assert chosen.chosen == {("vanilla",)} and "soft-capped scores" in chosen.notes[0]
        else:
            assert chosen.chosen == {kernel} and chosen.notes == []
