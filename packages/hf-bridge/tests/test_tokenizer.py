"""Tokenizers: load from a file or an HF directory; exports that transformers' AutoTokenizer loads unchanged."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import hf_bridge
from hf_bridge import HfBridgeError
from lm_models import Gpt2Config

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizers!", "naïve café 123"] * 20
SAMPLE = "hello the lazy café fox!"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A tiny byte-level BPE with one special token (GPT-2's convention), trained in a blink."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS, trainer)
    return tok


@pytest.fixture(scope="module")
def model_and_config(make_model):
    config = Gpt2Config(seq_len=8, hidden_dim=16, num_layers=1, num_heads=2)
    return make_model(config, 320), config


def test_export_loads_in_auto_tokenizer_with_the_same_ids(hf, tokenizer, model_and_config, tmp_path):
    model, config = model_and_config
    hf_bridge.save_pretrained(model, config, tmp_path / "out", tokenizer=tokenizer)
    auto = hf.transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert auto(SAMPLE)["input_ids"] == tokenizer.encode(SAMPLE).ids
    assert auto.decode(tokenizer.encode(SAMPLE).ids) == SAMPLE
    assert auto.eos_token == "<|endoftext|>" and auto.model_max_length == config.seq_len
    eos = tokenizer.token_to_id("<|endoftext|>")
    hf_config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config["eos_token_id"] == hf_config["bos_token_id"] == eos
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == eos
    assert hf.transformers.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == eos


def test_load_from_file_and_directory(tokenizer, model_and_config, tmp_path):
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    from_file = hf_bridge.load_tokenizer(tmp_path / "tokenizer.json")
    assert from_file.encode(SAMPLE).ids == tokenizer.encode(SAMPLE).ids
    hf_bridge.save_pretrained(*model_and_config, tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")
    from_dir = hf_bridge.load_tokenizer(tmp_path / "out")
    assert from_dir.encode(SAMPLE).ids == tokenizer.encode(SAMPLE).ids
    assert hf_bridge.load_special_tokens(tmp_path / "out")["eos_token"] == "<|endoftext|>"
    assert hf_bridge.load_special_tokens(tmp_path / "tokenizer.json") == {}


def test_special_tokens_of_an_hf_directory_are_kept(hf, tokenizer, model_and_config, tmp_path):
    fast = hf.transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(tmp_path / "hf_tok")
    assert hf_bridge.load_special_tokens(tmp_path / "hf_tok")["pad_token"] == "<|endoftext|>"
    hf_bridge.save_pretrained(*model_and_config, tmp_path / "out", tokenizer=tmp_path / "hf_tok")
    auto = hf.transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert auto.pad_token == "<|endoftext|>"
    assert auto(SAMPLE)["input_ids"] == fast(SAMPLE)["input_ids"]


def test_bad_tokenizers_are_clear_errors(tokenizer, model_and_config, make_model, tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(HfBridgeError, match=r"has no tokenizer\.json"):
        hf_bridge.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(HfBridgeError, match="not a valid tokenizers file"):
        hf_bridge.load_tokenizer(tmp_path / "tokenizer.json")
    model, config = model_and_config
    with pytest.raises(HfBridgeError, match=r"special token eos_token='</s>' is not in"):
        hf_bridge.save_pretrained(
            model, config, tmp_path / "x", tokenizer=tokenizer, special_tokens={"eos_token": "</s>"}
        )
    small = make_model(config, 50)
    with pytest.raises(HfBridgeError, match=r"tokenizer has \d+ tokens but the model's vocabulary has only 50"):
        hf_bridge.save_pretrained(small, config, tmp_path / "y", tokenizer=tokenizer)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
