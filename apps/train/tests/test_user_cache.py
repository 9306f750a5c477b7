"""Values kept in the user's cache folder: read back, computed over when damaged, trimmed to the newest entries."""

from __future__ import annotations

import json

from lm_train.planning import estimate_cache
from lm_train.run.user_cache import kept_or_computed, user_cache_file


def test_the_cache_file_is_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert user_cache_file("x.json") == str(tmp_path / "lm-train" / "x.json")
    assert estimate_cache.estimate_cache_file() == str(tmp_path / "lm-train" / "estimates.json")


def test_a_kept_value_is_read_back_and_only_the_newest_entries_stay(tmp_path):
    path = str(tmp_path / "kept.json")
    calls = []
    for i in range(5):
        assert (
            kept_or_computed(path, f"k{i}", int, lambda i=i: calls.append(i) or i * 10, indent=0, max_entries=3)
            == i * 10
        )
    assert calls == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / "kept.json").read_text()) == {"k2": 20, "k3": 30, "k4": 40}
    assert kept_or_computed(path, "k3", int, lambda: -1, indent=0, max_entries=3) == 30  # read back, not computed


def test_a_value_of_another_kind_or_a_damaged_file_is_computed_again(tmp_path):
    path = tmp_path / "kept.json"
    path.write_text(json.dumps({"k": "a string"}))
    assert kept_or_computed(str(path), "k", float, lambda: 2.5, indent=1) == 2.5
    assert json.loads(path.read_text()) == {"k": 2.5}
    path.write_text("[1, 2]")  # JSON, but not an object
    assert kept_or_computed(str(path), "k", float, lambda: 3.5, indent=1) == 3.5
    assert json.loads(path.read_text()) == {"k": 3.5}


def test_a_file_that_cannot_be_written_still_gives_the_value(tmp_path):
    (tmp_path / "lm-train").write_text("a file where the folder would go")
    path = str(tmp_path / "lm-train" / "kept.json")
    assert kept_or_computed(path, "k", int, lambda: 7, indent=0) == 7
