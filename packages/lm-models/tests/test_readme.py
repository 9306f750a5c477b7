"""The README's example runs as written."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).parent.parent / "README.md"


def test_readme_example_runs():
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    assert blocks, "the README should show an example"
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), namespace)
    assert np.isfinite(float(namespace["loss"].array))
    assert namespace["tokens"].axis_names == ("batch", "position")
