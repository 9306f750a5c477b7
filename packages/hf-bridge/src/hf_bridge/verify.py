"""Checking an export after writing it, before it is published: what was stored is what was meant.

The index is read back and compared; each file's size and header bytes are compared with what was written;
and a few tensors are read back and their bytes compared (CRC-32) with the data made from the model's
arrays: the first tensor of the export and the last of every file, so that each file's end is read.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

from .errors import HfBridgeError
from .reader import INDEX_FILE, parse_json
from .sources import Location
from .writer import WrittenFile

READ_PIECE = 8 * 2**20


class NamesFiles(Protocol):
    """What names a file in a message: a Location or an export's OutputDir."""

    def where(self, name: str) -> str: ...


def verify_export(written: Location, files: Sequence[WrittenFile], shown: NamesFiles) -> None:
    """Raise a clear error naming the file when what `written` holds differs from `files`.

    `shown` names the files in messages (the destination, which a local export is renamed to).
    """

    def fail(name: str, what: str) -> HfBridgeError:
        return HfBridgeError(
            f"Checking the export after writing it failed: {shown.where(name)} {what}. The export was not "
            f"published. The storage did not keep what was written: check it (disk, file system, bucket) and "
            "export again."
        )

    if len(files) > 1:
        index = parse_json(written.read_bytes(INDEX_FILE), shown.where(INDEX_FILE))
        expected = {e.key: f.name for f in files for e in f.entries}
        if not isinstance(index, dict) or index.get("weight_map") != expected:
            raise fail(INDEX_FILE, "does not map the tensors to the files they were written to")
        total = sum(e.end - e.begin for f in files for e in f.entries)
        if index.get("metadata", {}).get("total_size") != total:
            raise fail(INDEX_FILE, f"does not give the total size {total}")
    for f in files:
        size = written.size(f.name)
        if size != f.size:
            raise fail(f.name, f"has {size} bytes where {f.size} were written")
        if bytes(written.read_range(f.name, 0, len(f.header))) != f.header:
            raise fail(f.name, "has a header that differs from the one written")
    for f, entry in _spot_checks(files):
        start = len(f.header) + entry.begin
        crc = 0
        for piece in range(start, len(f.header) + entry.end, READ_PIECE):
            crc = zlib.crc32(written.read_range(f.name, piece, min(piece + READ_PIECE, len(f.header) + entry.end)), crc)
        if crc != f.crc32[entry.key]:
            raise fail(f.name, f"holds other bytes for tensor {entry.key!r} than the model's")


def _spot_checks(files: Sequence[WrittenFile]):
    """The tensors read back: the first of the export and the last of each file."""
    chosen = []
    for i, f in enumerate(files):
        if not f.entries:
            continue
        if i == 0 and len(f.entries) > 1:
            chosen.append((f, f.entries[0]))
        chosen.append((f, f.entries[-1]))
    return chosen
