"""One self-contained HTML page of documents whose tokens are shaded by their log-prob (or a difference of two).

No network: the CSS and the little script are inline. Each token is a `<span class="tok">` whose `data-lp`
holds the value shown (log-prob, or log-prob under the second checkpoint minus under the first), so the page
can be read back by a program as well as by eye.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1f2328; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
.meta { color: #57606a; font-size: 13px; margin-bottom: 12px; }
.legend { display: flex; align-items: center; gap: 8px; font-size: 12px; margin: 8px 0 16px 0; }
.scale { width: 240px; height: 12px; border: 1px solid #d0d7de; }
.doc { border: 1px solid #d0d7de; border-radius: 6px; margin: 0 0 18px 0; }
.doc h2 { font-size: 14px; margin: 0; padding: 6px 10px; background: #f6f8fa; border-bottom: 1px solid #d0d7de; }
.doc h2 span { color: #57606a; font-weight: normal; }
.text { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; line-height: 1.5;
        white-space: pre-wrap; word-break: break-all; padding: 8px 10px; margin: 0; }
.tok { border-radius: 2px; }
.tok:hover { outline: 1px solid #0969da; }
.tok.first { color: #8c959f; }
#info { position: fixed; right: 16px; top: 16px; background: #24292f; color: #fff; font: 12px ui-monospace, monospace;
        padding: 6px 10px; border-radius: 6px; display: none; white-space: pre; z-index: 10; }
"""

SCRIPT = """
const info = document.getElementById('info');
document.querySelectorAll('.tok').forEach(function (el) {
  el.addEventListener('mouseenter', function () { info.textContent = el.title; info.style.display = 'block'; });
  el.addEventListener('mouseleave', function () { info.style.display = 'none'; });
});
"""


@dataclass(frozen=True)
class ScoredDocument:
    """A document's token texts and values; values[i] is None for a token that was not predicted (the first)."""

    name: str
    tokens: Sequence[str]
    token_ids: Sequence[int]
    values: Sequence[float | None]
    base: Sequence[float | None] | None = None
    """With a comparison: the baseline's log-probs (A); values then hold B minus A."""


def _shade(value: float | None, compare: bool) -> str:
    """The background of a token: red for unlikely tokens; for differences, blue (better) or red (worse)."""
    if value is None or not math.isfinite(value):
        return ""
    if compare:
        alpha = min(1.0, abs(value) / 4.0)
        rgb = "9, 105, 218" if value > 0 else "207, 34, 46"
    else:
        alpha = min(1.0, -value / 8.0)
        rgb = "207, 34, 46"
    return f"background: rgba({rgb}, {alpha:.3f});"


def _title(doc: ScoredDocument, i: int, compare: bool) -> str:
    value, token = doc.values[i], doc.tokens[i]
    head = f"token {i} id {doc.token_ids[i]} {token!r}"
    if value is None:
        return f"{head}\nfirst token: not predicted"
    if compare and doc.base is not None:
        first = doc.base[i]
        assert first is not None  # a difference B - A exists only where the baseline A has a log-prob
        return f"{head}\nlog-prob A {first:.4f}\nlog-prob B {first + value:.4f}\nB - A {value:+.4f}"
    return f"{head}\nlog-prob {value:.4f}\np {math.exp(value):.4f}"


def _document_html(doc: ScoredDocument, compare: bool) -> str:
    spans = []
    for i, token in enumerate(doc.tokens):
        value = doc.values[i]
        data = "" if value is None else f' data-lp="{value:.6f}"'
        css = "tok first" if value is None else "tok"
        style = _shade(value, compare)
        style_attr = f' style="{style}"' if style else ""
        title = html.escape(_title(doc, i, compare), quote=True)
        spans.append(f'<span class="{css}"{data}{style_attr} title="{title}">{html.escape(token)}</span>')
    known = [v for v in doc.values if v is not None]
    mean = sum(known) / len(known) if known else float("nan")
    what = "mean B - A" if compare else "mean log-prob"
    return (
        f'<section class="doc"><h2>{html.escape(doc.name)} <span>{len(doc.tokens)} tokens, {what} '
        f'{mean:+.3f}</span></h2><pre class="text">{"".join(spans)}</pre></section>'
    )


def _legend(compare: bool) -> str:
    if compare:
        gradient = "linear-gradient(to right, rgba(207,34,46,1), rgba(255,255,255,1), rgba(9,105,218,1))"
        ends = ("B worse by 4 nats", "B better by 4 nats")
    else:
        gradient = "linear-gradient(to right, rgba(207,34,46,1), rgba(255,255,255,1))"
        ends = ("log-prob -8 or less", "0 (certain)")
    return (
        f'<div class="legend"><span>{ends[0]}</span><div class="scale" style="background: {gradient}"></div>'
        f"<span>{ends[1]}</span><span>· hover a token for its value</span></div>"
    )


def render_page(title: str, meta: Sequence[str], documents: Sequence[ScoredDocument], *, compare: bool) -> str:
    """The whole page as one HTML string."""
    body = "".join(_document_html(d, compare) for d in documents)
    lines = "<br>".join(html.escape(m) for m in meta)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><div class="meta">{lines}</div>{_legend(compare)}{body}'
        f'<div id="info"></div><script>{SCRIPT}</script></body></html>\n'
    )
