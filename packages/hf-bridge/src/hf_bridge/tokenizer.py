"""Tokenizers: load from a tokenizer.json or an HF tokenizer directory; save so that AutoTokenizer loads them."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

import storage_io

from .errors import HfBridgeError
from .reader import parse_json
from .sources import is_url, local_copy, storage_error, strip_file_scheme, url_fs

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model")


def load_tokenizer(path: str | os.PathLike, *, revision: str | None = None) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json file, an HF tokenizer directory, an fsspec URL or a hub id."""
    with local_copy(path, patterns=TOKENIZER_PATTERNS, revision=revision, what="tokenizer") as local:
        file = local if local.is_file() else local / TOKENIZER_FILE
        if not file.is_file():
            others = sorted(p.name for p in local.iterdir()) if local.is_dir() else []
            raise HfBridgeError(
                f"{local} has no {TOKENIZER_FILE} (it has {others[:8]}). hf_bridge reads the fast-tokenizer file "
                "only; make one with `transformers.AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`."
            )
        text = _read_text(file)
        try:
            return Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise HfBridgeError(
                f"{file} is not a valid tokenizers file ({e}); it may be damaged or cut short: save the tokenizer "
                "again (or copy it again from where it came from)."
            ) from None


def load_special_tokens(path: str | os.PathLike, *, revision: str | None = None) -> dict[str, str]:
    """The special tokens (bos/eos/unk/pad) an HF tokenizer directory declares; {} for a bare tokenizer.json."""
    with local_copy(path, patterns=TOKENIZER_PATTERNS, revision=revision, what="tokenizer") as local:
        if local.is_file():
            return {}
        found: dict[str, str] = {}
        for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):
            if (local / name).is_file():
                content = parse_json(_read_text(local / name).encode("utf-8"), str(local / name))
                for key in SPECIAL_TOKEN_KEYS:
                    token = _token_text(content.get(key)) if isinstance(content, dict) else None
                    if token is not None:
                        found.setdefault(key, token)
        return found


def _token_text(value: Any) -> str | None:
    # transformers writes a special token as a string or as an AddedToken dict with its "content".
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def default_special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """GPT-2's convention when a tokenizer has exactly one special token: it is bos, eos and unk."""
    special = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    if len(special) == 1:
        return {"bos_token": special[0], "eos_token": special[0], "unk_token": special[0]}
    return {}


def special_token_ids(tokenizer: Tokenizer, special_tokens: Mapping[str, str]) -> dict[str, int]:
    """The id of each special token, e.g. {"bos_token_id": 0}; errors name a token missing from the vocabulary."""
    ids = {}
    for key, token in special_tokens.items():
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise HfBridgeError(f"The special token {key}={token!r} is not in the tokenizer's vocabulary.")
        ids[f"{key}_id"] = token_id
    return ids


def _read_text(file: Path) -> str:
    try:
        return file.read_bytes().decode("utf-8")
    except OSError as e:
        raise storage_error(e, str(file), "Reading") from None
    except UnicodeDecodeError as e:
        raise HfBridgeError(f"{file} is not UTF-8 text ({e}); it is damaged: save the tokenizer again.") from None


def tokenizer_files(
    tokenizer: Tokenizer,
    *,
    special_tokens: Mapping[str, str] | None = None,
    model_max_length: int | None = None,
) -> dict[str, bytes]:
    """The content of tokenizer.json, tokenizer_config.json and special_tokens_map.json, by name."""
    if not isinstance(tokenizer, Tokenizer):
        raise HfBridgeError(f"save_tokenizer needs a tokenizers.Tokenizer, got {type(tokenizer).__name__}.")
    special = dict(default_special_tokens(tokenizer) if special_tokens is None else special_tokens)
    unknown = sorted(set(special) - set(SPECIAL_TOKEN_KEYS))
    if unknown:
        raise HfBridgeError(f"Unknown special token keys {unknown}; use {list(SPECIAL_TOKEN_KEYS)}.")
    special_token_ids(tokenizer, special)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **special,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return {
        TOKENIZER_FILE: tokenizer.to_str(pretty=True).encode("utf-8"),
        TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        SPECIAL_TOKENS_MAP: (json.dumps(special, indent=2) + "\n").encode("utf-8"),
    }


def save_tokenizer(
    tokenizer: Tokenizer,
    directory: str | os.PathLike,
    *,
    special_tokens: Mapping[str, str] | None = None,
    model_max_length: int | None = None,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into a directory or at a URL.

    Each file is replaced whole (written under a temporary name, then renamed; an object store's upload is
    whole by itself), so a reader never sees half a file.
    """
    files = tokenizer_files(tokenizer, special_tokens=special_tokens, model_max_length=model_max_length)
    text = os.fspath(directory)
    if is_url(text):
        fs, root = url_fs(text, "tokenizer")
        shown = text.rstrip("/")  # errors name the URL as given
    else:
        fs, root = storage_io.open_fs(str(Path(strip_file_scheme(text)).expanduser()))
        shown = root
    for name, data in files.items():
        where = f"{shown}/{name}"
        failed = lambda e, _, __, where=where: storage_error(e, where, "Writing")  # noqa: E731
        storage_io.write_atomic(fs, f"{root.rstrip('/')}/{name}", data, error=failed)
