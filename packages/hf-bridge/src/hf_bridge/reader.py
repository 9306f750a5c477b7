"""Reading safetensors checkpoints (one file or a sharded index) tensor by tensor, or row range by row range.

Every file's header is read and checked when the reader opens (a few KB each, one ranged read at a URL), so a
truncated, damaged or missing file is reported, naming it, before any weight is loaded. Tensors are then read
as byte ranges: only the rows (indices of the first axis) that the caller asks for.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from .errors import HfBridgeError
from .sources import Location
from .st_format import Entry, Header, header_length, parse_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Formats that need unpickling or another framework to read: hf_bridge refuses them and says how to convert.
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# The first read of a file fetches this much, which holds the whole header of any checkpoint of ours.
HEADER_PROBE = 64 * 1024

log = logging.getLogger("hf_bridge")


def refuse_unsafe_formats(where: str, names: Iterable[str]) -> None:
    """Raise a conversion hint when a checkpoint has only pickled (or TF/Flax) weights."""
    unsafe = sorted(n for n in names if n.endswith(UNSAFE_SUFFIXES))
    if unsafe:
        raise HfBridgeError(
            f"{where} has no safetensors weights, only {unsafe[:3]}. hf_bridge never unpickles (a pickle can run "
            "arbitrary code), so convert the checkpoint to safetensors first, e.g. in a trusted environment: "
            "`transformers.AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`, "
            "then load `out`."
        )


def parse_json(raw: bytes, where: str) -> Any:
    """The content of a JSON file's bytes; a clear error naming the file when it is malformed."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HfBridgeError(f"{where} is not valid JSON ({e}); fix or regenerate the file.") from None


def read_json(location: Location, name: str, *, needed_by: str = "a Hugging Face checkpoint directory") -> Any:
    """A JSON file's content; a clear error naming the file when it is missing or malformed."""
    if not location.exists(name):
        hint = ""
        if name == CONFIG_FILE and (location.exists(INDEX_FILE) or location.exists(SINGLE_FILE)):
            # Exports write config.json last: weights without it are what an interrupted export leaves.
            hint = " The weights are there, so this looks like an export that was interrupted: export it again."
        raise HfBridgeError(f"{location.where(name)} does not exist; {needed_by} needs it.{hint}")
    return parse_json(location.read_bytes(name), location.where(name))


def weight_map(location: Location) -> dict[str, str]:
    """Tensor name -> file name of a checkpoint (sharded index or single file); errors say what is wrong."""
    if location.exists(INDEX_FILE):
        where = location.where(INDEX_FILE)
        index = read_json(location, INDEX_FILE)
        mapping = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(mapping, dict) or not mapping:
            raise HfBridgeError(f"{where} has no 'weight_map' object of tensor name -> file; export it again.")
        present = set(location.names())
        for key, name in mapping.items():
            if not isinstance(name, str) or PurePosixPath(name).name != name or name not in present:
                raise HfBridgeError(
                    f"{where} maps {key!r} to {name!r}, which is not a file in {location.text}; the checkpoint is "
                    "incomplete (a shard was deleted or never copied): export it again or download the missing shard."
                )
        return dict(mapping)
    if location.exists(SINGLE_FILE):
        return dict.fromkeys(read_header(location, SINGLE_FILE).by_key(), SINGLE_FILE)
    names = location.names()
    refuse_unsafe_formats(location.text, names)
    raise HfBridgeError(
        f"{location.text} has neither {SINGLE_FILE} nor {INDEX_FILE}; pass a Hugging Face checkpoint directory "
        "(config.json plus safetensors weights)."
    )


def read_header(location: Location, name: str) -> Header:
    """The checked header of one safetensors file (one or two ranged reads)."""
    where = location.where(name)
    size = location.size(name)
    raw = bytes(location.read_range(name, 0, min(size, HEADER_PROBE)))
    n = header_length(raw, size, where)
    if 8 + n > len(raw):
        raw = bytes(location.read_range(name, 0, 8 + n))
    return parse_header(raw[: 8 + n], size, where)


class CheckpointReader(contextlib.AbstractContextManager):
    """The tensors of a checkpoint by key, read as byte ranges from their files (local or at a URL)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self.file_of = weight_map(location)
        self.headers = {name: read_header(location, name) for name in sorted(set(self.file_of.values()))}
        self.entries: dict[str, Entry] = {}
        for key, name in self.file_of.items():
            entry = self.headers[name].by_key().get(key)
            if entry is None:
                raise HfBridgeError(
                    f"{location.where(INDEX_FILE)} maps {key!r} to {name}, but that file has no such tensor; the "
                    "index and the shards do not belong together: export the checkpoint again."
                )
            self.entries[key] = entry
        self.bytes_read = 0

    @property
    def directory(self) -> str:
        return self.location.text

    def keys(self) -> list[str]:
        return list(self.file_of)

    def where(self, key: str) -> str:
        """The file holding `key`, for error messages."""
        return self.location.where(self.file_of[key])

    def entry(self, key: str) -> Entry:
        return self.entries[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key].shape

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of `key` (e.g. "BF16")."""
        return self.entries[key].dtype

    def check_float(self, key: str) -> None:
        """Raise unless `key` holds floating-point weights (quantized or integer tensors cannot be loaded)."""
        dtype = self.dtype(key)
        if dtype not in FLOAT_DTYPES:
            raise HfBridgeError(
                f"Tensor {key!r} in {self.where(key)} has dtype {dtype}; hf_bridge loads floating-point weights "
                f"only ({list(FLOAT_DTYPES)}). Dequantize the checkpoint first."
            )

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor's first axis, read now (one ranged read), shape (stop - start, ...)."""
        return self.rows_of([(key, start, stop)])[0]

    def rows_of(self, requests: list[tuple[str, int, int]]) -> list[np.ndarray]:
        """Rows of several tensors, read at once (concurrently at a URL): a (key, start, stop) each."""
        ranges = []
        for key, start, stop in requests:
            entry, name = self.entries[key], self.file_of[key]
            start, stop = (start, stop) if entry.shape else (0, 1)
            offset = self.headers[name].data_start + entry.begin
            ranges.append((name, offset + start * entry.row_bytes, offset + stop * entry.row_bytes))
        out = []
        for (key, start, stop), (name, first, last), data in zip(
            requests, ranges, self.location.read_ranges(ranges), strict=True
        ):
            if len(data) != last - first:
                raise HfBridgeError(
                    f"{self.location.where(name)} ended after {first + len(data)} bytes while reading tensor "
                    f"{key!r}: the file was cut short after it was opened (is something rewriting it?). Export it "
                    "again."
                )
            self.bytes_read += len(data)
            entry = self.entries[key]
            array = np.frombuffer(data, dtype=entry.numpy_dtype)
            out.append(array.reshape((stop - start, *entry.shape[1:]) if entry.shape else ()))
        return out

    def get(self, key: str) -> np.ndarray:
        """One whole tensor, read now."""
        shape = self.entries[key].shape
        return self.rows(key, 0, shape[0] if shape else 1)

    def close(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        self.close()
