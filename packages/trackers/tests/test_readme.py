"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(tmp_path, monkeypatch):
    [example] = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    assert (tmp_path / "runs" / "example" / "metrics.jsonl").exists()
    assert list((tmp_path / "runs" / "example" / "tb").glob("events.out.tfevents.*"))
