"""Every config key is described, its default is the YAML a user writes, and `run --help` groups keys by section."""

import re
import sys

import pytest
import yaml

import named_tensors as nt
from lm_models import LmConfig
from lm_models.rope import ROPE_TYPES
from lm_train.config import load_train_config
from lm_train.config.optimizer_config import OptimizerConfig
from lm_train.config.reference import CHOICE_KEY, iter_keys
from lm_train.config.schema import TrainLmConfig

ROWS = list(iter_keys(TrainLmConfig))


def test_every_key_of_every_section_family_and_optimizer_has_a_description():
    missing = [key for key, _, _, doc in ROWS if not doc.strip()]
    assert not missing, f"{len(missing)} config keys have no description (a string under the field): {missing}"
    # The walk reaches every registered model family and optimizer type, so none escapes the check above.
    seen = {(m.group(1), m.group(2)) for key, *_ in ROWS if (m := CHOICE_KEY.match(key))}
    assert {name for section, name in seen if section == "model"} == set(LmConfig.get_known_choices())
    assert {name for section, name in seen if section == "optimizer"} == set(OptimizerConfig.get_known_choices())
    assert {key.split(".", 1)[0] for key, *_ in ROWS} >= {"data", "model", "trainer", "optimizer", "z_loss_weight"}


@pytest.mark.parametrize(
    ("suffix", "values"),
    [
        (".gradient_checkpointing", ("true", "false", *nt.CHECKPOINT_POLICIES)),
        (".activation_function", nt.nn.activations.ACTIVATION_NAMES),
        (".rope.type", ROPE_TYPES),
        ("optimizer.<adam>.lr_schedule", ("cosine", "linear", "constant")),
    ],
)
def test_string_valued_keys_list_their_allowed_values(suffix, values):
    docs = {key: doc for key, _, _, doc in ROWS if key.endswith(suffix)}
    assert docs, suffix
    for key, doc in docs.items():
        absent = [v for v in values if not re.search(rf"\b{re.escape(v)}\b", doc)]
        assert not absent, f"{key}: the description does not name {absent}: {doc!r}"


def test_defaults_are_yaml_not_python_reprs():
    for key, _, default, _ in ROWS:
        if default == "''":  # YAML's empty string
            continue
        assert not re.search(r"\b(None|True|False)\b|'|\w\(", default), f"{key}: default {default!r} is a Python repr"
    shown = {key: default for key, _, default, _ in ROWS}
    assert yaml.safe_load(shown["trainer.checkpointer.keep"]) == [{"every": 10000, "until": None}]
    assert yaml.safe_load(shown["trainer.tensor_parallel_axes"]) == ["mlp", "heads", "kv_heads"]
    assert shown["trainer.mp"] == "auto" and shown["model.<gpt2>.gradient_checkpointing"] == "true"


def _nested(pairs: dict[str, object]) -> dict:
    out: dict = {}
    for dotted, value in pairs.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@pytest.mark.parametrize("model_type", sorted(LmConfig.get_known_choices()))
def test_shown_defaults_written_as_yaml_decode_to_the_defaults(model_type, tmp_path):
    """A config that writes every shown default out (this family's model keys, an optimizer type's keys) loads to
    the config the dataclass defaults build: what --help and docs/configuration.md show is what a user can write."""
    optimizer_types = sorted(OptimizerConfig.get_known_choices())
    optimizer = optimizer_types[sorted(LmConfig.get_known_choices()).index(model_type) % len(optimizer_types)]
    values: dict[str, object] = {"model.type": model_type, "optimizer.type": optimizer}
    off = [key + "." for key, tp, _, _ in ROWS if tp == "section | None"]  # null by default: no keys below
    for key, _, default, _ in ROWS:
        choice = CHOICE_KEY.match(key)
        if "<name>" in key or (key.endswith(".type") and choice is None) or key.startswith(tuple(off)):
            continue
        if choice is None and "<" in key:  # a choice inside a section (data.format.<chat>.*): its default is null
            continue
        if choice is not None:
            section, name, rest = choice.groups()
            if name != {"model": model_type, "optimizer": optimizer}[section]:
                continue
            key = f"{section}.{rest}"
        values[key] = yaml.safe_load(default)
    values["data.builtin"] = "python_stdlib"  # a config needs one source of text; every other value is the default
    path = tmp_path / "every_default.yaml"
    path.write_text(yaml.safe_dump(_nested(values)), encoding="utf-8")
    config, _ = load_train_config([path])
    expected = TrainLmConfig(
        data=type(config.data)(builtin="python_stdlib"),
        model=LmConfig.get_choice_class(model_type)(),
        trainer=type(config.trainer)(),
        optimizer=OptimizerConfig.get_choice_class(optimizer)(),
    )
    assert config == expected


def test_run_help_lists_keys_by_section_each_model_key_once(monkeypatch, capsys):
    from lm_train.cli import main

    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setattr(sys, "argv", ["lm-train", "run", "--help"])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    heading = re.compile(r"^(data|model|trainer|optimizer)\b")
    headings = [line.split(" ", 1)[0].rstrip(":") for line in lines if heading.match(line)]
    assert headings == ["data", "model", "trainer", "optimizer"], headings
    keys = [line.split(" ", 1)[0] for line in lines if line.startswith("--") and "." in line.split(" ", 1)[0]]
    sections = [key[2:].split(".", 1)[0] for key in keys]
    runs = [s for i, s in enumerate(sections) if i == 0 or s != sections[i - 1]]  # each section's keys together
    assert len(runs) == len(set(runs)) and runs[:4] == ["data", "model", "trainer", "optimizer"], runs
    assert keys.count("--model.hidden_dim") == 1 and keys.count("--model.gradient_checkpointing") == 1
    assert not any("<" in key.split(".")[1] for key in keys if key.startswith(("--model.", "--optimizer.")))
    (checkpointing,) = [line for line in lines if line.startswith("--model.gradient_checkpointing ")]
    assert all(policy in checkpointing for policy in nt.CHECKPOINT_POLICIES)
    (keep,) = [line for line in lines if line.startswith("--trainer.checkpointer.keep ")]
    assert "default [{every: 10000, until: null}]" in keep
    described = re.compile(r"^--[\w.<>-]+ \(.+\): \S")
    assert all(described.match(line) for line in lines if line.startswith(("--data.", "--model.", "--trainer.")))
