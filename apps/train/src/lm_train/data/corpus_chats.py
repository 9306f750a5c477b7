"""The built-in corpus as synthetic conversations: the user asks for a function of the standard library, the
assistant answers with its source. Offline chat data for the SFT tutorial and the packing benchmark.

`python -m lm_train.data.corpus_chats OUT_DIR [--max N]` writes OUT_DIR/train.jsonl and
OUT_DIR/validation.jsonl, one {"messages": [...]} record per line, split by the same path hash as the corpus.
The same Python gives the same files.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import textwrap
from collections.abc import Iterator
from pathlib import Path

from lm_train.data.corpus import _TEST_DIRS, in_validation, stdlib_root

SYSTEM = "You are a helpful assistant who writes Python."
ASKS = (
    "Write the function `{name}` of the module `{module}`.",
    "Show me how `{module}` defines `{name}`.",
    "What is the source of `{module}.{name}`?",
)
FOLLOW_UPS = ("And `{name}`?", "Now `{name}` from the same module, please.")


def _functions(source: str, max_lines: int) -> list[tuple[str, str]]:
    """(name, source) of the module's functions and methods (`Class.method`) that have a docstring and at most
    max_lines lines, in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = [(node.name, node) for node in tree.body if isinstance(node, ast.FunctionDef)]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            found += [(f"{node.name}.{c.name}", c) for c in node.body if isinstance(c, ast.FunctionDef)]
    out = []
    for name, node in found:
        if ast.get_docstring(node) and node.end_lineno is not None:
            if node.end_lineno - node.lineno < max_lines:
                text = ast.get_source_segment(source, node, padded=True)
                if text:
                    out.append((node.lineno, name, textwrap.dedent(text)))
    return [(name, text) for _, name, text in sorted(out)]


def conversations(root: Path | None = None, *, max_lines: int = 12, seed: int = 0) -> Iterator[tuple[str, dict]]:
    """(relative path, record) of every conversation, in the corpus's file order."""
    root = root or stdlib_root()
    # The corpus's files (lm_train.data.corpus), read one by one: a few hundred conversations need few files.
    paths = sorted(
        (p for p in root.rglob("*.py") if not (_TEST_DIRS & set(p.relative_to(root).parts[:-1]))),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    for path in paths:
        relative = path.relative_to(root).as_posix()
        module = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        functions = _functions(path.read_text(encoding="utf-8", errors="replace"), max_lines)
        rng = random.Random(f"{seed}:{relative}")
        i = 0
        while i < len(functions):
            turns = 2 if i + 1 < len(functions) and rng.random() < 0.3 else 1
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
            for j, (name, text) in enumerate(functions[i : i + turns]):
                ask = rng.choice(ASKS if j == 0 else FOLLOW_UPS)
                messages.append({"role": "user", "content": ask.format(name=name, module=module)})
                messages.append({"role": "assistant", "content": text})
            yield relative, {"messages": messages}
            i += turns


def write_chats(out_dir: Path, *, max_conversations: int = 2000, validation_fraction: float = 0.1) -> dict:
    """Write train.jsonl and validation.jsonl under out_dir; returns how many records each got."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "validation": 0}
    with (
        open(out_dir / "train.jsonl", "w", encoding="utf-8") as train,
        open(out_dir / "validation.jsonl", "w", encoding="utf-8") as validation,
    ):
        for relative, record in conversations():
            split = "validation" if in_validation(relative, validation_fraction) else "train"
            if counts["train"] + counts["validation"] >= max_conversations:
                break
            (validation if split == "validation" else train).write(json.dumps(record) + "\n")
            counts[split] += 1
    return counts


def main() -> None:
    assert __doc__ is not None  # the module's docstring, which names the script
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max", type=int, default=2000, help="How many conversations to write in all.")
    args = parser.parse_args()
    counts = write_chats(args.out_dir, max_conversations=args.max)
    print(f"wrote {counts['train']} training and {counts['validation']} validation conversations to {args.out_dir}")


if __name__ == "__main__":
    main()
