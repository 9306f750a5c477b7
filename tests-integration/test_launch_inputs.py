"""`lm-train launch ray` refuses bad input in one paragraph, exit status 2, before anything is shipped or written;
none of these needs a Ray cluster (those that do are in test_launch_ray.py)."""

from __future__ import annotations

import socket
import subprocess

import pytest


@pytest.fixture(scope="module")
def nowhere() -> str:
    """An address where no Ray cluster answers (a port that was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def launch(cli, tiny_project, tmp_path, *args: str, env: dict[str, str] | None = None):
    run_dir = tmp_path / "run"
    result = cli(
        ["launch", "ray", str(tiny_project.config), *args, "--trainer.run_dir", str(run_dir)],
        tiny_project.root,
        env=env,
    )
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output
    assert not run_dir.exists()  # nothing written
    return result.stderr.strip().splitlines()[-1]


def test_an_unreachable_address_is_named_with_the_fix(cli, tiny_project, tmp_path, nowhere):
    message = launch(cli, tiny_project, tmp_path, "--hosts", "2", "--address", nowhere)
    assert message.startswith(f"error: Cannot reach the Ray cluster at {nowhere} (--address, else $RAY_ADDRESS)")
    assert "ray start --head" in message


def test_a_config_that_fails_validation_is_caught_before_the_cluster_is_tried(cli, tiny_project, tmp_path, nowhere):
    message = launch(
        cli, tiny_project, tmp_path, "--hosts", "2", "--address", nowhere, "--trainer.num_train_steps", "0"
    )
    # The same error as `lm-train run` gives, and not the unreachable cluster's: the config was checked first.
    assert message.startswith("error: ") and "tiny.yaml" in message
    assert message.endswith("trainer.num_train_steps must be at least 1, got 0.")


def test_a_dirty_checkout_is_refused_with_require_clean(cli, tiny_project, tmp_path, nowhere):
    repo = tmp_path / "checkout"
    repo.mkdir()
    (repo / "code.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    (repo / "code.py").write_text("x = 2\n")
    args = ["--hosts", "2", "--address", nowhere, "--source", str(repo), "--require-clean"]
    message = launch(cli, tiny_project, tmp_path, *args)
    assert f"The checkout {repo} has uncommitted changes (code.py) and --require-clean was given" in message


def test_no_cluster_given_and_bad_counts(cli, tiny_project, tmp_path):
    message = launch(cli, tiny_project, tmp_path, "--hosts", "2", env={"RAY_ADDRESS": ""})
    assert "No Ray cluster given: pass --address HEAD:6379" in message
    message = launch(cli, tiny_project, tmp_path, "--hosts", "2", "--min-hosts", "3", "--address", "x:1")
    assert message == "error: --min-hosts must be between 1 and --hosts 2, got 3."
