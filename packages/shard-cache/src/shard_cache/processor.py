"""Batch processors: functions from a batch of raw documents to a pyarrow RecordBatch (one row per document)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from shard_cache.errors import ShardCacheError, TokenizerFileError
from shard_cache.fs import get_fs, join, read_bytes, storage_error

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


@runtime_checkable
class BatchProcessor(Protocol):
    """Turns a batch of documents into a RecordBatch with one row per document.

    `fingerprint()` returns JSON-able settings that determine the output; a resumed build checks it is unchanged.
    """

    # A batch of what the record format's reader yields: text, loss-span documents or preference pairs.
    def __call__(self, docs: list[Any], /) -> pa.RecordBatch: ...

    def fingerprint(self) -> dict[str, Any]: ...


CHECKSUM_SUFFIX = ".sha256"  # train_tokenizer writes the tokenizer's sha256 beside it, and loading checks it


def _damaged(file: str, why: str) -> TokenizerFileError:
    return TokenizerFileError(
        f"{file}: the tokenizer file is damaged ({why}). If it was trained (train_tokenizer, `shard-cache "
        f"train-tokenizer`, or lm-train into its cache directory), delete it and {file}{CHECKSUM_SUFFIX} to train it "
        "again; otherwise point to a good tokenizer.json (lm-train: data.tokenizer).",
        path=file,
    )


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer from a tokenizer.json file or a Hugging Face tokenizer directory holding one (any path or
    fsspec URL); a damaged, unreadable or missing file is a TokenizerFileError naming it and the fix."""
    path = str(path)
    fs, fs_path = get_fs(path, listings_cache=True)
    file, file_path = path, fs_path
    try:
        is_dir = fs.isdir(fs_path)
    except OSError as exc:
        raise TokenizerFileError(str(storage_error(exc, path, writing=False)), path=path) from exc
    if is_dir:
        file, file_path = join(path, "tokenizer.json"), join(fs_path, "tokenizer.json")
    try:
        data = read_bytes(fs, file_path)
    except FileNotFoundError as exc:
        if is_dir:
            raise TokenizerFileError(
                f"tokenizer {path!r}: the directory has no tokenizer.json. Pass a tokenizer.json file or an HF "
                "tokenizer directory saved with a fast tokenizer (tokenizer.save_pretrained).",
                path=file,
            ) from exc
        raise TokenizerFileError(
            f"tokenizer {path!r}: no such file. Pass a tokenizer.json or an HF tokenizer directory.", path=file
        ) from exc
    except ShardCacheError as exc:
        raise TokenizerFileError(f"tokenizer {exc}", path=file) from exc
    try:
        recorded = read_bytes(fs, file_path + CHECKSUM_SUFFIX).decode("ascii", "replace").strip()
    except (FileNotFoundError, ShardCacheError):
        recorded = None
    if recorded is not None and recorded != hashlib.sha256(data).hexdigest():
        raise _damaged(file, f"its sha256 differs from the one recorded in {file}{CHECKSUM_SUFFIX} when it was written")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:
        raise _damaged(file, f"not a valid tokenizer.json: {type(exc).__name__}: {str(exc)[:200]}") from exc


def _special_from_config(path: str, key: str) -> str | None:
    """Read eos_token/bos_token from an HF tokenizer directory's tokenizer_config.json, if there is one."""
    import fsspec

    config = path.rstrip("/") + "/tokenizer_config.json"
    try:
        # one OpenFile: fsspec.open returns a list only for a glob, and `config` has no glob characters
        with fsspec.open(config, "r") as f:
            value = json.load(f).get(key)  # pyright: ignore[reportArgumentType]
    except (OSError, ValueError):  # no config there (a tokenizer.json path), or not readable JSON
        return None
    if isinstance(value, dict):  # AddedToken serialised as a dict
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(tokenizer: Tokenizer, token: str, role: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ShardCacheError(f"the tokenizer has no {role} token {token!r}. Pass an {role} token it knows.")
    return token_id


class TokenizerProcessor:
    """Tokenizes with HF `tokenizers` batch encoding; appends exactly one EOS per document, optionally a BOS first.

    Documents are encoded without the tokenizer's own special tokens, so a post-processor that also appends EOS
    cannot double it. With `enforce_eos=False` the tokenizer's own post-processor decides the special tokens
    (Levanter's meaning of the setting), and nothing is added.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        eos_token: str | None = None,
        bos_token: str | None = None,
        add_bos: bool = False,
        enforce_eos: bool = True,
    ):
        self.enforce_eos = enforce_eos
        source = tokenizer if isinstance(tokenizer, str) else None
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        if eos_token is None and source is not None:
            eos_token = _special_from_config(source, "eos_token")
        if eos_token is None:
            eos_token = next((t for t in _EOS_CANDIDATES if self.tokenizer.token_to_id(t) is not None), None)
        if eos_token is None:
            raise ShardCacheError(
                "cannot tell the tokenizer's end-of-document token: none of "
                f"{', '.join(_EOS_CANDIDATES)} is in its vocabulary. Pass eos_token= (CLI: --eos)."
            )
        self.eos_token = eos_token
        self.eos_id = _token_id(self.tokenizer, eos_token, "EOS")
        self.add_bos = add_bos
        self.bos_token = None
        self.bos_id = None
        if add_bos:
            if bos_token is None and source is not None:
                bos_token = _special_from_config(source, "bos_token")
            if bos_token is None:
                raise ShardCacheError("add_bos is set but no BOS token is known. Pass bos_token= (CLI: --bos).")
            self.bos_token = bos_token
            self.bos_id = _token_id(self.tokenizer, bos_token, "BOS")
        self._tokenizer_sha256 = hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()

    def fingerprint(self) -> dict[str, Any]:
        """Settings that determine the output tokens."""
        settings: dict[str, Any] = {
            "kind": "tokenizer",
            "tokenizer_sha256": self._tokenizer_sha256,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
        }
        if not self.enforce_eos:  # only when off, so caches built before the setting existed still match
            settings["enforce_eos"] = False
        return settings

    def __call__(self, docs: list[str]) -> pa.RecordBatch:
        """Token ids of each document, as an `input_ids` list<int32> column."""
        if not self.enforce_eos:
            own = self.tokenizer.encode_batch_fast(docs, add_special_tokens=True)
            column = pa.array([e.ids for e in own], type=pa.list_(pa.int32()))
            return pa.RecordBatch.from_arrays([column], names=["input_ids"])
        encodings = self.tokenizer.encode_batch_fast(docs, add_special_tokens=False)
        extra = 2 if self.bos_id is not None else 1
        lengths = np.fromiter((len(e.ids) + extra for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.zeros(len(docs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(int(offsets[-1]), dtype=np.int32)
        start = 0
        for encoding in encodings:
            ids = encoding.ids
            if self.bos_id is not None:
                values[start] = self.bos_id
                start += 1
            values[start : start + len(ids)] = ids
            start += len(ids)
            values[start] = self.eos_id
            start += 1
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        return pa.RecordBatch.from_arrays([column], names=["input_ids"])
