"""The chip table's lookups, and the CPU peak: measured once per machine, kept in the user's cache."""

from __future__ import annotations

import json

import pytest

from lm_train.run import chips


@pytest.mark.parametrize(
    "kind,name",
    [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA A100-SXM4-80GB", "A100-80"), ("TPU v5 lite", "v5e"), ("TPU v4", "v4")],
)
def test_device_kinds_find_their_chip(kind, name):
    assert chips.chip_for_kind(kind).name == name
    assert chips.chip_for_kind("some new accelerator") is None


def test_the_cpu_peak_is_measured_once_and_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(chips, "measured_cpu_peak", lambda: measured.append(1) or 123.0e9)

    assert chips.cpu_peak() == 123.0e9 and chips.cpu_peak() == 123.0e9
    assert len(measured) == 1
    kept = json.loads((tmp_path / "lm-train" / "cpu-peak.json").read_text())
    assert list(kept.values()) == [123.0e9] and "cores" in next(iter(kept))

    (tmp_path / "lm-train" / "cpu-peak.json").write_text("{not json")  # a damaged file is measured over
    assert chips.cpu_peak() == 123.0e9 and len(measured) == 2
    assert json.loads((tmp_path / "lm-train" / "cpu-peak.json").read_text()) == kept


def test_a_cache_that_cannot_be_written_still_gives_the_peak(tmp_path, monkeypatch):
    (tmp_path / "lm-train").write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(chips, "measured_cpu_peak", lambda: 7.0e9)
    assert chips.cpu_peak() == 7.0e9


def test_the_measured_peak_is_a_plausible_rate():
    rate = chips.measured_cpu_peak((64,), 0.02)
    assert 1e7 < rate < 1e14
