"""YAML loading, includes, merging, overrides and the errors they give, on a small schema of their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import pytest

from lm_train.config.loading import dump_config, load_config, parse_duration
from lm_train.config.yaml_files import deep_merge, parse_overrides
from lm_train.errors import ConfigError


class Shape:
    """A choice type with the four classmethods draccus looks for."""

    _choices: ClassVar[dict[str, type]] = {}

    @classmethod
    def get_choice_class(cls, name):
        return cls._choices[name]

    @classmethod
    def get_known_choices(cls):
        return dict(cls._choices)

    @classmethod
    def get_choice_name(cls, subcls):
        for k, v in cls._choices.items():
            if v is subcls:
                return k
        raise ValueError(subcls)

    @classmethod
    def default_choice_name(cls):
        return None


@dataclass(frozen=True)
class Square(Shape):
    side: int = 1


@dataclass(frozen=True)
class Circle(Shape):
    radius: float = 1.0


Shape._choices.update(square=Square, circle=Circle)


@dataclass(frozen=True)
class Inner:
    steps: int = 10
    rates: tuple[float, ...] = (1.0,)
    every: timedelta = timedelta(minutes=1)


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    shape: Shape = field(default_factory=Square)
    name: str = "x"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_include_merge_and_override(tmp_path):
    write(tmp_path / "parts" / "inner.yaml", "steps: 5\nrates: [0.5, 0.25]\n")
    main = write(tmp_path / "main.yaml", "inner: !include parts/inner.yaml\nshape:\n  type: circle\n  radius: 2\n")
    extra = write(tmp_path / "extra.yaml", "name: second\ninner:\n  every: 90s\n")
    cfg, _ = load_config(Outer, [main, extra], ["--inner.steps", "7", "--shape.radius=3.5"])
    assert cfg == Outer(
        inner=Inner(steps=7, rates=(0.5, 0.25), every=timedelta(seconds=90)), shape=Circle(radius=3.5), name="second"
    )


def test_resolved_config_round_trips_through_yaml(tmp_path):
    main = write(tmp_path / "main.yaml", "shape: {type: circle, radius: 2}\ninner: {every: 1h30m}\n")
    cfg, _ = load_config(Outer, [main])
    again = write(tmp_path / "again.yaml", dump_config(cfg))
    assert load_config(Outer, [again])[0] == cfg
    assert "type: circle" in dump_config(cfg)


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    main = write(tmp_path / "main.yaml", "name: a\ninner:\n  stpes: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(Outer, [main])
    msg = str(e.value)
    assert f"{main}:3" in msg and "inner.stpes" in msg and "Did you mean `inner.steps`?" in msg


def test_unknown_key_in_override_names_the_flag(tmp_path):
    main = write(tmp_path / "main.yaml", "name: a\n")
    with pytest.raises(ConfigError, match=r"command-line flag --inner.step.*Did you mean `inner.steps`"):
        load_config(Outer, [main], ["--inner.step", "3"])


def test_unknown_choice_type_lists_known_ones(tmp_path):
    main = write(tmp_path / "main.yaml", "shape:\n  type: sqare\n")
    with pytest.raises(ConfigError, match=r"main.yaml:2.*unknown shape.type 'sqare'.*circle, square.*`square`"):
        load_config(Outer, [main])


def test_wrong_type_names_key_and_line(tmp_path):
    main = write(tmp_path / "main.yaml", "inner:\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"main.yaml:2: bad value for `inner.steps`"):
        load_config(Outer, [main])


def test_bad_yaml_names_line(tmp_path):
    main = write(tmp_path / "main.yaml", "inner:\n  steps: 5\n rates: [1\n")
    with pytest.raises(ConfigError, match=r"main.yaml:3:\d+: this is not valid YAML"):
        load_config(Outer, [main])


def test_missing_file_and_missing_include(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, [tmp_path / "nope.yaml"])
    main = write(tmp_path / "main.yaml", "inner: !include gone.yaml\n")
    with pytest.raises(ConfigError, match=r"gone.yaml does not exist \(included from .*main.yaml\)"):
        load_config(Outer, [main])


def test_include_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "inner: !include b.yaml\n")
    write(tmp_path / "b.yaml", "steps: !include a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(Outer, [tmp_path / "a.yaml"])


def test_duplicate_key_is_an_error(tmp_path):
    main = write(tmp_path / "main.yaml", "name: a\nname: b\n")
    with pytest.raises(ConfigError, match=r"main.yaml:2: key 'name' appears twice"):
        load_config(Outer, [main])


def test_override_parsing():
    flags, sources = parse_overrides(["--a.b", "[1, 2]", "--c=true", "--d-e.f", "5m"])
    assert flags == {"a": {"b": [1, 2]}, "c": True, "d_e": {"f": "5m"}}
    assert sources.where(("a", "b")) == "command-line flag --a.b"
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="Cannot read command-line argument 'oops'"):
        parse_overrides(["oops"])


def test_type_change_replaces_the_section():
    merged = deep_merge({"shape": {"type": "square", "side": 2}}, {"shape": {"type": "circle"}})
    assert merged == {"shape": {"type": "circle"}}
    assert deep_merge({"a": {"x": 1, "y": 2}}, {"a": {"y": 3}}) == {"a": {"x": 1, "y": 3}}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(90, 90), ("30s", 30), ("10m", 600), ("1h30m", 5400), ("2d", 172800), ("1.5h", 5400), ("250ms", 0.25)],
)
def test_durations(text, seconds):
    assert parse_duration(text).total_seconds() == pytest.approx(seconds)


def test_bad_duration():
    with pytest.raises(ValueError, match="cannot read '5 minutes' as a duration"):
        parse_duration("5 minutes")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("/path/x.jsonl.gz", ("/path/x.jsonl.gz",)),
        ('["https://example.org/a.jsonl"]', ("https://example.org/a.jsonl",)),  # Levanter's docs' form
        ("[/tmp/data/train_{1..3}.jsonl.gz]", ("/tmp/data/train_{1..3}.jsonl.gz",)),  # not YAML: { is a mapping
        ("[a.jsonl, 'b_{0,1}.jsonl']", ("a.jsonl", "b_{0,1}.jsonl")),
        ("[x_{0,1}.jsonl, y.jsonl]", ("x_{0,1}.jsonl", "y.jsonl")),
    ],
)
def test_one_string_for_a_list_key_is_a_one_element_list(make_config, given, expected):
    assert make_config("--data.builtin", "null", "--data.train_urls", given).data.train_urls == expected


def test_a_string_in_yaml_for_a_list_key_and_a_half_list(make_config, tmp_path):
    from lm_train.config import load_train_config

    extra = tmp_path / "urls.yaml"
    extra.write_text(
        "data:\n  builtin: null\n  train_urls: data/one.jsonl\n  validation_urls: data/v.jsonl\n", encoding="utf-8"
    )
    base = Path(__file__).parents[3] / "configs" / "gpt2_nano.yaml"
    config, _ = load_train_config([base, extra])
    assert config.data.train_urls == ("data/one.jsonl",) and config.data.validation_urls == ("data/v.jsonl",)
    with pytest.raises(ConfigError, match=r"`data\.train_urls` is a list, and '\[a\.jsonl' is not one"):
        make_config("--data.builtin", "null", "--data.train_urls", "[a.jsonl")


def test_a_partly_written_nested_block_keeps_the_familys_defaults(tmp_path):
    """gemma3's rope has theta 1e6 (RopeConfig's own default is 1e4): setting only its factor keeps the 1e6."""
    from lm_train.config import load_train_config

    path = tmp_path / "gemma3.yaml"
    path.write_text(
        "data: {builtin: python_stdlib}\nmodel: {type: gemma3, rope: {type: linear, factor: 2.0}}\n", encoding="utf-8"
    )
    config, _ = load_train_config([path])
    assert (config.model.rope.theta, config.model.rope.factor, config.model.rope.type) == (1e6, 2.0, "linear")
    written, _ = load_train_config([path], ["--model.rope.theta", "5e5"])
    assert written.model.rope.theta == 5e5  # what is written still wins
    plain, _ = load_train_config([path], ["--model.type", "llama"])
    assert plain.model.rope.theta == 10000.0  # a family whose default is the class's own
