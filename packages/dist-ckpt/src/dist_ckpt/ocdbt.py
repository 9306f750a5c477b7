"""Several processes writing one OCDBT database: process 0 runs tensorstore's coordinator for the save."""

import json
import socket
import time
from pathlib import Path
from typing import Any

import tensorstore as ts

from dist_ckpt.errors import CheckpointError
from dist_ckpt.layout import write_json_atomically

ADDRESS_FILE = ".ocdbt-coordinator.json"


def start_coordinator(checkpoint: Path) -> Any:
    """Start a coordinator on this host and publish its address in the checkpoint directory (process 0).

    The returned server must be kept alive until every process has finished writing.
    """
    server = ts.ocdbt.DistributedCoordinatorServer({"bind_addresses": ["0.0.0.0:0"]})
    write_json_atomically(checkpoint / ADDRESS_FILE, {"address": f"{socket.gethostname()}:{server.port}"})
    return server


def coordinator_address(checkpoint: Path, timeout: float = 60.0) -> str:
    """The address process 0 published for this save's coordinator (read after the start barrier)."""
    deadline = time.monotonic() + timeout
    while not (checkpoint / ADDRESS_FILE).exists():
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{checkpoint / ADDRESS_FILE} did not appear within {timeout:.0f} s: process 0 publishes the OCDBT "
                "coordinator address there. Every process must see the same checkpoint directory (a shared file "
                "system); otherwise save with ocdbt=False."
            )
        time.sleep(0.02)
    return json.loads((checkpoint / ADDRESS_FILE).read_text())["address"]
