"""Train a byte-level BPE tokenizer for corpora that come without one."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shard_cache.errors import ShardCacheError
from shard_cache.fs import get_fs, read_bytes, remove, write_atomic
from shard_cache.processor import CHECKSUM_SUFFIX

EOS_TOKEN = "<|endoftext|>"


def _texts(source: Iterable[str | os.PathLike], read_files: bool) -> Iterator[str]:
    for item in source:
        if isinstance(item, os.PathLike) or read_files:
            path = Path(item)
            try:
                yield path.read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                raise ShardCacheError(f"train_tokenizer: cannot read {path} ({exc}). Check the path.") from exc
        else:
            yield item


def train_tokenizer(
    source: Iterable[str | os.PathLike],
    vocab_size: int,
    *,
    files: bool | None = None,
    special_tokens: tuple[str, ...] = (EOS_TOKEN,),
    min_frequency: int = 2,
    save_path: str | os.PathLike | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on texts or files; same input, same tokenizer.json.

    `source` holds texts, or file paths when `files` is True (default: paths if the items are `PathLike`).
    The first special token (default `<|endoftext|>`) is the end-of-document token. The tokenizer is saved to
    `save_path` (a tokenizer.json; a path or fsspec URL) when given, atomically, with its sha256 in
    `<save_path>.sha256`, which `load_tokenizer` checks.
    """
    items = list(source)
    if files is None:
        files = bool(items) and all(isinstance(item, os.PathLike) for item in items)
    if not items:
        raise ShardCacheError("train_tokenizer: the source is empty. Pass texts or files to train on.")
    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ShardCacheError(
            f"train_tokenizer: vocab_size={vocab_size} is too small: a byte-level BPE needs the 256 bytes plus "
            f"{len(special_tokens)} special token(s). Use vocab_size >= {minimum}."
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(_texts(items, files), trainer=trainer, length=len(items))
    if save_path is not None:
        save_tokenizer(tokenizer, str(save_path))
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, save_path: str) -> None:
    """Write the sha256 of tokenizer.json, then tokenizer.json itself at `save_path` (a path or fsspec URL), each
    atomically.

    The checksum goes first: a tokenizer that exists then always has it, even when the disk fills or the
    process dies between the two writes (the other order could leave a tokenizer that loads unchecked).
    """
    data = tokenizer.to_str(pretty=True).encode("utf-8")  # the bytes of Tokenizer.save
    fs, path = get_fs(save_path)
    checksum = path + CHECKSUM_SUFFIX
    previous = read_bytes(fs, checksum) if fs.isfile(checksum) else None
    write_atomic(fs, checksum, (hashlib.sha256(data).hexdigest() + "\n").encode("ascii"))
    try:
        write_atomic(fs, path, data)
    except BaseException:
        # Nothing of this tokenizer stays; a tokenizer that was there keeps its own checksum.
        if previous is None:
            remove(fs, checksum)
        else:
            write_atomic(fs, checksum, previous)
        raise
