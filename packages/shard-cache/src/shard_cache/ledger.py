"""The ledger: which chunks each shard has committed, whether it is done, and the global chunk order.

The global order is round-robin over shards: round r holds chunk r of every shard that has more than r
chunks, in shard order. Its prefix is known as soon as, for every earlier slot, the shard has either committed
that chunk or is done; the ledger stores exactly that prefix, so readers only ever see committed chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

LEDGER_FORMAT = "shard-cache-ledger/1"
LEDGER_NAME = "ledger.json"
SETTINGS_NAME = "cache.json"


@dataclass
class ChunkEntry:
    """What the ledger knows about one committed chunk."""

    docs: int
    tokens: dict[str, int]


@dataclass
class ShardState:
    """Progress of one shard."""

    name: str
    chunks: list[ChunkEntry] = field(default_factory=list)
    done: bool = False
    skipped: dict[str, int] = field(default_factory=dict)


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
        """Serialise deterministically (the same state gives the same bytes)."""
        doc = {
            "format": LEDGER_FORMAT,
            "finished": self.finished,
            "error": self.error,
            "shards": [
                {
                    "name": s.name,
                    "done": s.done,
                    "skipped": dict(sorted(s.skipped.items())),
                    "chunks": [[c.docs, dict(sorted(c.tokens.items()))] for c in s.chunks],
                }
                for s in self.shards
            ],
            "order": [list(pair) for pair in self.order],
        }
        return (json.dumps(doc, separators=(",", ":")) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "ledger.json") -> Ledger:
        """Parse a ledger written by `to_json`."""
        from shard_cache.errors import CacheCorruptError

        try:
            doc: dict[str, Any] = json.loads(data)
            if doc.get("format") != LEDGER_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {LEDGER_FORMAT!r}")
            shards = [
                ShardState(
                    name=s["name"],
                    chunks=[ChunkEntry(docs=int(d), tokens={k: int(v) for k, v in t.items()}) for d, t in s["chunks"]],
                    done=bool(s["done"]),
                    skipped={k: int(v) for k, v in s["skipped"].items()},
                )
                for s in doc["shards"]
            ]
            order = [(int(a), int(b)) for a, b in doc["order"]]
            error = doc.get("error")
            return cls(shards=shards, order=order, finished=bool(doc["finished"]), error=error)
        except (ValueError, KeyError, TypeError) as exc:
            raise CacheCorruptError(
                f"{where}: not a valid shard-cache ledger ({exc}). The directory is not a cache, or the file was "
                "edited; rebuild into a new directory."
            ) from exc


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
