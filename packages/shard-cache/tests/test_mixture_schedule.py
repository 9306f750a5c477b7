import re
from fractions import Fraction

import pytest

from shard_cache import MixtureConfigError, ShardCacheError, parse_block_size, parse_stop_strategy, parse_train_weights
from shard_cache.mixture_schedule import largest_remainder

SOURCES = ["wikitext", "w2", "code"]


def test_levanter_forms_parse_and_normalise():
    # the two forms of Levanter's train_weights (gpt2_nano_mixture.yaml's stages; gpt2_small_fast_mix's dict)
    staged = parse_train_weights([[0, {"wikitext": 0.8, "w2": 0.2}], [100, {"w2": 0.5, "wikitext": 0.5}]], SOURCES)
    assert staged.names == ("code", "w2", "wikitext")
    assert staged.starts == (0, 100)
    assert staged.weights_at(0) == staged.weights_at(99) == {"code": 0.0, "w2": 0.2, "wikitext": 0.8}
    assert staged.weights_at(100) == staged.weights_at(10**9) == {"code": 0.0, "w2": 0.5, "wikitext": 0.5}
    assert staged.evaluation_only() == ("code",) and staged.trained() == ("w2", "wikitext")
    plain = parse_train_weights({"wikitext": 3, "w2": 1, "code": 0}, SOURCES)
    assert plain.starts == (0,) and plain.weights_at(5) == {"code": 0.0, "w2": 0.25, "wikitext": 0.75}
    assert sum(plain.exact[0]) == 1
    assert parse_train_weights(None, SOURCES).weights_at(0) == dict.fromkeys(sorted(SOURCES), 1 / 3)
    # tuples (as a config loader may give) and the dict form written back
    assert parse_train_weights(((0, {"w2": 1}),), SOURCES).as_config() == {"code": 0.0, "w2": 1.0, "wikitext": 0.0}
    assert staged.as_config() == [[0, staged.weights_at(0)], [100, staged.weights_at(100)]]
    assert parse_train_weights(staged.as_config(), SOURCES) == staged


def test_largest_remainder_counts_sum_to_the_block_and_stay_within_one_of_the_quota():
    assert largest_remainder([Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)], 16) == (8, 5, 3)
    assert largest_remainder([Fraction(1, 3)] * 3, 2048) == (683, 683, 682)  # ties: the earlier source
    for total in (1, 7, 100, 2048):
        weights = [Fraction(5, 17), Fraction(11, 17), Fraction(1, 17)]
        counts = largest_remainder(weights, total)
        assert sum(counts) == total
        assert all(abs(c - w * total) < 1 for c, w in zip(counts, weights, strict=True))


@pytest.mark.parametrize(
    ("value", "key", "words"),
    [
        ({"wikitext": -0.5, "w2": 1}, "data.train_weights.wikitext", "is negative"),
        ({"wikitext": 0, "w2": 0.0}, "data.train_weights", "every weight is 0"),
        ({"wikitxt": 1}, "data.train_weights.wikitxt", "no source named 'wikitxt'; the sources are code, w2, wikitext"),
        ({"w2": "lots"}, "data.train_weights.w2", "must be a finite number"),
        ({"w2": float("nan")}, "data.train_weights.w2", "must be a finite number"),
        ({"w2": True}, "data.train_weights.w2", "must be a finite number"),
        ([[0, {"w2": 1}], [50, {"w2": 1, "code": -1}]], "data.train_weights[1].code", "is negative"),
        ([[0, {"w2": 1}], [50, {"nope": 1}]], "data.train_weights[1].nope", "no source named 'nope'"),
        ([[0, {"w2": 1}], [50, {"w2": 0}]], "data.train_weights[1]", "every weight is 0"),
        ([[10, {"w2": 1}]], "data.train_weights[0]", "the first stage starts at step 10"),
        ([[0, {"w2": 1}], [50, {"w2": 1}], [50, {"code": 1}]], "data.train_weights[2]", "strictly increasing"),
        ([[0, {"w2": 1}], [50, {"w2": 1}], [20, {"code": 1}]], "data.train_weights[2]", "not after the previous"),
        ([[0, {"w2": 1}], [2.5, {"w2": 1}]], "data.train_weights[1][0]", "whole number >= 0"),
        ([[0, {"w2": 1}], [-3, {"w2": 1}]], "data.train_weights[1][0]", "whole number >= 0"),
        ([[0, {"w2": 1}], {"w2": 1}], "data.train_weights[1]", "a stage is [step, {source: weight, ...}]"),
        ([], "data.train_weights", "the list of stages is empty"),
        ("w2", "data.train_weights", "expected {source: weight} or a list"),
    ],
)
def test_bad_weights_get_a_message_naming_the_key(value, key, words):
    with pytest.raises(MixtureConfigError) as error:
        parse_train_weights(value, SOURCES)
    message = str(error.value)
    assert message.startswith(f"{key}: "), message
    assert words in message
    assert isinstance(error.value, ShardCacheError) and isinstance(error.value, ValueError)
    assert "\n" not in message


def test_the_key_path_is_the_callers():
    with pytest.raises(MixtureConfigError, match=re.escape("cfg.yaml: data.train_weights[1].w2: the weight -1")):
        parse_train_weights([[0, {"w2": 1}], [5, {"w2": -1}]], SOURCES, key="cfg.yaml: data.train_weights")


def test_a_weight_too_small_for_the_block_is_warned_about():
    starved = r"data\.train_weights\.code: the weight 0\.0001 is too small .* block of 2048"
    with pytest.warns(UserWarning, match=starved):
        parse_train_weights({"code": 0.0001, "w2": 1}, SOURCES, block_size=2048)


def test_block_size_and_stop_strategy_are_checked():
    assert parse_block_size(2048) == 2048
    for bad in (0, -1, 2.0, True, "2048"):
        with pytest.raises(MixtureConfigError, match=r"^data\.mixture_block_size: must be a whole number"):
            parse_block_size(bad)
    assert parse_stop_strategy("restart") == "restart" and parse_stop_strategy("first_exhausted") == "first_exhausted"
    with pytest.raises(MixtureConfigError, match=r"^data\.stop_strategy: 'all_exhausted' is not a stop strategy here"):
        parse_stop_strategy("all_exhausted")


def test_with_stage_appends_after_the_last_stage_only():
    schedule = parse_train_weights({"w2": 1, "code": 1}, SOURCES)
    later = schedule.with_stage(30, {"code": 0.25, "w2": 0.75})
    assert later.starts == (0, 30) and later.weights_at(29) == schedule.weights_at(29)
    assert later.weights_at(30) == {"code": 0.25, "w2": 0.75, "wikitext": 0.0}
    with pytest.raises(MixtureConfigError, match=r"must start after the last one \(step 30\)"):
        later.with_stage(30, {"w2": 1})
    with pytest.raises(MixtureConfigError, match=r"weights\.w2: the weight -1"):
        later.with_stage(31, {"w2": -1})
