"""The `data` section: where the training text comes from, how it is tokenized, and where its cache lives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lm_train.config.data_formats import DataFormat, TextFormat, check_format, format_name
from lm_train.config.mixture_config import SourceConfig
from lm_train.errors import ConfigError

LONG_DOCUMENT_RULES = ("truncate", "split", "drop")
CACHE_BUILDS = {"auto": None, "in_process": True, "ray": False}  # data.cache_build -> build_cache's in_process


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from, how it is tokenized, and where its cache lives."""

    train_urls: tuple[str, ...] = ()
    """Paths or fsspec URLs (globs and {1..N} ranges) of training documents."""
    validation_urls: tuple[str, ...] = ()
    """Paths or URLs of validation documents; empty with `builtin` means a held-out split of it."""
    id: str | None = None
    """A Hugging Face dataset id or local dataset path (needs the shard-cache `hf` extra)."""
    builtin: str | None = None
    """`python_stdlib`: the Python standard library's own source files, present on every machine."""
    validation_fraction: float = 0.02
    """With `builtin`, the share of files held out for validation (chosen by a hash of each path)."""
    text_key: str = "text"
    """The field of jsonl/parquet records that holds the text."""
    tokenizer: str | None = None
    """A tokenizer.json file or Hugging Face tokenizer directory; empty: train a byte-level BPE on first use."""
    vocab_size: int = 4096
    """Vocabulary size of the byte-level BPE trained when `tokenizer` is empty."""
    cache_dir: str = "cache"
    """Directory or fsspec URL of the tokenized cache (and of a trained tokenizer); with no source of text, the
    folder of a cache built before: its train/ (and validation/) caches are trained on as they are."""
    shuffle: bool | int = True
    """true: a seeded full permutation of all examples (waits for the cache); N: eras of N examples, each a
    seeded mix of the last 16 eras of the cache; usable while the cache is built; false: cache order."""
    enforce_eos: bool = True
    """Append exactly one end-of-sequence token to every document."""
    chunk_size: int = 256
    """Documents per cache chunk."""
    num_workers: int | None = None
    """Ray workers for the cache build (default: the CPUs Ray sees)."""
    cache_build: str = "auto"
    """How a cache is built: `in_process` (no Ray), `ray` (Ray tasks, on the run's cluster or a local Ray), or
    `auto`: in-process when the inputs total at most 4 MiB, with Ray above that."""
    configs: dict[str, SourceConfig] = field(default_factory=dict)
    """A mixture: {name: source}, each with its own train_urls/validation_urls, id or builtin (docs/mixtures.md)."""
    train_weights: Any = None
    """Mixture weights, {name: weight} or stages [[step, {name: weight}], ...], normalised; 0: evaluation only;
    empty: equal weights."""
    mixture_block_size: int = 2048
    """Examples per mixture block: each block draws from each source its weight's share, exactly."""
    stop_strategy: str = "restart"
    """restart: a source that runs out starts over; first_exhausted: training ends when the first one does."""
    format: DataFormat = field(default_factory=TextFormat)
    """How records become examples: text, chat or prompt_completion (Levanter's formats; `format: chat` is
    short for `format: {type: chat}`)."""
    pack: bool | None = None
    """Pack whole documents into each sequence, with segment ids (attention stays inside a document, positions
    restart); false: one document per row, padded; None: packed for chat and prompt/completion, token windows
    for text."""
    long_documents: str | None = None
    """A document longer than seq_len when packing or padding: `truncate` (keep its first seq_len tokens, so a
    conversation loses its last turns), `split` (into pieces of seq_len) or `drop`; counted and reported.
    None: truncate for chat and prompt/completion, split for text."""
    on_bad_input: str = "fail"
    """A bad record (malformed JSON, a message without role or content, an unknown role, a failing template):
    `fail` names its file and line; `skip` leaves it out and counts it by reason (CLI: --on-bad-input skip)."""

    @property
    def build_in_process(self) -> bool | None:
        """`in_process` for shard_cache.build_cache: True, False, or None (its choice by the inputs' size)."""
        return CACHE_BUILDS[self.cache_build]

    @property
    def is_mixture(self) -> bool:
        return bool(self.configs)

    @property
    def prebuilt(self) -> bool:
        """No source of text: the run trains on the finished caches under cache_dir (train/, validation/)."""
        return not (self.train_urls or self.id is not None or self.builtin is not None or self.configs)

    def __post_init__(self) -> None:
        sources = [bool(self.train_urls), self.id is not None, self.builtin is not None, bool(self.configs)]
        if sum(sources) > 1 or (self.prebuilt and not self.tokenizer):
            raise ConfigError(
                "data: give exactly one source of training text: `data.train_urls`, `data.id`, "
                "`data.builtin: python_stdlib`, or a mixture's `data.configs` (got "
                f"train_urls={list(self.train_urls)}, id={self.id!r}, builtin={self.builtin!r}, "
                f"configs={sorted(self.configs)}). To train on a cache built before, give no source, and "
                "`data.tokenizer` (the one it was built with) with `data.cache_dir` (the folder holding its train/)."
            )
        if self.prebuilt and self.validation_urls:
            raise ConfigError(
                "data.validation_urls: a run on a prebuilt cache (no source of training text) reads its validation "
                "cache from <data.cache_dir>/validation; drop validation_urls, or give the training text too."
            )
        if self.configs and self.validation_urls:
            raise ConfigError(
                "data.validation_urls: a mixture's validation documents belong to its sources; move them to "
                "data.configs.<name>.validation_urls."
            )
        if self.train_weights is not None and not self.configs:
            raise ConfigError(
                "data.train_weights: weights are for a mixture's sources; define them in data.configs ({name: "
                "{train_urls: [...]}}), or drop train_weights for a single source."
            )
        if self.builtin is not None and self.builtin != "python_stdlib":
            raise ConfigError(f"data.builtin: unknown corpus {self.builtin!r}; the built-in corpus is `python_stdlib`.")
        if not 0.0 < self.validation_fraction < 0.5:
            raise ConfigError("data.validation_fraction must be between 0 and 0.5, e.g. 0.02.")
        if self.vocab_size < 260:
            raise ConfigError("data.vocab_size must be at least 260 (256 bytes plus special tokens).")
        if self.on_bad_input not in ("fail", "skip"):
            raise ConfigError(f"data.on_bad_input must be `fail` or `skip`, got {self.on_bad_input!r}.")
        if self.cache_build not in CACHE_BUILDS:
            raise ConfigError(
                f"data.cache_build must be one of {', '.join(CACHE_BUILDS)}, got {self.cache_build!r}: `auto` "
                "builds a small corpus in this process and a large one with Ray."
            )
        if self.long_documents is not None and self.long_documents not in LONG_DOCUMENT_RULES:
            raise ConfigError(
                f"data.long_documents must be one of {', '.join(LONG_DOCUMENT_RULES)}, got {self.long_documents!r}."
            )
        check_format(self.format)
        if self.configs and (self.format.has_loss_mask or self.pack):
            raise ConfigError(
                "data.format / data.pack: chat and prompt_completion records and packing read one source; a "
                "mixture (data.configs) trains on token windows of text. Give the records as data.train_urls."
            )
        own = getattr(self.format, "pack", None)
        if own is not None and self.pack is not None and own != self.pack:
            raise ConfigError(
                f"data.pack is {str(self.pack).lower()} but data.format.pack is {str(own).lower()}; set one of them."
            )

    @property
    def format_type(self) -> str:
        """`text`, `chat`, `prompt_completion` or `supervised`."""
        return format_name(self.format)

    @property
    def packed(self) -> bool:
        """Whether examples are packed sequences of whole documents."""
        own = getattr(self.format, "pack", None)
        chosen = self.pack if self.pack is not None else own
        return chosen if chosen is not None else self.format.has_loss_mask

    @property
    def whole_documents(self) -> bool:
        """Whether examples are whole documents (packed or one per row) rather than windows of the token stream."""
        return self.packed or self.format.has_loss_mask

    @property
    def long_document_rule(self) -> str:
        if self.long_documents is not None:
            return self.long_documents
        return "truncate" if self.format.has_loss_mask else "split"
