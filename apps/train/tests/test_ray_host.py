"""The Ray actor's working directory when another node's agent unpacked the shipped folder again under it."""

import os
import shutil
from pathlib import Path

import pytest

from lm_train.launch.ray_host import _shipped_folder


def test_an_actor_left_in_a_removed_folder_finds_the_new_copy_by_its_name(tmp_path, monkeypatch):
    folder = tmp_path / "_ray_pkg_0123"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PWD", str(folder))  # as Ray's `cd <folder> &&` leaves it
    shutil.rmtree(folder)  # what the second node's agent does before it unpacks
    with pytest.raises(FileNotFoundError):
        os.getcwd()
    folder.mkdir()
    (folder / "config.yaml").write_text("shipped\n")

    assert _shipped_folder() == str(folder)
    assert Path("config.yaml").read_text() == "shipped\n"  # the process now works in the new copy


def test_without_a_folder_by_that_name_the_error_is_raised(tmp_path, monkeypatch):
    folder = tmp_path / "_ray_pkg_0123"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("PWD", str(folder))
    folder.rmdir()
    with pytest.raises(FileNotFoundError):
        _shipped_folder()
