"""The key reference in docs/configuration.md and in `lm-train run --help` comes from the schema."""

from pathlib import Path

from lm_train.config.reference import BEGIN_MARK, END_MARK, config_key_lines, iter_keys, reference_markdown
from lm_train.config.schema import TrainLmConfig

PAGE = Path(__file__).parents[3] / "docs" / "configuration.md"


def test_configuration_page_is_up_to_date():
    text = PAGE.read_text(encoding="utf-8")
    generated = text[text.index(BEGIN_MARK) + len(BEGIN_MARK) : text.index(END_MARK)]
    assert generated.strip() == reference_markdown().strip(), (
        "docs/configuration.md is stale: run `uv run python -m lm_train.config.reference docs/configuration.md`"
    )


def test_reference_lists_levanter_keys_with_defaults():
    keys = {key: default for key, _, default, _ in iter_keys(TrainLmConfig)}
    for key in (
        "data.train_urls",
        "data.tokenizer",
        "data.cache_dir",
        "trainer.num_train_steps",
        "trainer.train_batch_size",
        "trainer.per_device_parallelism",
        "trainer.mp",
        "trainer.model_axis_size",
        "trainer.checkpointer.save_interval",
        "optimizer.<adam>.learning_rate",
        "model.<gpt2>.hidden_dim",
    ):
        assert key in keys, key
    assert keys["trainer.checkpointer.save_interval"] == "15m"
    assert keys["trainer.mp"] == "auto"  # Levanter's f32 on CPU; bf16 compute on an accelerator


def test_help_lines_document_fields():
    lines = config_key_lines()
    assert any(line.startswith("--trainer.log_every (int, default 10): Log training metrics") for line in lines)
