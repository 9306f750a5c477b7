"""The root conftest's summary line: tests skipped for want of the `parity` group are counted, with the command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def root_conftest():
    path = Path(__file__).parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("root_conftest_for_summary", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


class Reporter:
    """What pytest_terminal_summary uses of pytest's terminal reporter: the reports by outcome, and its output."""

    def __init__(self, skipped: list) -> None:
        self.stats = {"skipped": skipped}
        self.lines: list[str] = []

    def section(self, title: str) -> None:
        self.lines.append(f"== {title} ==")

    def write_line(self, line: str) -> None:
        self.lines.append(line)


def _skip(reason: str) -> SimpleNamespace:
    return SimpleNamespace(longrepr=("packages/x/tests/test_x.py", 3, f"Skipped: {reason}"))


SKIPS = [
    _skip("could not import 'torch': No module named 'torch'"),
    _skip("torch/transformers not installed (No module named 'transformers'); `uv sync --all-groups` installs them"),
    _skip("could not import 'peft': No module named 'peft'"),
    _skip("needs 4 devices"),  # skipped for another reason: not counted
]


def test_the_summary_counts_parity_skips_and_gives_the_command(root_conftest, monkeypatch):
    monkeypatch.setattr(root_conftest, "missing_parity_modules", lambda: ["torch", "transformers", "peft"])
    reporter = Reporter(SKIPS)
    root_conftest.pytest_terminal_summary(reporter)
    title, line = reporter.lines
    assert title == "== skipped: Hugging Face parity checks =="
    assert line.startswith("3 test(s) skipped because torch, transformers, peft (the `parity` dependency group) are")
    assert "`uv sync --all-groups`" in line

    monkeypatch.setattr(root_conftest, "missing_parity_modules", lambda: ["peft"])
    reporter = Reporter(SKIPS)
    root_conftest.pytest_terminal_summary(reporter)
    assert reporter.lines[1].startswith("2 test(s) skipped because peft (the `parity` dependency group) is")

    # Installed, or nothing skipped for it: no section at all.
    for missing, skips in ((lambda: [], SKIPS), (lambda: ["torch"], SKIPS[3:])):
        monkeypatch.setattr(root_conftest, "missing_parity_modules", missing)
        reporter = Reporter(skips)
        root_conftest.pytest_terminal_summary(reporter)
        assert reporter.lines == []


def test_missing_parity_modules_is_what_cannot_be_imported(root_conftest):
    expected = [n for n in root_conftest.PARITY_MODULES if importlib.util.find_spec(n) is None]
    assert root_conftest.missing_parity_modules() == expected
