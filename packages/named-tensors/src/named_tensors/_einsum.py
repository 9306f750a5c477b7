"""Axis-spec strings: einsum and rearrange.

Spec strings (einsum and rearrange) are made of axis names (letters, digits, underscores), `...`, `,`,
`->`, and, in rearrange only, groups `(a b)` or labelled groups `(label: a b)`. Names are matched by name,
never by position: the order in which an input is written does not matter.

einsum
    `"batch embed, embed heads -> batch heads"`: one comma-separated term per array, listing that array's
    axes. A term lists all of its array's axes unless it holds `...`, which stands for the axes it does not
    name. Every axis not in the output is summed over; axes of the same name in several arrays are aligned.
    Output `...` stands for the axes that the inputs' `...` matched (those named in no term).
    Without `->`, the output keeps, in first-seen order, every axis named in exactly one term plus the
    axes matched by `...`; axes named in two or more terms are summed over. Keyword sizes (`embed=512`)
    are checked against the arrays; `precision` and `preferred_element_type` go to jnp.einsum.

rearrange
    `"batch (position block) embed -> batch position block embed"`. The left side names x's axes (all of
    them, or some plus `...`); a group on the left splits one axis of x into its members, the right side
    lists every resulting axis exactly once in the output order, and a group on the right merges its
    members (in the order written) into one axis. A group is named by its label, `(q: heads head_size)`, or
    else after its first member, so `(position block)` splits or produces an axis named `position`. The
    sizes of split members come from keyword sizes (ints or Axis objects); one member per group may be left
    out and is inferred. `...` must appear on both sides or on neither.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ._core import (
    Axis,
    NamedArray,
    _describe,
    check_unique,
    dot,
    permute,
    union_axes,
)

__all__ = ["einsum", "rearrange"]


# -- spec parsing -------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(\.\.\.|->|[(),:]|\w+|\S+)")
_NAME = re.compile(r"\w+")


def _tokenize(spec: str, what: str) -> list[str]:
    if not isinstance(spec, str):
        raise TypeError(f"{what} needs a spec string, got {type(spec).__name__}")
    tokens = _TOKEN.findall(spec)
    for tok in tokens:
        if not (tok in ("...", "->", "(", ")", ",", ":") or _NAME.fullmatch(tok)):
            raise ValueError(
                f"{what}: bad token {tok!r} in spec {spec!r}; axis names are letters, digits and underscores"
            )
    return tokens


@dataclass(frozen=True)
class _Group:
    """A parenthesised group of axis names, optionally labelled with the name of the merged axis."""

    label: str | None
    members: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.label if self.label is not None else self.members[0]


_Element = str | _Group  # a name, a group, or "..."


def _parse_side(tokens: list[str], spec: str, what: str, allow_groups: bool) -> list[_Element]:
    out: list[_Element] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(":
            if not allow_groups:
                raise ValueError(f"{what}: groups '(...)' are not allowed in spec {spec!r}; use nt.rearrange")
            close = tokens.index(")", i) if ")" in tokens[i:] else -1
            if close < 0:
                raise ValueError(f"{what}: unclosed '(' in spec {spec!r}")
            inner = tokens[i + 1 : close]
            label = None
            if len(inner) >= 2 and inner[1] == ":":
                label = inner[0]
                if not _NAME.fullmatch(label):
                    raise ValueError(f"{what}: bad group label {label!r} in spec {spec!r}")
                inner = inner[2:]
            for t in inner:
                if not _NAME.fullmatch(t):
                    raise ValueError(
                        f"{what}: unexpected token {t!r} inside a group in spec {spec!r}; a group holds axis names only"
                    )
            if not inner:
                raise ValueError(f"{what}: empty group '()' in spec {spec!r}")
            out.append(_Group(label, tuple(inner)))
            i = close + 1
        elif tok == "...":
            if "..." in out:
                raise ValueError(f"{what}: '...' appears twice in one term of spec {spec!r}")
            out.append("...")
            i += 1
        elif _NAME.fullmatch(tok):
            out.append(tok)
            i += 1
        else:
            raise ValueError(f"{what}: unexpected token {tok!r} in spec {spec!r}")
    return out


def _split_arrow(tokens: list[str], spec: str, what: str) -> tuple[list[str], list[str] | None]:
    arrows = [i for i, t in enumerate(tokens) if t == "->"]
    if len(arrows) > 1:
        raise ValueError(f"{what}: more than one '->' in spec {spec!r}")
    if not arrows:
        return tokens, None
    return tokens[: arrows[0]], tokens[arrows[0] + 1 :]


def _names_of(elements: Sequence[_Element]) -> list[str]:
    return [e for e in elements if isinstance(e, str) and e != "..."]


# -- einsum -------------------------------------------------------------------------------------------------


def einsum(
    spec: str,
    *arrays: NamedArray,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type=None,
    **sizes: int,
) -> NamedArray:
    """Contract arrays as an einsum over axis names; `sizes` (name=size) are checked against the arrays."""
    what = "einsum"
    tokens = _tokenize(spec, what)
    lhs, rhs = _split_arrow(tokens, spec, what)
    terms: list[list[str]] = [[]]
    for tok in lhs:
        if tok == ",":
            terms.append([])
        else:
            terms[-1].append(tok)
    if len(terms) != len(arrays):
        raise ValueError(f"{what}: spec {spec!r} has {len(terms)} input term(s) but {len(arrays)} arrays were given")
    for a in arrays:
        if not isinstance(a, NamedArray):
            raise TypeError(f"{what} takes NamedArrays, got {type(a).__name__}")
    parsed = [_parse_side(t, spec, what, allow_groups=False) for t in terms]
    all_axes = union_axes(*(a.axes for a in arrays))

    explicit_count: dict[str, int] = {}
    elided: list[str] = []
    for term, arr in zip(parsed, arrays, strict=True):
        names = _names_of(term)
        check_unique(names)
        for n in names:
            arr.axis_index(n)
            explicit_count[n] = explicit_count.get(n, 0) + 1
        rest = [a.name for a in arr.axes if a.name not in names]
        if rest and "..." not in term:
            raise ValueError(
                f"{what}: term {' '.join(map(str, term))!r} does not name axes {rest} of its array "
                f"{_describe(arr.axes)}; "
                "name them or add '...'"
            )
        elided += [n for n in rest if n not in elided]
    elided = [n for n in elided if n not in explicit_count]

    for name, size in sizes.items():
        matching = [a for a in all_axes if a.name == name]
        if not matching:
            raise ValueError(f"{what}: size given for unknown axis {name!r}; the arrays have {_describe(all_axes)}")
        if matching[0].size != size:
            raise ValueError(f"{what}: axis {name!r} has size {matching[0].size}, but {name}={size} was given")

    if rhs is None:
        kept = {n for n, c in explicit_count.items() if c == 1} | set(elided)
        out_names = [a.name for a in all_axes if a.name in kept]
    else:
        if "," in rhs:
            raise ValueError(f"{what}: the output of spec {spec!r} must be a single term (found ',')")
        out_elements = _parse_side(rhs, spec, what, allow_groups=False)
        explicit_out = _names_of(out_elements)
        check_unique(explicit_out)
        known = {a.name for a in all_axes}
        for n in explicit_out:
            if n not in known:
                raise ValueError(
                    f"{what}: unknown output axis {n!r} in spec {spec!r}; the arrays have {_describe(all_axes)}"
                )
        out_names = []
        for e in out_elements:
            if e == "...":
                out_names += [n for n in elided if n not in explicit_out]
            else:
                out_names.append(e)
    contracted = [a.name for a in all_axes if a.name not in out_names]
    result = dot(*arrays, axis=contracted, precision=precision, preferred_element_type=preferred_element_type)
    return permute(result, out_names)


# -- rearrange ----------------------------------------------------------------------------------------------


def _size_table(axes: Sequence[Axis], sizes: dict[str, int | Axis], what: str) -> dict[str, int]:
    table: dict[str, int] = {}
    for a in axes:
        if not isinstance(a, Axis):
            raise TypeError(f"{what}: positional sizes must be Axis objects, got {a!r}")
        table[a.name] = a.size
    for name, s in sizes.items():
        size = s.size if isinstance(s, Axis) else s
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TypeError(f"{what}: size of {name!r} must be a non-negative int or an Axis, got {s!r}")
        if name in table and table[name] != size:
            raise ValueError(f"{what}: axis {name!r} is given sizes {table[name]} and {size}")
        table[name] = size
    return table


def _split_sizes(group: _Group, total: int, table: dict[str, int], what: str) -> list[Axis]:
    unknown = [m for m in group.members if m not in table]
    if len(unknown) > 1:
        raise ValueError(
            f"{what}: cannot infer the sizes of {unknown} when splitting axis {group.name!r} "
            f"of size {total}; "
            f"give all but one of them, e.g. {unknown[0]}=..."
        )
    known_product = math.prod(table[m] for m in group.members if m in table)
    if unknown:
        if known_product == 0 or total % known_product:
            raise ValueError(
                f"{what}: axis {group.name!r} of size {total} does not split evenly into "
                f"{list(group.members)} "
                f"with known sizes { ({m: table[m] for m in group.members if m in table}) }"
            )
        inferred = {unknown[0]: total // known_product}
    else:
        inferred = {}
        if known_product != total:
            raise ValueError(
                f"{what}: axis {group.name!r} has size {total}, but {list(group.members)} have sizes "
                f"{[table[m] for m in group.members]} whose product is {known_product}"
            )
    return [Axis(m, table[m] if m in table else inferred[m]) for m in group.members]


def rearrange(x: NamedArray, spec: str, *axes: Axis, **sizes: int | Axis) -> NamedArray:
    """Permute, split and merge x's axes as `spec` says (see the module docstring for the syntax)."""
    what = "rearrange"
    if not isinstance(x, NamedArray):
        raise TypeError(f"{what} takes a NamedArray, got {type(x).__name__}")
    tokens = _tokenize(spec, what)
    lhs_tokens, rhs_tokens = _split_arrow(tokens, spec, what)
    if rhs_tokens is None:
        raise ValueError(f"{what}: spec {spec!r} needs '->' between the input and the output")
    for side in (lhs_tokens, rhs_tokens):
        if "," in side:
            raise ValueError(f"{what}: unexpected token ',' in spec {spec!r}; rearrange takes one array")
    lhs = _parse_side(lhs_tokens, spec, what, allow_groups=True)
    rhs = _parse_side(rhs_tokens, spec, what, allow_groups=True)
    if ("..." in lhs) != ("..." in rhs):
        raise ValueError(f"{what}: '...' must appear on both sides of spec {spec!r} or on neither")
    table = _size_table(axes, sizes, what)

    # Left side: which axes of x are read, and what each becomes after splitting.
    sources = [e.name if isinstance(e, _Group) else e for e in lhs if e != "..."]
    check_unique(sources)
    for name in sources:
        x.axis_index(name)
    rest = [a for a in x.axes if a.name not in sources]
    if rest and "..." not in lhs:
        raise ValueError(
            f"{what}: the left side of {spec!r} does not name axes {[a.name for a in rest]} of "
            f"{_describe(x.axes)}; name them or add '...'"
        )
    # Duplicates first: a repeated name would otherwise surface as a confusing size error.
    check_unique(
        [a.name for a in rest] + [n for e in lhs if e != "..." for n in (e.members if isinstance(e, _Group) else (e,))]
    )
    source_order: list[str] = []
    split_axes: list[Axis] = []
    for e in lhs:
        if e == "...":
            source_order += [a.name for a in rest]
            split_axes += rest
        elif isinstance(e, _Group):
            source_order.append(e.name)
            split_axes += _split_sizes(e, x.resolve_axis(e.name).size, table, what)
        else:
            source_order.append(e)
            split_axes.append(x.resolve_axis(e))
    check_unique(split_axes)
    for a in split_axes:
        if a.name in table and table[a.name] != a.size:
            raise ValueError(f"{what}: axis {a.name!r} has size {a.size}, but size {table[a.name]} was given")
    used_sizes = {a.name for a in split_axes}
    unused = [n for n in table if n not in used_sizes]
    if unused:
        raise ValueError(f"{what}: sizes given for axes {unused} that spec {spec!r} does not use")

    src = permute(x, source_order)
    split_arr = jnp.reshape(src.array, tuple(a.size for a in split_axes))
    by_name = {a.name: a for a in split_axes}
    elided = [a.name for a in rest]

    # Right side: the order of the split axes, and the groups to merge.
    out_groups: list[tuple[str | None, list[Axis]]] = []  # (merged name or None for a plain axis, members)
    for e in rhs:
        if e == "...":
            out_groups += [(None, [by_name[n]]) for n in elided]
            continue
        members = e.members if isinstance(e, _Group) else (e,)
        for m in members:
            if m not in by_name:
                raise ValueError(
                    f"{what}: unknown axis {m!r} on the right side of {spec!r}; "
                    f"the left side gives {[a.name for a in split_axes]}"
                )
        out_groups.append((e.name if isinstance(e, _Group) else None, [by_name[m] for m in members]))
    flat_out = [a.name for _, members in out_groups for a in members]
    check_unique(flat_out)
    dropped = [a.name for a in split_axes if a.name not in flat_out]
    if dropped:
        raise ValueError(
            f"{what}: axes {dropped} of the left side are missing on the right side of {spec!r}; "
            "rearrange does not drop axes (use a reduction)"
        )
    order = [split_axes.index(by_name[n]) for n in flat_out]
    moved = jnp.transpose(split_arr, order)
    out_axes = [
        members[0] if label is None else Axis(label, math.prod(a.size for a in members))
        for label, members in out_groups
    ]
    check_unique(out_axes)
    return NamedArray(jnp.reshape(moved, tuple(a.size for a in out_axes)), out_axes)
