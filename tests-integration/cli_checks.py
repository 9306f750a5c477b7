"""Checks shared by the integration tests of bad input: the CLI's one-paragraph error, and files left untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path


def error_paragraph(stderr: str) -> str:
    """The paragraph of stderr that starts at its `error: ` line (progress lines may come before it)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    paragraph = []
    for line in lines[start:]:
        if not line.strip():
            break
        paragraph.append(line)
    return "\n".join(paragraph)


def assert_clear_error(result, *needles: str) -> None:
    """Exit code 2, no traceback, exactly one `error: ` paragraph, and each needle in that paragraph."""
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    paragraph = error_paragraph(result.stderr)
    for needle in needles:
        assert needle in paragraph, f"{needle!r} not in: {paragraph}"


def tree_digest(root: Path) -> dict[str, str]:
    """Content hash of every file under a directory, by its path relative to it."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
