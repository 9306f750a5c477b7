"""Several processes writing one OCDBT database: process 0 runs tensorstore's coordinator for the save."""

import json
import socket
import time
from typing import Any

import tensorstore as ts

from dist_ckpt.errors import CheckpointError
from dist_ckpt.location import Location
from dist_ckpt.objects import read_bytes, write_json

ADDRESS_FILE = ".ocdbt-coordinator.json"


def start_coordinator(checkpoint: Location) -> Any:
    """Start a coordinator on this host and publish its address in the checkpoint directory (process 0).

    The returned server must be kept alive until every process has finished writing.
    """
    server = ts.ocdbt.DistributedCoordinatorServer({"bind_addresses": ["0.0.0.0:0"]})
    write_json(checkpoint, ADDRESS_FILE, {"address": f"{socket.gethostname()}:{server.port}"})
    return server


def coordinator_address(checkpoint: Location, timeout: float = 60.0) -> str:
    """The address process 0 published for this save's coordinator (read after the start barrier)."""
    deadline = time.monotonic() + timeout
    while (published := read_bytes(checkpoint, ADDRESS_FILE)) is None:
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{checkpoint.url_of(ADDRESS_FILE)} did not appear within {timeout:.0f} s: process 0 publishes the "
                "OCDBT coordinator address there. Every process must see the same checkpoint storage (a shared "
                "file system or bucket); otherwise save with ocdbt=False."
            )
        time.sleep(0.02)
    return json.loads(published)["address"]
