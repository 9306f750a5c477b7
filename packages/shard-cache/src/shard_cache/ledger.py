"""The ledger: which chunks each shard has committed, whether it is done, and the global chunk order.

The global order is round-robin over shards: round r holds chunk r of every shard that has more than r
chunks, in shard order. Its prefix is known as soon as, for every earlier slot, the shard has either committed
that chunk or is done; the ledger stores exactly that prefix, so readers only ever see committed chunks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from shard_cache.errors import CacheCorruptError

# /2 adds a CRC-32C per chunk, the files that gave no document, and a sha256 of the ledger itself; /1 is read.
LEDGER_FORMAT = "shard-cache-ledger/2"
LEDGER_FORMATS_READ = ("shard-cache-ledger/1", LEDGER_FORMAT)
LEDGER_NAME = "ledger.json"
SETTINGS_NAME = "cache.json"
REBUILD_LEDGER_HINT = (
    "Run the cache's `shard-cache build` command (or build_cache call) again: it rebuilds the ledger from the "
    "chunk files and re-tokenizes only what is missing."
)


@dataclass
class ChunkEntry:
    """What the ledger knows about one committed chunk; `crc32c` is None in ledgers written before 0.3."""

    docs: int
    tokens: dict[str, int]
    crc32c: str | None = None


@dataclass
class ShardState:
    """Progress of one shard."""

    name: str
    chunks: list[ChunkEntry] = field(default_factory=list)
    done: bool = False
    skipped: dict[str, int] = field(default_factory=dict)
    empty_files: list[str] = field(default_factory=list)  # input files of this shard that gave no document


@dataclass
class Ledger:
    """The whole build state; `order` is the committed prefix of the global chunk order as (shard, chunk) pairs."""

    shards: list[ShardState]
    order: list[tuple[int, int]] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # why the last build stopped early; cleared when a build resumes

    def refresh_order(self) -> None:
        """Extend `order` to the longest prefix of the round-robin order that committed chunks determine."""
        self.order = global_order([len(s.chunks) for s in self.shards], [s.done for s in self.shards])
        self.finished = all(s.done for s in self.shards)

    def to_json(self) -> bytes:
        """Serialise deterministically (the same state gives the same bytes), with the body's sha256 last."""
        doc = {
            "format": LEDGER_FORMAT,
            "finished": self.finished,
            "error": self.error,
            "shards": [
                {
                    "name": s.name,
                    "done": s.done,
                    "skipped": dict(sorted(s.skipped.items())),
                    "empty_files": list(s.empty_files),
                    "chunks": [[c.docs, dict(sorted(c.tokens.items())), c.crc32c] for c in s.chunks],
                }
                for s in self.shards
            ],
            "order": [list(pair) for pair in self.order],
        }
        body = _canonical(doc)
        return (body[:-1] + f',"sha256":"{_digest(body)}"}}\n').encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "ledger.json") -> Ledger:
        """Parse a ledger written by `to_json` (or by 0.1/0.2); CacheCorruptError if it is damaged."""
        try:
            doc: dict[str, Any] = json.loads(data)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if doc.get("format") not in LEDGER_FORMATS_READ:
                raise ValueError(f"format is {doc.get('format')!r}, expected {LEDGER_FORMAT!r}")
            if doc["format"] != LEDGER_FORMATS_READ[0]:
                recorded = doc.pop("sha256", None)
                if recorded != _digest(_canonical(doc)):
                    raise ValueError("its sha256 does not match its content")
            shards = [
                ShardState(
                    name=s["name"],
                    chunks=[_entry(c) for c in s["chunks"]],
                    done=bool(s["done"]),
                    skipped={k: int(v) for k, v in s["skipped"].items()},
                    empty_files=[str(f) for f in s.get("empty_files", [])],
                )
                for s in doc["shards"]
            ]
            order = [(int(a), int(b)) for a, b in doc["order"]]
            error = doc.get("error")
            return cls(shards=shards, order=order, finished=bool(doc["finished"]), error=error)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CacheCorruptError(
                f"{where}: damaged, not a valid shard-cache ledger ({type(exc).__name__}: {exc}). {REBUILD_LEDGER_HINT}"
            ) from exc


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def _entry(raw: list[Any]) -> ChunkEntry:
    docs, tokens, *rest = raw
    crc = rest[0] if rest else None
    if crc is not None and not isinstance(crc, str):
        raise ValueError(f"chunk checksum {crc!r} is not a string")
    return ChunkEntry(docs=int(docs), tokens={k: int(v) for k, v in tokens.items()}, crc32c=crc)


def global_order(chunk_counts: list[int], done: list[bool]) -> list[tuple[int, int]]:
    """The determinable prefix of the round-robin chunk order, given committed chunk counts and done flags."""
    order: list[tuple[int, int]] = []
    longest = max(chunk_counts, default=0)
    for round_index in range(longest + 1):
        for shard, (count, finished) in enumerate(zip(chunk_counts, done, strict=True)):
            if count > round_index:
                order.append((shard, round_index))
            elif not finished:
                return order
    return order
