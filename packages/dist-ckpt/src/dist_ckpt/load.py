"""`load`: read a checkpoint onto a target tree whose shardings, dtypes and process count may differ."""

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dist_ckpt.errors import TreeMismatchError
from dist_ckpt.layout import read_manifest
from dist_ckpt.location import Location
from dist_ckpt.reading import RegionKey, read_regions, region_key, regions_needed
from dist_ckpt.save import raise_if_failed
from dist_ckpt.tree import SCALAR_TYPES, Leaf, flatten, is_prng_key_array


def _select(entries: list[dict[str, Any]], subtree: str, path: Location) -> list[dict[str, Any]]:
    """The entries under the key path prefix `subtree` (keystr syntax), in saved order."""
    if not subtree:
        return entries
    # The prefix must end at a key boundary: ".param" must not select ".params.w".
    selected = [
        entry
        for entry in entries
        if entry["path"].startswith(subtree) and entry["path"][len(subtree) : len(subtree) + 1] in ("", "[", ".")
    ]
    if not selected:
        prefixes = sorted({entry["path"].split("]")[0] + "]" for entry in entries if "]" in entry["path"]})
        raise TreeMismatchError(
            f"No leaf of checkpoint {path} lies under subtree {subtree!r}. Subtrees are key path prefixes "
            f"as jax.tree_util.keystr prints them; the checkpoint's top-level keys include {prefixes[:10]}."
        )
    return selected


def _renamed(
    entries: list[dict[str, Any]], renames: Mapping[str, str], target_paths: list[str]
) -> list[dict[str, Any]] | None:
    """The entries in the target's order where renaming attributes of their key paths (`.old` -> `.new`) makes the
    saved paths the target's; None where it does not (the tree is not an older layout of the target's)."""
    pattern = re.compile(r"\.(" + "|".join(re.escape(old) for old in renames) + r")(?=[.\[]|$)")
    by_path = {pattern.sub(lambda m: "." + renames[m.group(1)], entry["path"]): entry for entry in entries}
    if len(by_path) != len(entries) or set(by_path) != set(target_paths):
        return None
    return [by_path[target] for target in target_paths]


def _match(targets: list[Leaf], entries: list[dict[str, Any]], subtree: str, path: Location) -> None:
    """Raise TreeMismatchError naming the first key path where target and checkpoint differ."""
    target_paths = [subtree + leaf.path for leaf in targets]
    saved_paths = [entry["path"] for entry in entries]
    if target_paths == saved_paths:
        return
    saved_set, target_set = set(saved_paths), set(target_paths)
    for position in range(max(len(target_paths), len(saved_paths))):
        target_path = target_paths[position] if position < len(target_paths) else None
        saved_path = saved_paths[position] if position < len(saved_paths) else None
        if target_path == saved_path:
            continue
        if target_path is not None and target_path not in saved_set:
            problem = f"the target has leaf {target_path}, which the checkpoint does not have"
        elif saved_path is not None and saved_path not in target_set:
            problem = f"the checkpoint has leaf {saved_path}, which the target does not have"
        else:
            problem = f"leaf {target_path} is in another position than in the checkpoint (order differs)"
        raise TreeMismatchError(
            f"The target tree does not match checkpoint {path}: {problem} (first difference, at leaf "
            f"#{position}). Build the target with the same structure as the saved tree, or load a part of "
            "it with subtree='<key path prefix>'."
        )


def _target_info(leaf: Leaf, entry: dict[str, Any], path: Location) -> tuple[str, Any, Any]:
    """(kind, dtype, sharding) that the loaded leaf must have; kind is 'jax', 'numpy' or 'scalar'."""
    target = leaf.value
    if is_prng_key_array(target):
        raise TreeMismatchError(
            f"Target leaf {entry['path']} is a typed PRNG key array; dist_ckpt stores key data. Use "
            "jax.random.key_data(key) in the target and jax.random.wrap_key_data after loading."
        )
    if isinstance(target, jax.Array | jax.ShapeDtypeStruct):
        kind, dtype, sharding = "jax", target.dtype, getattr(target, "sharding", None)
    elif isinstance(target, np.ndarray | np.generic):
        kind, dtype, sharding = "numpy", target.dtype, None
    elif isinstance(target, SCALAR_TYPES):
        return "scalar", type(target), None
    else:
        raise TreeMismatchError(
            f"Target leaf {entry['path']} has type {type(target).__name__}; a target leaf must be a "
            "jax.Array, jax.ShapeDtypeStruct (with a sharding to place it), numpy array or Python scalar."
        )
    target_shape = tuple(np.shape(target))
    saved_shape = tuple(entry["shape"]) if entry["kind"] == "array" else ()
    if target_shape != saved_shape:
        raise TreeMismatchError(
            f"Leaf {entry['path']} of checkpoint {path} has shape {saved_shape}, but the target has shape "
            f"{target_shape}. Build the target from the same model/optimizer configuration as the save."
        )
    return kind, np.dtype(dtype), sharding


def load(
    path: str | os.PathLike | Location,
    target: Any = None,
    *,
    subtree: str = "",
    progress: bool = True,
    renames: Mapping[str, str] | None = None,
) -> Any:
    """Load the checkpoint at `path` (a local path or an s3:// / gs:// URL) onto the structure, shardings and
    dtypes of `target`.

    Target leaves may be jax.ShapeDtypeStruct (with a sharding), jax arrays (their sharding is used),
    numpy arrays or Python scalars; dtypes differing from the saved ones are cast. `subtree` (a key path
    prefix such as "['params']") loads only that part of the checkpoint. Without a target, returns a flat
    dict from key path to numpy array or Python scalar. Every chunk read is checked against its checksum and
    the manifest's digest: a damaged file raises CorruptCheckpointError naming the leaf and the file.
    `renames` ({old attribute name: new}) reads a checkpoint saved before fields of the tree were renamed: used
    only where the saved key paths differ from the target's and the renames make them equal.
    """
    raise_if_failed()
    path = Location.parse(path)
    manifest = read_manifest(path)
    entries = _select(manifest["leaves"], subtree, path)
    if target is None:
        return _load_flat(path, entries, progress)
    targets, treedef = flatten(target)
    target_paths = [subtree + leaf.path for leaf in targets]
    older = _renamed(entries, renames, target_paths) if renames else None
    if older is not None:
        entries = older  # saved under the old names; each entry keeps its own path for messages
    else:
        _match(targets, entries, subtree, path)
    infos = [_target_info(leaf, entry, path) for leaf, entry in zip(targets, entries, strict=True)]

    arrays = [i for i, entry in enumerate(entries) if entry["kind"] == "array"]
    regions = {i: regions_needed(tuple(entries[i]["shape"]), infos[i][2]) for i in arrays}
    reads = read_regions(path, entries, regions, progress)
    loaded = [_assemble(entry, info, reads.get(i)) for i, (entry, info) in enumerate(zip(entries, infos, strict=True))]
    return jax.tree_util.tree_unflatten(treedef, loaded)


def _cast_scalar(value: Any, target_type: type) -> Any:
    """A saved scalar in the type of the target's Python scalar (numbers only; other types as saved)."""
    numeric = (bool, int, float)
    if isinstance(value, np.generic):
        value = value.item()
    if target_type in numeric and isinstance(value, numeric):
        return target_type(value)
    return value


def _assemble(entry: dict[str, Any], info: tuple[str, Any, Any], reads: dict[RegionKey, np.ndarray] | None) -> Any:
    """Build one loaded leaf from its regions (or from its manifest value, for Python scalars)."""
    kind, dtype, sharding = info
    shape = tuple(entry.get("shape", ()))
    if entry["kind"] == "scalar":
        if kind == "scalar":
            return _cast_scalar(entry["value"], dtype)
        reads = {(): np.asarray(entry["value"])}
    assert reads is not None, f"{entry['path']}: an array leaf whose regions were not read"
    if kind == "scalar":
        return _cast_scalar(next(iter(reads.values())).item(), dtype)
    if kind == "numpy" or sharding is None:
        data = next(iter(reads.values())).astype(dtype, copy=False)
        return data if kind == "numpy" else jax.device_put(data)
    cast: dict[RegionKey, np.ndarray] = {}  # one cast per region, shared by the devices that replicate it
    per_device = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = region_key(index, shape)
        if key not in cast:
            cast[key] = reads[key].astype(dtype, copy=False)
        per_device.append(jax.device_put(cast[key], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, per_device)


def _load_flat(path: Location, entries: list[dict[str, Any]], progress: bool) -> dict[str, Any]:
    """Every selected leaf as a numpy array (arrays) or Python value (scalars), keyed by key path."""
    arrays = [i for i, entry in enumerate(entries) if entry["kind"] == "array"]
    reads = read_regions(path, entries, {i: regions_needed(tuple(entries[i]["shape"]), None) for i in arrays}, progress)
    return {
        entry["path"]: next(iter(reads[i].values())) if i in reads else entry["value"]
        for i, entry in enumerate(entries)
    }
