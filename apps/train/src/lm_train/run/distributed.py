"""Multi-process start-up through jax.distributed, with a clear word on which mode was chosen and why."""

from __future__ import annotations

import atexit
import glob
import itertools
import logging
import os
import shutil
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax

from lm_train.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedInfo:
    process_index: int
    process_count: int
    mode: str
    coordinator_address: str | None = None  # host:port of process 0, when given (flags or LM_TRAIN_* env)


_decided: DistributedInfo | None = None


def initialize_distributed(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> DistributedInfo:
    """Join a multi-process run when asked (flags or LM_TRAIN_* env) or detected (SLURM, TPU, Open MPI).

    The first call decides; later calls in the same process return its answer.
    """
    global _decided
    if _decided is not None:
        return _decided
    coordinator_address = coordinator_address or os.environ.get("LM_TRAIN_COORDINATOR_ADDRESS")
    if num_processes is None and "LM_TRAIN_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["LM_TRAIN_NUM_PROCESSES"])
    if process_id is None and "LM_TRAIN_PROCESS_ID" in os.environ:
        process_id = int(os.environ["LM_TRAIN_PROCESS_ID"])
    if jax.distributed.is_initialized():
        return DistributedInfo(jax.process_index(), jax.process_count(), "already initialized")
    if coordinator_address is not None:
        given = num_processes is not None and process_id is not None
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids(os.environ, node_gpus()),
            # Everything given (as `lm-train launch` does): jax's cluster detection would only add, inside a SLURM
            # step, local_device_ids=[SLURM_LOCALID], hiding all but one GPU of a node from its one process.
            cluster_detection_method="deactivate" if given else None,
        )
        mode = f"explicit: coordinator {coordinator_address}, {num_processes} processes"
    elif _cluster_detected():
        jax.distributed.initialize()
        mode = "auto-detected cluster (SLURM / TPU / Open MPI)"
    else:
        mode = "single process: no coordinator given, no cluster found"
    if jax.distributed.is_initialized():
        # Shut down before jax's own exit hook (registered at `import jax`, so it runs after this one), which
        # clears the CPU backend, with its gloo connections to the other processes, before it shuts the
        # coordination service down: the likely cause of a CI hang where process 0 never exited once process 1
        # had. Here every process meets at the shutdown barrier with its backend whole, and process 0 stops the
        # service after its own client. Completed multi-host runs hit the same gap at exit upstream
        # (marin-community/marin#8276, #8392; its fix, #8295, is this one).
        atexit.register(jax.distributed.shutdown)
    info = _decided = DistributedInfo(jax.process_index(), jax.process_count(), mode, coordinator_address)
    if info.process_index == 0:
        # Printed, not logged: silent single-host fallbacks are what confuse people on clusters.
        processes, devices = info.process_count, jax.device_count()
        counts = f"{processes} process{'es' * (processes > 1)}, {devices} {jax.devices()[0].platform} device"
        print(_to_the_terminal(f"distributed: {counts}{'s' * (devices > 1)} ({mode})"), file=sys.stderr, flush=True)
    return info


_barriers = itertools.count()  # every process passes the same barriers in the same order: same names everywhere


def wait_for_every_process(name: str, timeout_s: float = 3600.0) -> None:
    """Block until every process is here: a host-side barrier in jax's coordination service (no device collective,
    so no collective's rendezvous timeout: one host may arrive far later, e.g. after a slower compile)."""
    if jax.process_count() == 1:
        return
    coordination_client().wait_at_barrier(f"lm_train/{name}/{next(_barriers)}", int(timeout_s * 1000))


def coordination_client() -> Any:
    """jax's coordination-service client (key-value store and barriers) of a multi-process run."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "jax's coordination service is not running in this process: host-side exchanges between processes need "
            "jax.distributed.initialize() first (lm-train calls it when a run has more than one process)."
        )
    return client


def local_device_ids(environ: Mapping[str, str], node_gpus: int) -> list[int] | None:
    """This process's share of its node's `node_gpus` GPUs when the launcher started several processes per node
    (LM_TRAIN_LOCAL_PROCESS_ID of LM_TRAIN_LOCAL_PROCESS_COUNT, from --tasks-per-node); None to see every device.

    None, too, where CUDA_VISIBLE_DEVICES is set (the scheduler, e.g. SLURM's --gpus-per-task, or the user chose
    this process's GPUs already) and where the node has no NVIDIA GPU (CPU devices are each process's own)."""
    count = int(environ.get("LM_TRAIN_LOCAL_PROCESS_COUNT", "1"))
    if count <= 1 or "CUDA_VISIBLE_DEVICES" in environ or node_gpus == 0:
        return None
    if node_gpus % count:
        raise ConfigError(
            f"This node has {node_gpus} GPUs, which its {count} processes (--tasks-per-node {count}) cannot share "
            f"evenly. Launch with a --tasks-per-node that divides {node_gpus} (one process per GPU: "
            f"--tasks-per-node {node_gpus})."
        )
    local, share = int(environ.get("LM_TRAIN_LOCAL_PROCESS_ID", "0")), node_gpus // count
    return list(range(local * share, (local + 1) * share))


def node_gpus() -> int:
    """The node's NVIDIA GPUs, counted before jax starts a backend (too late to restrict): one /dev/nvidiaN each."""
    return len([p for p in glob.glob("/dev/nvidia*") if p.removeprefix("/dev/nvidia").isdigit()])


def _to_the_terminal(text: str) -> str:
    """`text` wrapped to the terminal's width when stderr is one (a log file keeps it on one line)."""
    if not sys.stderr.isatty():
        return text
    return "\n  ".join(textwrap.wrap(text, width=max(shutil.get_terminal_size().columns - 3, 20)))


def _cluster_detected() -> bool:
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ
    mpi = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    tpu_env = ("TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "TPU_WORKER_ID", "CLOUD_TPU_TASK_ID")
    # A Cloud TPU VM has TPU chips as /dev/accel* (v2-v4) or /dev/vfio/* (v5+); jax's own detection then finds
    # the slice's other hosts (on a single host it simply runs one process).
    tpu = any(name in os.environ for name in tpu_env) or bool(glob.glob("/dev/accel*")) or _has_vfio_tpu()
    return slurm or mpi or tpu


def _has_vfio_tpu() -> bool:
    return bool(glob.glob("/dev/vfio/[0-9]*")) and "TPU_ACCELERATOR_TYPE" in os.environ
