"""`lm-train launch ray` refuses bad input in one paragraph, exit status 2, before anything is shipped or written;
none of these needs a Ray cluster (those that do are in test_launch_ray.py)."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
from pathlib import Path

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


def test_no_cluster_given_bad_counts_and_a_run_that_would_not_resume(cli, tiny_project, tmp_path):
    message = launch(cli, tiny_project, tmp_path, "--hosts", "2", env={"RAY_ADDRESS": ""})
    assert "No Ray cluster given: pass --address HEAD:6379" in message
    message = launch(cli, tiny_project, tmp_path, "--hosts", "2", "--min-hosts", "3", "--address", "x:1")
    assert message == "error: --min-hosts must be between 1 and --hosts 2, got 3."
    message = launch(
        cli, tiny_project, tmp_path, "--hosts", "2", "--address", "x:1", "--trainer.load_checkpoint", "false"
    )
    assert (
        "trainer.load_checkpoint: false would make every restart of a launched run start again from step 0" in message
    )


def test_the_tpu_dry_run_prints_the_exact_gcloud_lines(cli, tiny_project):
    args = ["launch", "tpu", str(tiny_project.config), "--tpu", "pod-1", "--zone", "us-central2-b", "--dry-run"]
    args += ["--project", "lab", "--trainer.id", "tpu-run", "--trainer.num_train_steps", "5"]
    result = cli(args, tiny_project.root, env={"WANDB_MODE": "offline", "LM_TRAIN_PROCESS_ID": "7"})
    assert result.returncode == 0, result.output[-3000:]
    clear, scp, start = (shlex.split(line) for line in result.stdout.strip().splitlines())
    gcloud = ["gcloud", "compute", "tpus", "tpu-vm"]
    where = ["--project=lab", "--zone=us-central2-b"]
    folder = "lm-train-launch/tpu-run"
    assert clear == [
        *gcloud,
        "ssh",
        *where,
        "pod-1",
        "--worker=all",
        f"--command=rm -rf $HOME/{folder} && mkdir -p $HOME/{folder}",
    ]
    shipped = Path(scp[-2].removesuffix("/."))
    assert scp == [*gcloud, "scp", *where, "--worker=all", "--recurse", f"{shipped}/.", f"pod-1:{folder}"]
    # The folder holds this checkout's code and the resolved config, with the commit recorded.
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    config = (shipped / "lm-train-launch" / "config.yaml").read_text(encoding="utf-8")
    assert f"commit: {head.stdout.strip()}" in config and "num_train_steps: 5" in config and "id: tpu-run" in config
    assert (shipped / "apps" / "train" / "src" / "lm_train" / "launch" / "tpu_commands.py").is_file()
    assert start[:7] == [*gcloud, "ssh", *where]
    assert start[7:9] == ["pod-1", "--worker=all"]
    remote = start[9].removeprefix("--command=")
    assert remote.startswith(f"cd $HOME/{folder} && env ")
    # The caller's run variables reach every worker; process ids do not (jax reads the slice's own).
    assert "WANDB_MODE=offline" in remote and "LM_TRAIN_PROCESS_ID" not in remote
    assert "$PWD/apps/train/src:" in remote
    assert remote.endswith(" python3 -m lm_train run lm-train-launch/config.yaml")
    assert not (tiny_project.root / "runs" / "tpu-run").exists()  # a dry run writes nothing of the run
    shutil.rmtree(shipped)  # a dry run leaves the folder for the scp line; this test has read it


def test_the_slurm_dry_run_prints_the_sbatch_script(cli, tiny_project):
    args = ["launch", "slurm", str(tiny_project.config), "--hosts", "2", "--partition", "gpu", "--time", "1:00:00"]
    args += ["--dry-run", "--trainer.id", "slurm-run", "--trainer.run_dir", "/shared/runs/x"]
    result = cli(args, tiny_project.root, env={"WANDB_MODE": "offline", "LM_TRAIN_PROCESS_ID": "7"})
    assert result.returncode == 0, result.output[-3000:]
    script = result.stdout
    job_dir = "/shared/runs/x/slurm/launch-DRY-RUN"
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--requeue", "--partition=gpu", "--time=1:00:00"):
        assert f"\n#SBATCH {directive}\n" in script, directive
    assert "\n#SBATCH --signal=TERM@120\n" in script and f"#SBATCH --output={job_dir}/slurm-%j.out" in script
    # The caller's run variables are exported; the launcher's own are set per start (ids from SLURM_PROCID).
    assert "\nexport WANDB_MODE=offline\n" in script and "LM_TRAIN_PROCESS_ID=7" not in script
    assert "\nunset LM_TRAIN_COORDINATOR_ADDRESS LM_TRAIN_NUM_PROCESSES LM_TRAIN_PROCESS_ID\n" in script
    assert f'export PYTHONPATH="{job_dir}/code/apps/train/src:' in script
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert srun[:7] == [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--wait=120",
        "--open-mode=append",
        f"--output={job_dir}/process-%t.log",
    ]
    assert srun[7:9] == ["bash", "-c"] and 'LM_TRAIN_PROCESS_ID="$SLURM_PROCID"' in srun[9]
    assert srun[-4:] == ["-m", "lm_train", "run", f"{job_dir}/code/lm-train-launch/config.yaml"]
    assert not Path("/shared/runs/x").exists()  # a dry run writes nothing of the run


def test_slurm_commands_missing_and_bad_counts_are_named_with_the_fix(cli, tiny_project, tmp_path):
    run_dir = tmp_path / "run"
    base = ["launch", "slurm", str(tiny_project.config), "--trainer.run_dir", str(run_dir)]
    result = cli([*base, "--hosts", "2"], tiny_project.root, env={"PATH": str(tmp_path)})
    assert result.returncode == 2 and "Traceback" not in result.output, result.output[-3000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("error: `sinfo` is not installed here, so SLURM cannot be reached.")
    assert "Run `lm-train launch slurm` on a login node of the cluster" in message
    result = cli([*base, "--hosts", "0"], tiny_project.root)
    assert result.returncode == 2 and "--hosts must be at least 1 (got 0)" in result.stderr
    assert not run_dir.exists()
