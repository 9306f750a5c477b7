"""How well training's data order mixes the corpus: distinct source files per era of the era shuffle.

Prints one JSON line. For a finished cache (by default the standard library's, built here as the default
config builds it), every example of the first `--steps` x `--batch` positions of the order that `lm-train`
reads (`era_shuffled(seed, era)`) is traced back to the source files of its tokens, from the cache's own files:
the ledger's chunk order, cache.json's shards and files, the documents each file holds (read again with
shard-cache's reader of that format) and each document's tokens in the Parquet chunks. Per era of `--era`
positions it reports the distinct source files and the largest share of one top-level folder. The reference,
in the same run, is the full permutation (`shuffled(seed)`), which mixes the whole corpus: `ratio` is our mean
distinct files per era over the full permutation's (1 is as mixed as a full shuffle). With `--metrics` it also
reports the train-loss curve's largest jump over its local smoothing (the median of the 3 logged losses before
and the 3 after; the first logged loss left out).
Run: `uv run python bench/data_mixing.py [--cache DIR] [--metrics runs/x/metrics.jsonl]`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from common import emit, log

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def build_stdlib_cache(work: Path, vocab: int, max_files: int | None) -> Path:
    """The train split of the built-in corpus, cached with the settings `lm-train` uses for it."""
    from lm_train.data.corpus import split_stdlib
    from shard_cache import build_cache, train_tokenizer

    files = [str(p) for p in split_stdlib(0.02).train][:max_files]
    log(f"training a {vocab}-token BPE on {len(files)} files")
    train_tokenizer([Path(f) for f in files], vocab, save_path=work / "tokenizer.json")
    log("building the cache")
    build_cache(
        files,
        str(work / "cache"),
        tokenizer=str(work / "tokenizer.json"),
        fmt="text",
        files_per_shard=max(1, len(files) // 64),
        chunk_size=64,
        progress=False,
    )
    return work / "cache"


def token_sources(cache: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """For the concatenated token stream: where each document starts, its source file's id, and the files."""
    import pyarrow.parquet as pq

    from shard_cache.sources import DocumentReader

    settings = json.loads((cache / "cache.json").read_text())
    ledger = json.loads((cache / "ledger.json").read_text())
    assert ledger["finished"], f"{cache}: the build has not finished"
    files: list[str] = []
    shard_doc_files: list[list[int]] = []  # per shard, the file id of each of its documents in order
    for shard in settings["shards"]:
        ids = []
        for url in shard["files"]:
            skipped: Counter[str] = Counter()
            policy = settings["on_bad_input"]
            reader = DocumentReader(url, settings["input_format"], settings["text_field"], policy, skipped)
            ids.extend([len(files)] * sum(1 for _ in reader))
            files.append(url)
        shard_doc_files.append(ids)
    chunk_size = settings["chunk_size"]
    lengths, doc_files = [], []
    for shard, chunk in ledger["order"]:
        column = pq.read_table(cache / "chunks" / f"{shard:05d}" / f"{chunk:06d}.parquet").column("input_ids")
        lengths.append(column.combine_chunks().value_lengths().to_numpy())
        doc_files.extend(shard_doc_files[shard][chunk * chunk_size : chunk * chunk_size + len(column)])
    starts = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    return starts, np.asarray(doc_files), files


def era_figures(examples: np.ndarray, era: int, seq_len: int, doc_starts, doc_files, folders) -> list[dict]:
    """Per era: the distinct source files its examples' tokens come from, and its largest one-folder share."""
    out = []
    for begin in range(0, len(examples), era):
        chosen = examples[begin : begin + era]
        first = np.searchsorted(doc_starts, chosen * seq_len, side="right") - 1
        last = np.searchsorted(doc_starts, (chosen + 1) * seq_len - 1, side="right") - 1
        docs = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last, strict=True)]))
        sources = set(doc_files[docs].tolist())
        top = Counter(folders[doc_files[d]] for d in first).most_common(1)[0]
        share = top[1] / len(chosen)
        out.append({"era": begin // era, "files": len(sources), "top_folder": top[0], "top_share": share})
    return out


def loss_jump(metrics: Path, half: int = 3) -> tuple[float, int]:
    """The largest train loss over the median of its `half` logged neighbours on each side, and its step.

    The first logged loss is left out: it has no neighbour before it, and the fall after it is no jump."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    curve = sorted((r["step"], r["train/loss"]) for r in rows if "train/loss" in r)
    worst, at = 0.0, -1
    for i, (step, loss) in enumerate(curve):
        if i == 0:
            continue
        neighbours = [v for _, v in curve[max(0, i - half) : i] + curve[i + 1 : i + 1 + half]]
        ratio = loss / float(np.median(neighbours))
        if ratio > worst:
            worst, at = ratio, step
    return worst, at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, help="a finished cache (default: build the standard library's)")
    parser.add_argument("--vocab", type=int, default=4096, help="tokenizer size when building (default 4096)")
    parser.add_argument("--max-files", type=int, default=None, help="build from only the first N files")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--era", type=int, default=2048, help="era length of the shuffle (data.shuffle)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--metrics", type=Path, help="a run's metrics.jsonl: also report its largest loss jump")
    args = parser.parse_args()

    from shard_cache import open_cache

    with tempfile.TemporaryDirectory(prefix="bench-mixing-") as tmp:
        cache = args.cache or build_stdlib_cache(Path(tmp), args.vocab, args.max_files)
        doc_starts, doc_files, files = token_sources(cache)
        root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
        relative = [os.path.relpath(f, root) for f in files]
        folders = [r.split(os.sep)[0] if os.sep in r else "." for r in relative]
        windows = open_cache(str(cache)).token_windows(args.seq_len)
        total = windows.final_num_examples()
        positions = np.arange(min(args.steps * args.batch, total) // args.era * args.era)  # whole eras
        ours = era_figures(
            windows.era_shuffled(args.seed, args.era).example_indices(positions),
            args.era, args.seq_len, doc_starts, doc_files, folders,
        )  # fmt: skip
        full = era_figures(
            windows.shuffled(args.seed).example_indices(positions),
            args.era, args.seq_len, doc_starts, doc_files, folders,
        )  # fmt: skip
        sequential = era_figures(positions, args.era, args.seq_len, doc_starts, doc_files, folders)
    mean = float(np.mean([e["files"] for e in ours]))
    reference = float(np.mean([e["files"] for e in full]))
    figures = {
        "files_total": len(files),
        "examples_total": int(total),
        "eras": len(ours),
        "files_per_era": [e["files"] for e in ours],
        "files_per_era_min": min(e["files"] for e in ours),
        "files_per_era_mean": round(mean, 1),
        "top_folder_share_max": round(max(e["top_share"] for e in ours), 3),
        "top_folder_per_era": [f"{e['top_folder']}:{e['top_share']:.2f}" for e in ours],
        "full_shuffle_files_per_era": [e["files"] for e in full],
        "sequential_files_per_era": [e["files"] for e in sequential],
        "sequential_top_folder_share_max": round(max(e["top_share"] for e in sequential), 3),
    }
    if args.metrics:
        jump, step = loss_jump(args.metrics)
        figures.update(max_loss_jump_ratio=round(jump, 3), max_loss_jump_step=step)
    emit(
        "data_mixing",
        figures,
        reference=round(reference, 1),
        ratio=mean / reference,
        ratio_means="mean distinct files per era: era shuffle / full permutation (1 = as mixed as a full shuffle)",
    )


if __name__ == "__main__":
    main()
