"""`trainer.ray`: which processes of a run start a Ray node, where the head is, and the checks on its keys.

The cluster itself is started by real processes in tests-integration/test_multiprocess.py.
"""

import os

import pytest

from lm_train.config.trainer_config import RayClusterConfig
from lm_train.data.ray_cluster import coordinator_host, node_leaders, start_cluster
from lm_train.errors import ConfigError
from lm_train.run.distributed import DistributedInfo


def test_every_process_leads_a_node_when_asked_and_one_process_needs_no_gather():
    four = DistributedInfo(2, 4, "explicit", "10.0.0.1:1234")
    assert node_leaders(four, "process") == [0, 1, 2, 3]
    assert node_leaders(DistributedInfo(0, 1, "single"), "host") == [0]


def test_the_head_is_on_the_coordinators_host():
    assert coordinator_host(DistributedInfo(1, 2, "explicit", "node-7.cluster:8476")) == "node-7.cluster"
    assert coordinator_host(DistributedInfo(1, 2, "explicit", "[fd00::1]:8476")) == "fd00::1"
    assert coordinator_host(DistributedInfo(1, 2, "auto-detected")) is None  # shard-cache finds it (SLURM, TPU)


def test_a_given_address_is_joined_and_nothing_is_started(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "set")  # so that the teardown restores what was there, absent included
    monkeypatch.delenv("RAY_ADDRESS")
    single = DistributedInfo(0, 1, "single")
    assert start_cluster(RayClusterConfig(), single) is None
    assert "RAY_ADDRESS" not in os.environ  # one process: a local Ray starts when a build needs one
    assert start_cluster(RayClusterConfig(address="10.1.2.3:6379"), single) is None
    assert os.environ["RAY_ADDRESS"] == "10.1.2.3:6379"
    # off: a multi-process run builds on process 0's host, and no collective is entered to find the hosts
    assert start_cluster(RayClusterConfig(auto_start_cluster=False), DistributedInfo(1, 4, "explicit")) is None
    assert start_cluster(RayClusterConfig(start_workers=False), DistributedInfo(1, 4, "explicit")) is None


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"node_per": "rack"}, r"trainer\.ray\.node_per must be one of host, process, got 'rack'"),
        ({"port": 0}, r"trainer\.ray\.port must be a TCP port"),
        ({"num_cpus": 0}, r"trainer\.ray\.num_cpus must be at least 1"),
    ],
)
def test_bad_keys_are_named(keys, message):
    with pytest.raises(ConfigError, match=message):
        RayClusterConfig(**keys)
