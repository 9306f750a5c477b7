"""Fixtures for the trackers tests: isolated wandb directories and a reader for wandb's offline run file."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

_BLOCK_SIZE = 32768  # the .wandb file uses LevelDB's log framing: 32 KiB blocks
_RECORD_HEADER = 7  # crc32c (4 bytes), length (2), chunk type (1)
_FILE_HEADER = 7  # ":W&B", a 2-byte magic and a version byte
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_payloads(data: bytes) -> list[bytes]:
    """Reassemble the protobuf payloads of a .wandb file from its LevelDB-log chunks."""
    assert data[:4] == b":W&B", "not a wandb run file"
    payloads: list[bytes] = []
    pending = b""
    position = _FILE_HEADER
    while position + _RECORD_HEADER <= len(data):
        room_in_block = _BLOCK_SIZE - position % _BLOCK_SIZE
        if room_in_block < _RECORD_HEADER:
            position += room_in_block  # block trailer padding
            continue
        length, kind = struct.unpack_from("<HB", data, position + 4)
        chunk = data[position + _RECORD_HEADER : position + _RECORD_HEADER + length]
        position += _RECORD_HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == _FULL:
            payloads.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            payloads.append(pending + chunk)
            pending = b""
    return payloads


def read_wandb_run(run_file: Path) -> dict[str, Any]:
    """History rows, summary, config and run info from an offline .wandb file, parsed with wandb's protos."""
    from wandb.proto import wandb_internal_pb2

    def item_key(item: Any) -> str:
        return item.key or "/".join(item.nested_key)

    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    run: Any = None
    artifacts: list[Any] = []
    for payload in _wandb_payloads(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                summary[item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[item_key(item)] = json.loads(item.value_json)
        elif kind == "run":
            run = record.run
        elif kind == "artifact":
            artifacts.append(record.artifact)
    return {"history": history, "summary": summary, "config": config, "run": run, "artifacts": artifacts}


@pytest.fixture
def wandb_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point every wandb directory at the test's tmp path; returns the WANDB_DIR."""
    root = tmp_path / "wandb-home"
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        path = root / variable.lower()
        path.mkdir(parents=True)
        monkeypatch.setenv(variable, str(path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return root / "wandb_dir"


@pytest.fixture
def wandb_reader():
    """The offline .wandb file reader, for tests."""
    return read_wandb_run
