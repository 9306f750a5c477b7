"""DeepSeek-V3's multi-token prediction with packing or context parallelism: refused by the config checks, from the
CLI, before anything is read or compiled (the model itself would only fail while tracing the step)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lm_train.cli.app import app

NANO = Path(__file__).parents[3] / "configs" / "deepseek_v3_nano.yaml"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--data.pack", "true"],
            r"but data\.pack: true puts several documents in each sequence.*set data\.pack: false",
        ),
        (["--trainer.context_axis_size", "2"], r"but trainer\.context_axis_size=2 .*splits each sequence over 2"),
    ],
)
def test_mtp_with_packing_or_context_parallelism_exits_2_before_the_run_starts(
    tmp_path, monkeypatch, overrides, message
):
    import lm_train.run.loop

    def must_not_start(*args):
        raise AssertionError("the run went on to data, state and compile")

    monkeypatch.setattr(lm_train.run.loop, "_train", must_not_start)
    args = ["run", str(NANO), "--trainer.run_dir", str(tmp_path / "run"), *overrides]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "model.mtp_depth=1: DeepSeek-V3's multi-token prediction reads the tokens ahead" in line
    assert re.search(message, line), line
    assert not (tmp_path / "run").exists()
    # Without the MTP depth the same run passes these checks (and would start: _train is reached).
    result = CliRunner().invoke(app, [*args, "--model.mtp_depth", "0"])
    assert isinstance(result.exception, AssertionError) and "went on to data" in str(result.exception)
