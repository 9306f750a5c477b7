"""`lm-train viz`: validation documents with each token shaded by its log-prob under a checkpoint (or two)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lm_train.errors import DataError, UserError
from lm_train.tools.logprob_page import ScoredDocument, render_page
from lm_train.tools.output_files import check_output_file, make_output_folder


@dataclass(frozen=True)
class TokenizedDocument:
    """A document's ids (EOS first, as after the previous document in training) and each token's text."""

    name: str
    ids: list[int]
    texts: list[str]


def read_documents(data: Sequence[str], text_key: str, max_docs: int) -> list[tuple[str, str, str]]:
    """(name, text, file) of the first max_docs documents of the files (paths, URLs, globs; jsonl, text, ...)."""
    from lm_train.data.inputs import expand_urls
    from shard_cache import DocumentReader

    files = expand_urls(tuple(data), "--data")
    documents: list[tuple[str, str, str]] = []
    for url in files:
        for i, text in enumerate(DocumentReader(url, text_field=text_key)):
            documents.append((f"{Path(url).name} #{i}", text, url))
            if len(documents) == max_docs:
                return documents
    return documents


def validation_inputs(config: Any) -> list[str]:
    """The validation files of a run's config (its held-out split of the built-in corpus, or its URLs)."""
    from lm_train.data.inputs import resolve_inputs

    files = resolve_inputs(config.data).validation
    if not files:
        raise DataError("The run's config has no validation data; give documents with --data FILE ...")
    return files


def tokenize(tokenizer: Any, eos_id: int, name: str, text: str, max_tokens: int) -> TokenizedDocument:
    """The document's first max_tokens tokens after one EOS, with the text each token covers."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    ids, texts, covered = [eos_id], [""], 0
    for token_id, (start, end) in zip(encoding.ids[:max_tokens], encoding.offsets[:max_tokens], strict=True):
        # Byte-level tokens can share a character; each character is shown once, on its first token.
        texts.append(text[max(start, covered) : end])
        covered = max(covered, end)
        ids.append(token_id)
    return TokenizedDocument(name, ids, texts)


def windows(length: int, seq_len: int) -> list[tuple[int, int]]:
    """[start, end) windows of at most seq_len ids (a training example's length) overlapping by one, so that
    every id after the first is predicted once, from the ids before it in its window."""
    spans, start = [], 0
    while True:
        end = min(start + seq_len, length)
        spans.append((start, end))
        if end == length:
            return spans
        start = end - 1


def document_log_probs(scorer: Any, documents: Sequence[TokenizedDocument]) -> list[np.ndarray]:
    """For each document, the log-prob of each of its ids 1..n-1 (each window's ids in its own context)."""
    jobs = [(d, s, e) for d, doc in enumerate(documents) for s, e in windows(len(doc.ids), scorer.seq_len)]
    scored = scorer.score([documents[d].ids[s:e] for d, s, e in jobs])
    out = [np.zeros(len(doc.ids) - 1, np.float64) for doc in documents]
    for (d, s, e), (log_probs, _) in zip(jobs, scored, strict=True):
        out[d][s : e - 1] = log_probs
    return out


def _loaded_scorer(checkpoint: str | Path, batch_size: int | None) -> tuple[Any, Any]:
    from lm_train.run.checkpoints import load_model
    from lm_train.run.mesh import plan_mesh
    from lm_train.tools.token_scoring import scorer_for

    loaded = load_model(checkpoint)
    return loaded, scorer_for(loaded.model, loaded.config, plan_mesh(loaded.config.trainer), batch_size)


def visualize(
    checkpoint: str | Path,
    out: Path,
    *,
    data: Sequence[str] = (),
    compare: Path | None = None,
    max_docs: int = 8,
    max_tokens: int = 400,
    batch_size: int | None = None,
) -> Path:
    """Write the page for `checkpoint` (or its difference from the baseline `compare`); returns its path."""
    import shard_cache

    if max_docs < 1 or max_tokens < 1:
        raise UserError("--max-docs and --max-tokens must be at least 1.")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}; leave it out for the eval batch.")
    if out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"--out {out}: write an .html file.")
    check_output_file(out, "--out")  # before the checkpoint is loaded and scored
    loaded, scorer = _loaded_scorer(checkpoint, batch_size)
    other = None
    if compare is not None:
        other, other_scorer = _loaded_scorer(compare, batch_size)
        if other.tokenizer.to_str() != loaded.tokenizer.to_str():
            raise UserError(
                f"--compare {compare}: its run's tokenizer differs from that of {checkpoint}, so their tokens "
                "cannot be lined up. Compare checkpoints of runs that share a tokenizer."
            )
    eos_id = shard_cache.TokenizerProcessor(loaded.tokenizer).eos_id
    sources = list(data) or validation_inputs(loaded.config)
    texts = read_documents(sources, loaded.config.data.text_key, max_docs)
    if not texts:
        raise DataError(f"--data: {sources} holds no document.")
    docs = [tokenize(loaded.tokenizer, eos_id, name, text, max_tokens) for name, text, _ in texts]
    first = document_log_probs(scorer, docs)
    second = document_log_probs(other_scorer, docs) if other is not None else None
    scored = []
    for i, doc in enumerate(docs):  # the leading EOS is context only: the page shows the document's tokens
        a = first[i].tolist()
        if second is None:
            scored.append(ScoredDocument(doc.name, doc.texts[1:], doc.ids[1:], a))
        else:
            b = second[i].tolist()  # the baseline: values are CHECKPOINT minus it
            scored.append(ScoredDocument(doc.name, doc.texts[1:], doc.ids[1:], (first[i] - second[i]).tolist(), b))
    if other is None:
        meta = [f"checkpoint: {loaded.checkpoint} (step {loaded.step})"]
    else:
        meta = [
            f"B: {loaded.checkpoint} (step {loaded.step})",
            f"A: {other.checkpoint} (step {other.step}), the baseline; shading: log-prob under B minus under A",
        ]
    used = list(dict.fromkeys(url for _, _, url in texts))
    meta.append(f"{len(docs)} documents from {', '.join(used[:3])}{' ...' if len(used) > 3 else ''}")
    title = "Token log-probs" if other is None else "Token log-prob differences"
    make_output_folder(out, "--out")
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(render_page(title, meta, scored, compare=other is not None), encoding="utf-8")
    partial.replace(out)
    return out
