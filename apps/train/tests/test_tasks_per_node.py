"""Several training processes per node (`lm-train launch --tasks-per-node`): the sbatch script's tasks and ids, and
each process's share of its node's GPUs (the SLURM cluster run is in tests-integration/test_launch_slurm.py)."""

import shlex
from pathlib import Path

import pytest

from lm_train.config.schema import LaunchRecord
from lm_train.errors import ConfigError
from lm_train.launch.prepared import PreparedLaunch, passed_env
from lm_train.launch.slurm_script import SlurmJob, batch_script
from lm_train.run.distributed import local_device_ids


def test_each_process_gets_its_share_of_the_nodes_gpus():
    local = {"LM_TRAIN_LOCAL_PROCESS_COUNT": "4"}
    assert [local_device_ids({**local, "LM_TRAIN_LOCAL_PROCESS_ID": str(i)}, 8) for i in range(4)] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert local_device_ids({"LM_TRAIN_LOCAL_PROCESS_COUNT": "8", "LM_TRAIN_LOCAL_PROCESS_ID": "5"}, 8) == [5]
    # One process per node, no GPU (CPU devices are each process's own), or GPUs already chosen: every device.
    assert local_device_ids({}, 8) is None and local_device_ids({"LM_TRAIN_LOCAL_PROCESS_COUNT": "1"}, 8) is None
    assert local_device_ids({**local, "LM_TRAIN_LOCAL_PROCESS_ID": "1"}, 0) is None
    assert local_device_ids({**local, "LM_TRAIN_LOCAL_PROCESS_ID": "1", "CUDA_VISIBLE_DEVICES": "3"}, 8) is None
    with pytest.raises(ConfigError, match=r"has 6 GPUs, which its 4 processes \(--tasks-per-node 4\) cannot share"):
        local_device_ids({**local, "LM_TRAIN_LOCAL_PROCESS_ID": "0"}, 6)


def test_the_sbatch_script_starts_the_tasks_of_each_node_with_ids_node_by_node(tmp_path):
    prepared = PreparedLaunch("r", tmp_path / "run", tmp_path / "ship", ("src",), {}, str(tmp_path), LaunchRecord("x"))
    job = SlurmJob(3, tmp_path / "job", tasks_per_node=4)
    script = batch_script(prepared, job, "lm-train-r")
    assert job.processes == 12 and "\n#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=4\n" in script
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert srun[1:3] == ["--nodes=3", "--ntasks-per-node=4"] and "--distribution=block" in srun
    assert 'export LM_TRAIN_NUM_PROCESSES="$((SLURM_NNODES * 4))" LM_TRAIN_LOCAL_PROCESS_COUNT=4\n' in script
    task = srun[srun.index("-c") + 1]
    assert task.startswith('export LM_TRAIN_PROCESS_ID="$SLURM_PROCID" LM_TRAIN_LOCAL_PROCESS_ID="$SLURM_LOCALID"; ')
    # One task per node: the script as before (SLURM's default distribution).
    single = batch_script(prepared, SlurmJob(3, tmp_path / "job"), "lm-train-r")
    assert "--distribution" not in single and "LM_TRAIN_LOCAL_PROCESS_COUNT=1" in single


def test_the_launchers_per_process_variables_are_never_the_callers():
    environ = {"LM_TRAIN_LOCAL_PROCESS_ID": "1", "LM_TRAIN_LOCAL_PROCESS_COUNT": "2", "LM_TRAIN_STEP_DELAY_S": "1"}
    assert passed_env(environ) == {"LM_TRAIN_STEP_DELAY_S": "1"}
    prepared = PreparedLaunch("r", Path("/r"), Path("/s"), ("src",), passed_env(environ), "/", LaunchRecord("ray"))
    env = prepared.process_env("/w", 3, 4, "h:1", (1, 2))
    assert {k: env[k] for k in env if k.startswith("LM_TRAIN_")} == {
        "LM_TRAIN_STEP_DELAY_S": "1",
        "LM_TRAIN_COORDINATOR_ADDRESS": "h:1",
        "LM_TRAIN_NUM_PROCESSES": "4",
        "LM_TRAIN_PROCESS_ID": "3",
        "LM_TRAIN_LOCAL_PROCESS_ID": "1",
        "LM_TRAIN_LOCAL_PROCESS_COUNT": "2",
    }
