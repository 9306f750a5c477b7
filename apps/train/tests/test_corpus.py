"""The built-in corpus: which files, and a split that depends only on each file's path."""

from pathlib import Path

import pytest

from lm_train.data.corpus import in_validation, split_stdlib, stdlib_files


def make_tree(root: Path) -> None:
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/test/c.py",
        "tests/d.py",
        "pkg/idle_test/e.py",
        "empty.py",
        "x/site-packages/f.py",
    ]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("" if rel == "empty.py" else f"# {rel}\n")
    for i in range(200):
        (root / "many").mkdir(exist_ok=True)
        (root / "many" / f"m{i:03d}.py").write_text(f"x = {i}\n")


def test_files_skip_tests_empty_and_site_packages(tmp_path):
    make_tree(tmp_path)
    names = [f.relative_to(tmp_path).as_posix() for f in stdlib_files(tmp_path)]
    assert names[:2] == ["a.py", "many/m000.py"]
    assert "pkg/b.py" in names
    assert not any("test" in n or "site-packages" in n or n == "empty.py" for n in names)
    assert names == sorted(names)


def test_split_is_disjoint_deterministic_and_by_path(tmp_path):
    make_tree(tmp_path)
    split = split_stdlib(0.1, tmp_path)
    again = split_stdlib(0.1, tmp_path)
    assert split == again
    assert not set(split.train) & set(split.validation)
    assert len(split.train) + len(split.validation) == len(stdlib_files(tmp_path))
    assert 5 <= len(split.validation) <= 40  # about 10% of 202 files
    for f in split.validation:
        assert in_validation(f.relative_to(tmp_path).as_posix(), 0.1)


def test_real_stdlib_is_about_twelve_megabytes():
    split = split_stdlib(0.02)
    size = sum(f.stat().st_size for f in split.train + split.validation)
    assert 5e6 < size < 30e6
    assert 5 < len(split.validation) < 60


def test_empty_root_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="looks incomplete"):
        split_stdlib(0.02, tmp_path)
