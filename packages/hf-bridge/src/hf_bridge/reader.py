"""Reading safetensors checkpoints tensor by tensor (memory-mapped), from one file or a sharded index."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from .errors import HfBridgeError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Formats that need unpickling or another framework to read: hf_bridge refuses them and says how to convert.
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


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


def read_json(path: Path) -> Any:
    """A JSON file's content; a clear error naming the file when it is missing or malformed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HfBridgeError(f"{path} does not exist; a Hugging Face checkpoint directory needs it.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HfBridgeError(f"{path} is not valid JSON ({e}); fix or regenerate the file.") from None


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file name of a checkpoint directory (sharded index or single file); errors say what is wrong."""
    if (directory / INDEX_FILE).is_file():
        index = read_json(directory / INDEX_FILE)
        mapping = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(mapping, dict) or not mapping:
            raise HfBridgeError(f"{directory / INDEX_FILE} has no 'weight_map' object of tensor name -> file.")
        for key, name in mapping.items():
            if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
                raise HfBridgeError(
                    f"{directory / INDEX_FILE} maps {key!r} to {name!r}, which is not a file in {directory}; "
                    "the checkpoint is incomplete (re-download the missing shard)."
                )
        return dict(mapping)
    if (directory / SINGLE_FILE).is_file():
        with safe_open(str(directory / SINGLE_FILE), framework="numpy") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    refuse_unsafe_formats(str(directory), names)
    raise HfBridgeError(
        f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}; pass a Hugging Face checkpoint directory "
        "(config.json plus safetensors weights)."
    )


class CheckpointReader(contextlib.AbstractContextManager):
    """The tensors of a checkpoint directory by key; each `get` reads one tensor from its memory-mapped file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.file_of = weight_map(directory)
        self._handles: dict[str, Any] = {}
        self._exits = contextlib.ExitStack()
        try:
            for name in sorted(set(self.file_of.values())):
                self._handles[name] = self._exits.enter_context(safe_open(str(directory / name), framework="numpy"))
        except SafetensorError as e:
            self.close()
            raise HfBridgeError(f"{directory / name} is not a valid safetensors file ({e}); re-download it.") from None
        keys_of = {name: set(handle.keys()) for name, handle in self._handles.items()}
        for key, name in self.file_of.items():
            if key not in keys_of[name]:
                self.close()
                raise HfBridgeError(
                    f"{directory / INDEX_FILE} maps {key!r} to {name}, but that file has no such tensor; the index "
                    "and the shards do not belong together."
                )

    def keys(self) -> list[str]:
        return list(self.file_of)

    def where(self, key: str) -> str:
        """The file holding `key`, for error messages."""
        return str(self.directory / self.file_of[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name of `key` (e.g. "BF16")."""
        return self._handles[self.file_of[key]].get_slice(key).get_dtype()

    def check_float(self, key: str) -> None:
        """Raise unless `key` holds floating-point weights (quantized or integer tensors cannot be loaded)."""
        dtype = self.dtype(key)
        if dtype not in FLOAT_DTYPES:
            raise HfBridgeError(
                f"Tensor {key!r} in {self.where(key)} has dtype {dtype}; hf_bridge loads floating-point weights "
                f"only ({list(FLOAT_DTYPES)}). Dequantize the checkpoint first."
            )

    def get(self, key: str) -> np.ndarray:
        """One tensor, read now."""
        return self._handles[self.file_of[key]].get_tensor(key)

    def close(self) -> None:
        self._exits.close()
        self._handles.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()
