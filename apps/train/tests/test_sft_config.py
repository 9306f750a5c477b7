"""SFT and LoRA config keys: Levanter's SFT and LoRA configs resolve or name what to write instead; the
format shorthand; the checks of the data and lora sections."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lm_train.config import load_train_config
from lm_train.config.data_formats import ChatFormat
from lm_train.config.loading import dump_config
from lm_train.errors import ConfigError

LEVANTER = Path(__file__).parent / "data" / "levanter"
HINT = re.compile(r"`([\w.]+): .*` is Levanter's, and lm-train does not take it: (.+)")


def _drop(raw: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        raw = raw[key]
    del raw[last]


def _resolve(path: Path, tmp_path: Path) -> tuple[object, dict[str, str]]:
    """Load a Levanter config, dropping each key lm-train refuses (with its hint) until the rest loads."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    refused: dict[str, str] = {}
    for _ in range(40):
        attempt = tmp_path / path.name
        attempt.write_text(yaml.safe_dump(raw), encoding="utf-8")
        try:
            return load_train_config([attempt], [])[0], refused
        except ConfigError as e:
            found = HINT.search(str(e))
            assert found, f"a Levanter key without a hint of what to use instead: {e}"
            key, hint = found.groups()
            assert "`" in hint and len(hint) > 30, hint  # names the replacement
            refused[key] = hint
            _drop(raw, key)
    pytest.fail("too many refused keys")


def test_levanter_sft_config_resolves_or_names_each_replacement(tmp_path):
    config, refused = _resolve(LEVANTER / "sft_llama3.1_tulu3.yaml", tmp_path)
    assert set(refused) == {
        "dataset_type",
        "chat_train_urls",
        "supervised_data",
        "max_seq_len",
        "tokenizer",
        "chat_template",
        "model_name_or_path",
        "epoch",
    }, refused
    assert "data.format" in refused["dataset_type"] and "initialize_from_hf" in refused["model_name_or_path"]
    assert config.initialize_from_hf is True  # Levanter's `true` resolves; `run` then asks for the directory
    # What lm-train takes keeps Levanter's meaning.
    assert config.model.seq_len == 4096 and config.trainer.train_batch_size == 128
    assert config.optimizer.learning_rate == 5e-6 and config.hf_save_steps == 1000
    assert "seq_len: 4096" in dump_config(config)


def test_levanter_lora_config_resolves_or_names_each_replacement(tmp_path):
    config, refused = _resolve(LEVANTER / "lora_llama2.yaml", tmp_path)
    assert set(refused) == {"peft_hf_upload", "merged_hf_upload"}, refused
    assert config.lora is not None and config.lora.r == 8 and config.lora.alpha == 8.0
    assert tuple(config.lora.target_modules) == ("q_proj", "v_proj")
    assert config.peft_save_path == "lora_llama2" and config.data.id == "dlwh/wikitext_103_detokenized"


def _config(tmp_path: Path, data: str, extra: str = "") -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(f"data:\n  train_urls: [a.jsonl]\n{data}{extra}", encoding="utf-8")
    return path


def test_format_shorthand_and_defaults(tmp_path):
    config, _ = load_train_config([_config(tmp_path, "  format: chat\n")], [])
    assert isinstance(config.data.format, ChatFormat) and config.data.format.mask_user_turns
    assert config.data.packed and config.data.long_document_rule == "truncate"
    text, _ = load_train_config([_config(tmp_path, "  pack: true\n")], [])
    assert text.data.packed and text.data.long_document_rule == "split"
    with pytest.raises(ConfigError, match=r"c.yaml:3: `data.format` is one of chat, prompt_completion"):
        load_train_config([_config(tmp_path, "  format: chatml\n")], [])


@pytest.mark.parametrize(
    ("data", "extra", "message"),
    [
        ("  on_bad_input: ignore\n", "", "data.on_bad_input must be `fail` or `skip`"),
        ("  long_documents: wrap\n", "", "data.long_documents must be one of truncate, split, drop"),
        ("  format: {type: chat, pack: false}\n  pack: true\n", "", "set one of them"),
        ("", "lora:\n  r: 0\n", "lora.r must be a positive integer rank"),
        ("", "lora:\n  target_modules: 3\n", "list of layer names"),
    ],
)
def test_bad_sft_settings_name_the_key(tmp_path, data, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config([_config(tmp_path, data, extra)], [])


def test_every_registered_data_format_builds_its_processor(tmp_path):
    """Each `data.format` type builds its own shard-cache processor; Levanter's `supervised` with `separate_with`
    puts the separator in the prompt (no loss on it), as prompt_completion with `separator` does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from lm_train.config.data_formats import DataFormat, SupervisedFormat

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    tokenizer.train_from_iterator(["a question and an answer"] * 20, trainer)
    path = str(tmp_path / "tokenizer.json")
    tokenizer.save(path)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": template})
    )
    built = {name: choice().processor(str(tmp_path)) for name, choice in DataFormat.get_known_choices().items()}
    assert set(built) >= {"text", "chat", "prompt_completion", "supervised"}
    assert all(callable(processor) and processor.fingerprint() for processor in built.values())

    processor = SupervisedFormat(separate_with="\n### ").processor(path)
    spans = processor.prepare({"prompt": "a question", "response": "an answer"})
    assert spans.text.startswith("a question\n### an answer")
    start, end = spans.spans[0]
    assert spans.text[start:end].startswith("an answer")
