"""A multimodal Llama 4 checkpoint (model_type llama4, as Meta's releases are) imports as its text model: the config
from text_config, the weights from language_model., the vision tower and projector left out; against transformers'
Llama4ForConditionalGeneration, whose own text model gives the reference logits."""

import json
import logging

import numpy as np
import pytest

import hf_bridge
import lm_models

TEXT = dict(
    vocab_size=53, hidden_size=24, intermediate_size=14, intermediate_size_mlp=20, num_hidden_layers=2,
    num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=3, num_experts_per_tok=2,
    interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=4, max_position_embeddings=64,
    rms_norm_eps=1e-5,
)  # fmt: skip
VISION = dict(
    hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28, patch_size=14,
    vision_output_dim=16, projector_input_dim=16, projector_output_dim=16, pixel_shuffle_ratio=0.5,
)  # fmt: skip


def test_a_multimodal_llama4_imports_its_text_model_with_transformers_logits(hf, parity, ids_for, tmp_path, caplog):
    T, torch = hf.transformers, hf.torch
    text = T.Llama4TextConfig(**TEXT, attn_implementation="eager", experts_implementation="eager")
    config = T.Llama4Config(text_config=text.to_dict(), vision_config=T.Llama4VisionConfig(**VISION).to_dict())
    torch.manual_seed(0)
    theirs = T.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms off one, so that a mix-up between them shows
        for name, p in theirs.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "llama4" and "vision_config" in written and "vocab_size" not in written

    with caplog.at_level(logging.INFO, logger="hf_bridge"):
        model, ours = hf_bridge.load_pretrained(tmp_path / "hf")
    assert isinstance(ours, lm_models.Llama4Config) and ours.num_layers == 2 and ours.nope_layers == (1,)
    assert model.Vocab.size == 53
    assert "its vision tower and projector are left out" in caplog.text
    left_out = [r.getMessage() for r in caplog.records if r.getMessage().startswith("left out ")]
    vision_keys = [k for k, _ in theirs.state_dict().items() if k.startswith(("vision_model.", "multi_modal_"))]
    assert left_out and left_out[0].startswith(f"left out {len(vision_keys)} tensors")
    ids = ids_for(53, 11)
    with torch.no_grad():  # the multimodal model's text-only forward is its language model's
        expected = theirs.language_model(torch.tensor(ids)).logits.float().numpy()
    parity.assert_close(parity.our_logits(model, ids), expected)
    # The same weights into a model of a given config (lm-train's initialize_from_hf), and the config alone.
    assert hf_bridge.read_model_config(tmp_path / "hf") == ours
    again = hf_bridge.load_weights(tmp_path / "hf", ours, model.Vocab)
    np.testing.assert_array_equal(np.asarray(again.lm_head.weight.array), np.asarray(model.lm_head.weight.array))

    # A config.json whose text model is missing, or with a key nobody reads: errors naming the file and the key.
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**written, "text_config": None}))
    with pytest.raises(hf_bridge.HfBridgeError, match=r"config\.json describes a llama4 model.*'text_config'"):
        hf_bridge.read_model_config(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**written, "audio_config": {}}))
    with pytest.raises(hf_bridge.HfBridgeError, match=r"config\.json has the key 'audio_config'"):
        hf_bridge.read_model_config(tmp_path / "bad")
