"""Read the documents of one input file: jsonl, plain text (per file or per line), parquet, or a HF dataset.

Compressed files (.gz, .zst/.zstd, .bz2, .xz) are decompressed on the fly. Bad documents either fail with a
message naming the file and line, or are skipped and counted, as the policy says.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, Literal, cast

from shard_cache.errors import BadInputError, ShardCacheError
from shard_cache.fs import get_fs, storage_error
from shard_cache.inputs import HF_PREFIX

Format = Literal["auto", "jsonl", "text", "lines", "parquet"]
Policy = Literal["fail", "skip"]
FORMATS = ("auto", "jsonl", "text", "lines", "parquet")
POLICIES = ("fail", "skip")
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bz2", ".xz": "xz"}
_SKIP_HINT = "Fix the input, or pass on_bad_input='skip' (CLI: --on-bad-input skip) to skip and count such documents."


def compression_of(url: str) -> str | None:
    """The compression that the file name's suffix announces, or None."""
    for suffix, name in _COMPRESSIONS.items():
        if url.endswith(suffix):
            return name
    return None


def format_of(url: str, fmt: Format) -> str:
    """Resolve `auto` to a concrete format from the file name (compression suffix ignored)."""
    if fmt != "auto":
        return fmt
    if url.startswith(HF_PREFIX):
        return "hf"
    name = url
    for suffix in _COMPRESSIONS:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    if name.endswith((".jsonl", ".ndjson", ".json")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _decompressed(raw: BinaryIO, compression: str | None) -> BinaryIO | io.BufferedIOBase:
    if compression is None:
        return raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "bz2":
        return bz2.BZ2File(raw, mode="rb")
    if compression == "xz":
        return lzma.LZMAFile(raw, mode="rb")
    import zstandard

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False))


class DocumentReader:
    """Iterates the documents of one file, counting skipped ones by reason and the raw bytes consumed."""

    def __init__(
        self,
        url: str,
        fmt: Format = "auto",
        text_field: str = "text",
        on_bad_input: Policy = "fail",
        skipped: Counter[str] | None = None,
        prepare: Callable[[Mapping[str, Any]], Any] | None = None,
        record_fields: tuple[str, ...] = (),
        located: bool = False,
    ):
        """`prepare` (a record processor's) turns each whole record into the document, instead of `text_field`;
        `located`: it is called with the record's file and line too."""
        if on_bad_input not in POLICIES:
            raise ValueError(f"on_bad_input must be one of {POLICIES}, got {on_bad_input!r}.")
        self.url = url
        self.format = format_of(url, fmt)
        if self.format not in (*FORMATS, "hf"):
            raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}.")
        self.text_field = text_field
        self.on_bad_input = on_bad_input
        self.skipped: Counter[str] = skipped if skipped is not None else Counter()
        self.prepare = prepare
        self.record_fields = record_fields
        self.located = located
        self._raw: BinaryIO | None = None
        self._end_bytes = 0

    @property
    def bytes_read(self) -> int:
        """Bytes of the (possibly compressed) file consumed so far."""
        if self._raw is None or self._raw.closed:
            return self._end_bytes
        try:
            return self._raw.tell()
        except (OSError, ValueError):
            return 0

    def _bad(self, reason: str, where: str, message: str) -> None:
        if self.on_bad_input == "fail":
            raise BadInputError(f"{where}: {message}. {_SKIP_HINT}")
        self.skipped[reason] += 1

    def _accept(self, text: str, where: str) -> bool:
        if not text.strip():
            self._bad("empty", where, "empty document")
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        if self.format == "hf":
            yield from self._iter_hf()
            return
        try:
            fs, path = get_fs(self.url, listings_cache=True)
            raw = cast(BinaryIO, fs.open(path, "rb"))  # fsspec's open is untyped; "rb" gives a binary file
        except ShardCacheError as exc:
            raise BadInputError(str(exc)) from exc
        except OSError as exc:
            raise BadInputError(str(storage_error(exc, self.url, writing=False, verb="open"))) from exc
        except Exception as exc:
            raise BadInputError(
                f"{self.url}: cannot open it ({type(exc).__name__}: {exc}). Check the path, URL and network."
            ) from exc
        self._raw = raw
        with raw:
            try:
                yield from self._iter_open(raw)
            finally:
                self._end_bytes = self.bytes_read

    def _iter_open(self, raw: BinaryIO) -> Iterator[str]:
        if self.format == "parquet":
            yield from self._iter_parquet(raw)
            return
        if self.prepare is not None and self.format in ("text", "lines"):
            raise BadInputError(
                f"{self.url}: the record format reads records (jsonl, parquet or hf:), but this file is read as "
                f"{self.format!r}. Give the file a .jsonl or .parquet name, or pass fmt='jsonl' (CLI: --format)."
            )
        stream = _decompressed(raw, compression_of(self.url))
        try:
            if self.format == "text":
                yield from self._iter_whole(stream)
            elif self.format == "lines":
                yield from self._iter_lines(stream)
            else:
                yield from self._iter_jsonl(stream)
        except (OSError, EOFError, lzma.LZMAError) as exc:
            raise BadInputError(
                f"{self.url}: cannot decompress or read it ({type(exc).__name__}: {exc}). Check that the "
                "file is complete and that its suffix matches its compression."
            ) from exc

    def _decode(self, data: bytes, where: str, line_base: int) -> str | None:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = line_base + data[: exc.start].count(b"\n")
            self._bad(
                "not_utf8",
                f"{self.url}:{line}",
                f"bytes that are not valid UTF-8 (at byte {exc.start}: {data[exc.start : exc.start + 4]!r})",
            )
            return None

    def _iter_whole(self, stream: BinaryIO | io.BufferedIOBase) -> Iterator[str]:
        text = self._decode(stream.read(), self.url, 1)
        if text is not None and self._accept(text, self.url):
            yield text

    def _iter_lines(self, stream: BinaryIO | io.BufferedIOBase) -> Iterator[str]:
        for lineno, line in enumerate(stream, start=1):
            text = self._decode(line.rstrip(b"\r\n"), f"{self.url}:{lineno}", lineno)
            if text is not None and self._accept(text, f"{self.url}:{lineno}"):
                yield text

    def _iter_jsonl(self, stream: BinaryIO | io.BufferedIOBase) -> Iterator[str]:
        for lineno, line in enumerate(stream, start=1):
            where = f"{self.url}:{lineno}"
            if not line.strip():
                continue  # blank lines (a trailing newline) carry no document
            decoded = self._decode(line, where, lineno)
            if decoded is None:
                continue
            try:
                record = json.loads(decoded)
            except json.JSONDecodeError as exc:
                self._bad("malformed_json", where, f"malformed JSON ({exc.msg} at column {exc.colno})")
                continue
            doc = self._document_of(record, where)
            if doc is not None:
                yield doc

    def _document_of(self, record: Any, where: str) -> Any:
        """The document of one record (its text, or what `prepare` makes of it), or None if it is bad."""
        if self.prepare is None:
            text = self._text_of(record, where)
            return text if text is not None and self._accept(text, where) else None
        if not isinstance(record, dict):
            self._bad("not_an_object", where, f"the record is a JSON {type(record).__name__}, not an object")
            return None
        from shard_cache.records import BadRecord

        try:
            return self.prepare(record, where) if self.located else self.prepare(record)  # type: ignore[call-arg]
        except BadRecord as exc:
            self._bad(exc.reason, where, exc.message)
            return None

    def _text_of(self, record: Any, where: str) -> str | None:
        if not isinstance(record, dict):
            self._bad("not_an_object", where, f"the line is a JSON {type(record).__name__}, not an object")
            return None
        if self.text_field not in record:
            keys = ", ".join(sorted(record)[:10])
            self._bad(
                "missing_field",
                where,
                f"no field {self.text_field!r} (the line has: {keys}); choose the field with text_field= "
                "(CLI: --text-field)",
            )
            return None
        text = record[self.text_field]
        if not isinstance(text, str):
            self._bad("not_a_string", where, f"field {self.text_field!r} holds a {type(text).__name__}, not text")
            return None
        return text

    def _iter_parquet(self, raw: BinaryIO) -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(raw)
        except Exception as exc:
            raise BadInputError(f"{self.url}: not a readable Parquet file ({exc}).") from exc
        names = parquet.schema_arrow.names
        if self.prepare is not None:
            columns = [n for n in self.record_fields if n in names]
            row = 0
            for batch in parquet.iter_batches(columns=columns, batch_size=4096):
                for record in batch.to_pylist():
                    row += 1
                    doc = self._document_of(record, f"{self.url}:row {row}")
                    if doc is not None:
                        yield doc
            return
        if self.text_field not in names:
            raise BadInputError(
                f"{self.url}: no column {self.text_field!r} (columns: {', '.join(names)}). Choose the column "
                "with text_field= (CLI: --text-field)."
            )
        row = 0
        for batch in parquet.iter_batches(columns=[self.text_field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                row += 1
                where = f"{self.url}:row {row}"
                if not isinstance(value, str):
                    self._bad("not_a_string", where, f"column {self.text_field!r} holds {value!r}, not text")
                elif self._accept(value, where):
                    yield value

    def _iter_hf(self) -> Iterator[str]:
        spec = self.url[len(HF_PREFIX) :]
        name, _, split = spec.partition("@")
        try:
            import datasets
        except ImportError as exc:
            raise BadInputError(
                f"{self.url}: Hugging Face datasets need the `hf` extra: pip install 'shard-cache[hf]'."
            ) from exc
        try:
            dataset = datasets.load_dataset(name, split=split or "train", streaming=True)
        except Exception as exc:
            raise BadInputError(
                f"{self.url}: cannot load the Hugging Face dataset {name!r} ({type(exc).__name__}: {exc}). "
                "Check the id or local path and the split (hf:NAME@SPLIT)."
            ) from exc
        for row, record in enumerate(dataset, start=1):
            doc = self._document_of(record, f"{self.url}:row {row}")
            if doc is not None:
                yield doc
