"""Chat templates: found in an HF tokenizer directory, compiled and rendered with jinja2 as transformers does.

The environment matches transformers' `apply_chat_template`: a sandboxed, immutable jinja2 environment with
trim_blocks and lstrip_blocks, the loop controls (`break`, `continue`), a `tojson` filter that keeps non-ASCII
text, and the globals `raise_exception`, `strftime_now`, `dict` and `namespace`. Templates see `messages`,
`tools` and `documents` (None here), `add_generation_prompt`, the tokenizer's named special tokens
(`bos_token`, `eos_token`, ...) and any extra variables given.

`{% generation %} ... {% endgeneration %}` marks the text that the assistant generates (transformers'
`return_assistant_tokens_mask` reads the same tag): here each marked piece is wrapped in two private-use
characters while rendering, and `render_marked` returns the text without them plus the character spans they
enclosed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from shard_cache.errors import ShardCacheError

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"
CONFIG_FILE = "tokenizer_config.json"
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Private-use characters that bracket {% generation %} output while rendering; inputs holding them are refused.
GENERATION_START = "\ue000"
GENERATION_END = "\ue001"
MARKERS = (GENERATION_START, GENERATION_END)


def _read_text(fs: Any, path: str) -> str | None:
    try:
        with fs.open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def tokenizer_config(directory: str) -> dict[str, Any]:
    """The tokenizer_config.json of an HF tokenizer directory ({} when there is none)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(directory)
    text = _read_text(fs, root.rstrip("/") + "/" + CONFIG_FILE)
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShardCacheError(f"{directory}/{CONFIG_FILE}: not valid JSON ({exc}). Fix or regenerate it.") from exc
    if not isinstance(config, dict):
        raise ShardCacheError(f"{directory}/{CONFIG_FILE}: expected a JSON object, got {type(config).__name__}.")
    return config


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json, as strings (AddedToken dicts give their content)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def find_templates(directory: str) -> dict[str, str]:
    """Every chat template of an HF tokenizer directory by name, with transformers' precedence.

    chat_template.jinja (the name "default") and additional_chat_templates/NAME.jinja override the
    `chat_template` entry of tokenizer_config.json, which is a string (the default) or a list of
    {"name", "template"} objects.
    """
    import fsspec

    fs, root = fsspec.core.url_to_fs(directory)
    root = root.rstrip("/")
    files: dict[str, str] = {}
    default = _read_text(fs, f"{root}/{TEMPLATE_FILE}")
    if default is not None:
        files["default"] = default
    if fs.isdir(f"{root}/{TEMPLATES_DIR}"):
        for path in sorted(fs.glob(f"{root}/{TEMPLATES_DIR}/*.jinja")):
            name = path.rsplit("/", 1)[-1].removesuffix(".jinja")
            files[name] = _read_text(fs, path) or ""
    if files:
        return files
    entry = tokenizer_config(directory).get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list) and all(isinstance(t, dict) and {"name", "template"} <= set(t) for t in entry):
        return {t["name"]: t["template"] for t in entry}
    raise ShardCacheError(
        f"{directory}/{CONFIG_FILE}: `chat_template` must be a string or a list of {{name, template}} objects, "
        f"got {type(entry).__name__}."
    )


def resolve_template(directory: str | None, chat_template: str | None) -> str:
    """The template to use: `chat_template` itself, a named template of the directory, or its default one."""
    templates = find_templates(directory) if directory is not None else {}
    if chat_template is not None:
        return templates.get(chat_template, chat_template)
    if not templates:
        where = f"the tokenizer directory {directory!r} has none" if directory else "no tokenizer directory was given"
        raise ShardCacheError(
            f"no chat template: {where} (neither {TEMPLATE_FILE} nor a `chat_template` in {CONFIG_FILE}). "
            "Pass chat_template= (a jinja template string, or the name of one of the directory's templates)."
        )
    if "default" not in templates:
        raise ShardCacheError(
            f"{directory} has several chat templates and none is named 'default': {sorted(templates)}. Pass "
            "chat_template= with one of those names."
        )
    return templates["default"]


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def uses_generation_tags(template: str) -> bool:
    """Whether the template marks assistant text with {% generation %} (checked on the parsed template)."""
    import jinja2.nodes

    environment = _environment(datetime(2000, 1, 1))
    tree = environment.parse(template)
    return any(
        isinstance(node.call.node, jinja2.nodes.ExtensionAttribute) for node in tree.find_all(jinja2.nodes.CallBlock)
    )


def _environment(now: datetime) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """{% generation %}body{% endgeneration %}: the body's output, bracketed by the two markers."""

        # jinja2 annotates `tags` as set[str] but only iterates it; a frozenset keeps the class attribute immutable.
        tags = frozenset({"generation"})  # pyright: ignore[reportAssignmentType]

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return GENERATION_START + caller() + GENERATION_END

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        # Unlike jinja's own tojson, no HTML escaping, and non-ASCII text kept, as transformers renders it.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        # A fixed instant, so that every record of a build renders the same date (see ChatProcessor's `now`).
        return now.strftime(fmt)

    class SafeDict:
        """`dict(...)` and `dict.fromkeys(...)` for templates, without the type's other attributes."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class SafeNamespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing attribute names that start with an underscore."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a template may not set the attribute {name!r}")

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=SafeDict(), namespace=SafeNamespace
    )
    return environment


class CompiledTemplate:
    """A chat template compiled in transformers' environment; picklable (it recompiles after unpickling)."""

    def __init__(self, source: str, now: datetime, where: str = "the chat template"):
        import jinja2

        self.source = source
        self.now = now
        self.where = where
        try:
            self._template = _environment(now).from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ShardCacheError(
                f"{where} is not a valid jinja template: {exc.message} (template line {exc.lineno}). Fix the template."
            ) from exc
        self.marks_generation = uses_generation_tags(source)

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "now": self.now, "where": self.where}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"], state["now"], state["where"])  # type: ignore[misc]

    def render_marked(self, variables: Mapping[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its {% generation %} pieces (empty ones dropped)."""
        marked = self._template.render(**variables)
        text: list[str] = []
        spans: list[tuple[int, int]] = []
        length = depth = start = 0
        for piece, marker in _split_markers(marked):
            text.append(piece)
            length += len(piece)
            if marker == GENERATION_START:
                depth += 1
                start = length if depth == 1 else start  # nested tags: the outermost span counts
            elif marker == GENERATION_END and depth:
                depth -= 1
                if depth == 0 and length > start:
                    spans.append((start, length))
        return "".join(text), spans


_MARKER_RE = re.compile(f"([{GENERATION_START}{GENERATION_END}])")


def _split_markers(marked: str) -> list[tuple[str, str | None]]:
    """(text, the marker that follows it or None) pieces of a rendered string."""
    parts = _MARKER_RE.split(marked)
    return [(parts[i], parts[i + 1] if i + 1 < len(parts) else None) for i in range(0, len(parts), 2)]
