"""One Ray cluster over the hosts of a multi-process run, so that its cache builds use every host's CPUs.

Process 0's host runs the head; the first process of every other host starts a worker node that joins it
(`trainer.ray.node_per: process`: every process does). A single host needs no cluster: process 0's build
starts a local Ray when it needs one, as in a single-process run, and a run whose caches are built starts none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

from lm_train.config.trainer_config import RayClusterConfig
from lm_train.run.distributed import DistributedInfo
from lm_train.errors import UserError


def node_leaders(dist: DistributedInfo, node_per: str) -> list[int]:
    """The processes that start a Ray node, in process order (process 0 first): the first of each host."""
    if node_per == "process" or dist.process_count == 1:
        return list(range(dist.process_count))
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.frombuffer(hashlib.sha256(socket.gethostname().encode("utf-8")).digest(), np.uint8)
    hosts = np.asarray(multihost_utils.process_allgather(mine)).reshape(dist.process_count, -1)
    first: dict[bytes, int] = {}
    for index, host in enumerate(hosts):
        first.setdefault(host.tobytes(), index)
    return sorted(first.values())


def coordinator_host(dist: DistributedInfo) -> str | None:
    """The host of process 0 from jax.distributed's coordinator address; None: shard-cache finds it (SLURM, TPU)."""
    if not dist.coordinator_address:
        return None
    host = dist.coordinator_address.rsplit(":", 1)[0]
    return host.strip("[]") or None


def _say(dist: DistributedInfo, text: str) -> None:
    if dist.process_index == 0:
        print(text, file=sys.stderr, flush=True)


def start_cluster(config: RayClusterConfig, dist: DistributedInfo) -> Any:
    """This process's part of the run's Ray cluster (a shard_cache.RayCluster), or None where it starts no node."""
    if config.address:
        os.environ["RAY_ADDRESS"] = config.address  # builds join it; nothing is started here
        _say(dist, f"ray: cache builds run on the Ray cluster at {config.address} (trainer.ray.address)")
        return None
    if dist.process_count == 1 or not (config.auto_start_cluster and config.start_workers):
        return None  # one process starts a local Ray when a build needs one
    leaders = node_leaders(dist, config.node_per)  # a collective: before anything that may differ by process
    if os.environ.get("RAY_ADDRESS"):
        return None  # a given cluster is used as is
    if len(leaders) == 1 or dist.process_index not in leaders:
        return None  # one host: process 0's build starts a local Ray on demand; other processes start nothing
    import shard_cache

    node = leaders.index(dist.process_index)
    try:
        cluster = shard_cache.start_ray_cluster(
            node, len(leaders), coordinator_host(dist), port=config.port, num_cpus=config.num_cpus
        )
    except shard_cache.ShardCacheError as e:
        raise UserError(
            f"{str(e).rstrip('.')}. (lm-train makes one Ray cluster of the run's {len(leaders)} "
            f"{config.node_per}s for its cache builds: set trainer.ray.port to a free port, trainer.ray.address to a "
            "running cluster, or trainer.ray.auto_start_cluster: false to build on process 0's host alone.)"
        ) from None
    _say(
        dist,
        f"ray: one cluster of {len(leaders)} nodes (one per {config.node_per}) at {cluster.address}; cache builds "
        "run on all of them",
    )
    return cluster


@contextlib.contextmanager
def ray_cluster(config: RayClusterConfig, dist: DistributedInfo) -> Iterator[Any]:
    """The run's Ray cluster while the run lasts; every node stops once every process is done with it."""
    cluster = start_cluster(config, dist)
    if cluster is None:
        yield None
        return
    try:
        yield cluster
    except BaseException:
        cluster.shutdown()  # a failed process's node stops with it; the others' builds retry or fail loudly
        raise
    from jax.experimental import multihost_utils

    # No node stops while process 0's build may still run a task on it: its builds are stopped by now.
    multihost_utils.sync_global_devices("lm_train.data.ray_cluster.shutdown")
    cluster.shutdown()
