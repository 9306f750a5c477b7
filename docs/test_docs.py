"""Runs every ```python block of every docs page, so the manual cannot rot."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parent
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a markdown page, in order."""
    return FENCE.findall(page.read_text(encoding="utf-8"))


PAGES = sorted(p for p in DOCS.glob("*.md") if python_blocks(p))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs(page: Path, tmp_path: Path) -> None:
    """A page's python blocks run, in order, as one script in a fresh interpreter and an empty directory."""
    # A name no package has: a script called trackers.py would shadow the trackers package.
    script = tmp_path / f"_docs_page_{page.stem.replace('-', '_')}.py"
    parts = [f"# --- block {i} of {page.name}\n{block}" for i, block in enumerate(python_blocks(page), 1)]
    script.write_text("\n".join(parts), encoding="utf-8")
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{page.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def test_fence_extraction_sees_every_block(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("text\n```python\nx = 1\n```\n```bash\nls\n```\n```python title\ny = x + 1\n```\n")
    assert python_blocks(page) == ["x = 1\n", "y = x + 1\n"]


def test_every_image_and_relative_link_of_the_docs_exists() -> None:
    pages = [*sorted(DOCS.glob("*.md")), DOCS.parent / "README.md"]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, missing
