"""The `shard-cache` command: build, inspect and verify caches, and train a tokenizer."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from shard_cache.errors import ShardCacheError
from shard_cache.formats import RECORD_FORMATS
from shard_cache.sources import FORMATS, POLICIES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shard-cache", description="Tokenized corpus caches built with Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="tokenize INPUT files into a cache directory (resumes if killed)")
    build.add_argument("inputs", nargs="+", metavar="INPUT", help="paths or fsspec URLs; globs and {1..N} ranges")
    build.add_argument("--tokenizer", required=True, help="a tokenizer.json file or an HF tokenizer directory")
    build.add_argument("--out", required=True, help="the cache directory (a path or fsspec URL)")
    build.add_argument("--format", default="auto", choices=FORMATS, help="input format (default: from the suffix)")
    build.add_argument("--text-field", default="text", help="the jsonl field or parquet column holding the text")
    build.add_argument("--chunk-size", type=int, default=1024, help="documents per chunk (default 1024)")
    build.add_argument("--files-per-shard", type=int, default=1, help="consecutive input files per shard")
    build.add_argument("--num-workers", type=int, default=None, help="parallel Ray tasks (default: cluster CPUs)")
    build.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    build.add_argument("--on-bad-input", default="fail", choices=POLICIES, help="fail, or skip and count")
    build.add_argument("--eos", default=None, help="end-of-document token (default: from the tokenizer)")
    build.add_argument("--bos", default=None, help="beginning-of-document token, with --add-bos")
    build.add_argument("--add-bos", action="store_true", help="put a BOS token before each document")
    build.add_argument(
        "--record-format",
        default="text",
        choices=RECORD_FORMATS,
        help="text (a text field), prompt_completion (prompt + completion fields) or chat (OpenAI messages)",
    )
    build.add_argument(
        "--chat-template",
        default=None,
        help="for chat: a .jinja file, a template name of the tokenizer directory, or the template itself",
    )
    build.add_argument(
        "--no-mask-user-turns", action="store_true", help="train on every token, not only completions/assistant"
    )
    build.add_argument("--no-progress", action="store_true", help="no progress bar")

    inspect = commands.add_parser("inspect", help="print a summary of a cache as JSON")
    inspect.add_argument("cache_dir", metavar="DIR")

    verify = commands.add_parser("verify", help="check every committed chunk's checksum and counts")
    verify.add_argument("cache_dir", metavar="DIR")

    train = commands.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on text files")
    train.add_argument("inputs", nargs="+", metavar="FILE", help="local text files (one document each)")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="where to write tokenizer.json")
    return parser


def _build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shard_cache.build import build_cache
    from shard_cache.formats import record_processor

    template = args.chat_template
    if template is not None and template.endswith(".jinja") and Path(template).is_file():
        template = Path(template).read_text(encoding="utf-8")
    processor = record_processor(
        args.record_format,
        args.tokenizer,
        chat_template=template,
        mask_user_turns=not args.no_mask_user_turns,
        eos_token=args.eos,
        bos_token=args.bos,
        add_bos=args.add_bos,
    )
    result = build_cache(
        args.inputs,
        args.out,
        processor=processor,
        fmt=args.format,
        text_field=args.text_field,
        chunk_size=args.chunk_size,
        files_per_shard=args.files_per_shard,
        on_bad_input=args.on_bad_input,
        num_workers=args.num_workers,
        ray_address=args.ray_address,
        progress=not args.no_progress,
    )
    print(
        f"built {result.cache_dir}: {result.shards} shards, {result.chunks} chunks, {result.docs} documents, "
        f"{result.tokens} tokens" + (f", skipped {result.skipped}" if result.skipped else "")
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from shard_cache.verify import verify_cache

    report = verify_cache(args.cache_dir, progress=True)
    for problem in report.problems:
        print(f"problem: {problem}", file=sys.stderr)
    print(f"{'ok' if report.ok else 'FAILED'}: {report.chunks_checked} chunks checked, {len(report.problems)} problems")
    return 0 if report.ok else 1


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shard_cache.tokenizer_training import train_tokenizer

    tokenizer = train_tokenizer([Path(p) for p in args.inputs], args.vocab_size, save_path=args.out)
    print(f"wrote {args.out}: vocabulary of {tokenizer.get_vocab_size()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; errors print one paragraph and exit with status 2."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            return _build(args)
        if args.command == "inspect":
            from shard_cache.verify import inspect_cache

            print(json.dumps(inspect_cache(args.cache_dir), indent=2))
            return 0
        if args.command == "verify":
            return _verify(args)
        return _train(args)
    except ShardCacheError as exc:
        print(f"shard-cache {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
