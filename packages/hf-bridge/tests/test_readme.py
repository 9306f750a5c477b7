"""The package README's python example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_readme_example_runs():
    (block,) = python_blocks(README.read_text())
    exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
