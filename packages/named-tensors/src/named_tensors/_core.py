"""Axis and NamedArray: a jax array whose dimensions are looked up by name."""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ._axis import Axis, AxisSelection, AxisSelector, AxisSpec, Scalar, axis_name


def as_axis_tuple(axes: AxisSelection | None) -> tuple[AxisSelector, ...]:
    """A single selector or a sequence of them, as a tuple."""
    if axes is None:
        return ()
    if isinstance(axes, Axis | str):
        return (axes,)
    return tuple(axes)


def _describe(axes: Sequence[Axis]) -> str:
    return "(" + ", ".join(f"{a.name}={a.size}" for a in axes) + ")"


def check_unique(axes: Sequence[AxisSelector]) -> None:
    """Raise if any axis name occurs twice."""
    names = [axis_name(a) for a in axes]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"Duplicate axis name(s) {dupes} in axes {names}: every axis of an array needs its own name")


@jax.tree_util.register_pytree_node_class
class NamedArray:
    """A jax array plus one named Axis per dimension."""

    __slots__ = ("array", "axes")
    # Make numpy defer to our operators (np.float32(2) * x) instead of broadcasting positionally.
    __array_priority__ = 1000

    def __init__(self, array: Any, axes: Sequence[Axis]):
        axes = tuple(axes)
        for a in axes:
            if not isinstance(a, Axis):
                raise TypeError(f"NamedArray axes must be Axis objects, got {a!r} in {axes}")
        check_unique(axes)
        shape = getattr(array, "shape", None)
        if shape is not None and tuple(shape) != tuple(a.size for a in axes):
            raise ValueError(
                f"Array of shape {tuple(shape)} does not fit axes {_describe(axes)}: "
                "give one Axis per dimension with matching sizes"
            )
        self.array = array
        self.axes = axes

    if TYPE_CHECKING:  # installed at import by _install_operators and _indexing; declared for type checkers

        def __add__(self, other: Any) -> NamedArray: ...
        def __radd__(self, other: Any) -> NamedArray: ...
        def __sub__(self, other: Any) -> NamedArray: ...
        def __rsub__(self, other: Any) -> NamedArray: ...
        def __mul__(self, other: Any) -> NamedArray: ...
        def __rmul__(self, other: Any) -> NamedArray: ...
        def __truediv__(self, other: Any) -> NamedArray: ...
        def __rtruediv__(self, other: Any) -> NamedArray: ...
        def __floordiv__(self, other: Any) -> NamedArray: ...
        def __rfloordiv__(self, other: Any) -> NamedArray: ...
        def __mod__(self, other: Any) -> NamedArray: ...
        def __rmod__(self, other: Any) -> NamedArray: ...
        def __pow__(self, other: Any) -> NamedArray: ...
        def __rpow__(self, other: Any) -> NamedArray: ...
        def __and__(self, other: Any) -> NamedArray: ...
        def __rand__(self, other: Any) -> NamedArray: ...
        def __or__(self, other: Any) -> NamedArray: ...
        def __ror__(self, other: Any) -> NamedArray: ...
        def __xor__(self, other: Any) -> NamedArray: ...
        def __rxor__(self, other: Any) -> NamedArray: ...
        def __lt__(self, other: Any) -> NamedArray: ...
        def __le__(self, other: Any) -> NamedArray: ...
        def __gt__(self, other: Any) -> NamedArray: ...
        def __ge__(self, other: Any) -> NamedArray: ...
        def __eq__(self, other: Any) -> NamedArray: ...  # type: ignore[override]
        def __ne__(self, other: Any) -> NamedArray: ...  # type: ignore[override]
        def __matmul__(self, other: Any) -> NamedArray: ...
        def __rmatmul__(self, other: Any) -> NamedArray: ...
        def __neg__(self) -> NamedArray: ...
        def __pos__(self) -> NamedArray: ...
        def __abs__(self) -> NamedArray: ...
        def __invert__(self) -> NamedArray: ...
        def __getitem__(self, key: Any) -> NamedArray: ...
        @property
        def at(self) -> Any: ...

    # -- pytree ---------------------------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.array,), self.axes

    @classmethod
    def tree_unflatten(cls, axes, children):
        # No validation: jax transformations rebuild trees with placeholder leaves (None, object(), tracers
        # whose shape differs under vmap), and equinox partitions leave None in place of arrays.
        obj = object.__new__(cls)
        obj.array = children[0]
        obj.axes = axes
        return obj

    # -- axis lookup ----------------------------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """Axis name to size."""
        return {a.name: a.size for a in self.axes}

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        return int(np.prod([a.size for a in self.axes], dtype=np.int64))

    @property
    def dtype(self):
        return self.array.dtype

    def has_axis(self, axis: AxisSelection) -> bool:
        """Whether every given axis is present (by name)."""
        names = self.axis_names
        return all(axis_name(a) in names for a in as_axis_tuple(axis))

    def axis_index(self, axis: AxisSelector) -> int:
        """Position of an axis, with a clear error (and a size check when an Axis is given)."""
        name = axis_name(axis)
        for i, a in enumerate(self.axes):
            if a.name == name:
                if isinstance(axis, Axis) and axis.size != a.size:
                    raise ValueError(
                        f"Axis {name!r} has size {a.size} in array with axes {_describe(self.axes)}, "
                        f"but size {axis.size} was asked for"
                    )
                return i
        raise ValueError(f"Unknown axis {name!r}: this array has axes {_describe(self.axes)}")

    def resolve_axis(self, axis: AxisSelector) -> Axis:
        """The Axis object of this array with the given name."""
        return self.axes[self.axis_index(axis)]

    def axis_size(self, axis: AxisSelector) -> int:
        return self.resolve_axis(axis).size

    def __repr__(self) -> str:
        return f"NamedArray({_describe(self.axes)}, dtype={getattr(self.array, 'dtype', None)})"

    def __len__(self) -> int:
        if not self.axes:
            raise TypeError("len() of a 0-d NamedArray")
        return self.axes[0].size

    def __bool__(self) -> bool:
        return bool(self.array)

    def __float__(self) -> float:
        return float(self.array)

    def __int__(self) -> int:
        return int(self.array)

    def __jax_array__(self):
        # Refuse silent positional use: jnp functions would otherwise drop the names.
        raise TypeError(
            "A NamedArray cannot be used where a positional jax array is expected; use x.array "
            "(after nt.permute to a known axis order) or a named_tensors function"
        )

    def item(self):
        return self.array.item()

    def scalar(self) -> jax.Array:
        """The underlying value of a 0-d NamedArray."""
        if self.axes:
            raise ValueError(f"scalar() needs a 0-d array, this one has axes {_describe(self.axes)}")
        return self.array

    # -- conversions ----------------------------------------------------------------------------------------
    def astype(self, dtype) -> NamedArray:
        return NamedArray(self.array.astype(dtype), self.axes)

    def rename(self, renames: dict[AxisSelector, AxisSelector]) -> NamedArray:
        return rename(self, renames)

    def permute(self, *axes: AxisSelector | EllipsisType) -> NamedArray:
        return permute(self, axes)

    def broadcast_to(self, axes: AxisSpec) -> NamedArray:
        return broadcast_to(self, axes)

    # Operators are attached below by _install_operators.


def named(array: Any, axes: AxisSpec | Sequence[AxisSelector] | str) -> NamedArray:
    """Name the dimensions of an array; names alone take their sizes from the array's shape."""
    array = jnp.asarray(array)
    axes = as_axis_tuple(axes)
    if len(axes) != array.ndim:
        raise ValueError(
            f"Array of shape {array.shape} has {array.ndim} dimensions but {len(axes)} axes were given: "
            f"{[axis_name(a) for a in axes]}"
        )
    resolved = []
    for a, n in zip(axes, array.shape, strict=True):
        if isinstance(a, str):
            resolved.append(Axis(a, n))
        elif a.size != n:
            raise ValueError(f"Axis {a.name!r} has size {a.size}, but the array's dimension there has size {n}")
        else:
            resolved.append(a)
    return NamedArray(array, resolved)


def is_named(x: Any) -> bool:
    return isinstance(x, NamedArray)


def _as_named_operand(x: Any, op_name: str) -> NamedArray | Any:
    if isinstance(x, NamedArray):
        return x
    if isinstance(x, Scalar):
        return x
    if hasattr(x, "ndim") and x.ndim == 0:
        return x
    raise TypeError(
        f"{op_name}: cannot combine a NamedArray with an unnamed array of shape {getattr(x, 'shape', '?')}; "
        "name its axes with nt.named(array, axes) so that broadcasting happens by name"
    )


def union_axes(*axis_lists: Sequence[Axis]) -> tuple[Axis, ...]:
    """Axes of all lists, in first-seen order; a name seen with two sizes is an error naming both."""
    out: dict[str, Axis] = {}
    for axes in axis_lists:
        for a in axes:
            seen = out.get(a.name)
            if seen is None:
                out[a.name] = a
            elif seen.size != a.size:
                raise ValueError(
                    f"Axis {a.name!r} has size {seen.size} in one array and {a.size} in another: "
                    "arrays combined by name must agree on the size of each shared axis"
                )
    return tuple(out.values())


def permute(x: NamedArray, axes: Sequence[AxisSelector | EllipsisType]) -> NamedArray:
    """Reorder x's axes; `...` in `axes` stands for the axes not named, in their current order."""
    axes = tuple(axes)
    if sum(a is Ellipsis for a in axes) > 1:
        raise ValueError(f"permute takes at most one '...', got {axes}")
    names = [axis_name(a) for a in axes if not isinstance(a, EllipsisType)]
    check_unique(names)
    for a in axes:
        if not isinstance(a, EllipsisType):
            x.axis_index(a)
    if Ellipsis in axes:
        rest = [a.name for a in x.axes if a.name not in names]
        i = axes.index(Ellipsis)
        names = names[:i] + rest + names[i:]
    if len(names) != x.ndim:
        missing = [a.name for a in x.axes if a.name not in names]
        raise ValueError(f"permute must name every axis (or use ...); missing {missing} of {_describe(x.axes)}")
    order = [x.axis_index(n) for n in names]
    if order == list(range(x.ndim)):
        return x
    return NamedArray(jnp.transpose(x.array, order), [x.axes[i] for i in order])


def broadcast_to(x: NamedArray | Scalar | jax.Array, axes: AxisSpec, *, enforce_no_extra: bool = True) -> NamedArray:
    """Broadcast x to `axes` (in that order); with enforce_no_extra=False, x's other axes go first."""
    selected = as_axis_tuple(axes)
    for a in selected:
        if not isinstance(a, Axis):
            raise TypeError(f"broadcast_to needs Axis objects (with sizes), got {a!r}")
    target = tuple(a for a in selected if isinstance(a, Axis))  # all of them: the loop above checked
    check_unique(target)
    if not isinstance(x, NamedArray):
        x = NamedArray(jnp.asarray(x), ())
    union_axes(target, x.axes)  # size check
    target_names = {a.name for a in target}
    extra = [a for a in x.axes if a.name not in target_names]
    if extra and enforce_no_extra:
        raise ValueError(
            f"Cannot broadcast array with axes {_describe(x.axes)} to {_describe(target)}: "
            f"axes {[a.name for a in extra]} are not in the target"
        )
    full = tuple(extra) + target
    if x.axes == full:
        return x
    # Insert size-1 dims for the new axes, then let jnp broadcast positionally within our known layout.
    src = permute(x, [a.name for a in full if a.name in x.axis_names])
    expanded_shape = tuple(a.size if a.name in x.axis_names else 1 for a in full)
    arr = jnp.reshape(src.array, expanded_shape)
    arr = jnp.broadcast_to(arr, tuple(a.size for a in full))
    return NamedArray(arr, full)


def broadcast_arrays(*arrays: NamedArray | Scalar) -> tuple[NamedArray | Scalar, ...]:
    """Broadcast NamedArrays against each other by name; scalars pass through."""
    named_ones = [a for a in arrays if isinstance(a, NamedArray)]
    if not named_ones:
        return arrays
    full = union_axes(*(a.axes for a in named_ones))
    return tuple(broadcast_to(a, full) if isinstance(a, NamedArray) else a for a in arrays)


def _raw(x: Any) -> Any:
    return x.array if isinstance(x, NamedArray) else x


def elementwise(fn: Callable[..., jax.Array], *args: Any, op_name: str | None = None) -> NamedArray:
    """Apply a positional elementwise function to arguments broadcast by name."""
    name = op_name or getattr(fn, "__name__", "elementwise op")
    checked = [_as_named_operand(a, name) for a in args]
    if not any(isinstance(a, NamedArray) for a in checked):
        raise TypeError(f"{name} needs at least one NamedArray among its arguments")
    aligned = broadcast_arrays(*checked)
    axes = next(a.axes for a in aligned if isinstance(a, NamedArray))
    return NamedArray(fn(*[_raw(a) for a in aligned]), axes)


def rename(x: NamedArray, renames: dict[AxisSelector, AxisSelector]) -> NamedArray:
    """Rename axes by a mapping from old to new (Axis or name); sizes stay."""
    by_name = {axis_name(k): axis_name(v) for k, v in renames.items()}
    for old in by_name:
        x.axis_index(old)
    new_axes = [Axis(by_name.get(a.name, a.name), a.size) for a in x.axes]
    check_unique(new_axes)
    return NamedArray(x.array, new_axes)


_LETTERS = string.ascii_letters


def dot(
    *arrays: NamedArray,
    axis: AxisSelection | None,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type=None,
) -> NamedArray:
    """Multiply arrays and sum over `axis` (None: all); other axes are kept, shared ones aligned by name."""
    if not arrays:
        raise ValueError("dot needs at least one array")
    for a in arrays:
        if not isinstance(a, NamedArray):
            raise TypeError(f"dot takes NamedArrays, got {type(a).__name__}")
    all_axes = union_axes(*(a.axes for a in arrays))
    if axis is None:
        contracted = {a.name for a in all_axes}
    else:
        contracted = {axis_name(a) for a in as_axis_tuple(axis)}
        known = {a.name for a in all_axes}
        for sel in as_axis_tuple(axis):
            n = axis_name(sel)
            if n not in known:
                raise ValueError(f"dot: unknown axis {n!r}; the arrays have axes {_describe(all_axes)}")
            if isinstance(sel, Axis):
                union_axes(all_axes, [sel])
    if len(all_axes) > len(_LETTERS):
        raise ValueError("dot supports at most 52 distinct axes")
    letter = {a.name: _LETTERS[i] for i, a in enumerate(all_axes)}
    out_axes = [a for a in all_axes if a.name not in contracted]
    spec = ",".join("".join(letter[a.name] for a in arr.axes) for arr in arrays)
    spec += "->" + "".join(letter[a.name] for a in out_axes)
    result = jnp.einsum(
        spec, *[a.array for a in arrays], precision=precision, preferred_element_type=preferred_element_type
    )
    return NamedArray(result, out_axes)


# -- operators ----------------------------------------------------------------------------------------------


def _binary(fn: Callable, name: str, reflected: bool = False):
    def method(self: NamedArray, other: Any) -> NamedArray:
        if not isinstance(other, (NamedArray, Scalar)) and not hasattr(other, "ndim"):
            return NotImplemented  # not an array: the other operand's reflected method may know it (AttentionMask)
        if isinstance(other, Scalar) or (hasattr(other, "ndim") and not isinstance(other, NamedArray)):
            _as_named_operand(other, name)
        if reflected:
            return elementwise(lambda a, b: fn(b, a), self, other, op_name=name)
        return elementwise(fn, self, other, op_name=name)

    method.__name__ = name
    return method


def _refuse_matmul(self: NamedArray, other: Any) -> NamedArray:
    raise TypeError(
        "NamedArray has no positional matrix product (@); use nt.dot(a, b, axis=...) to contract named axes"
    )


def _install_operators() -> None:
    binary = {
        "add": jnp.add,
        "sub": jnp.subtract,
        "mul": jnp.multiply,
        "truediv": jnp.true_divide,
        "floordiv": jnp.floor_divide,
        "mod": jnp.mod,
        "pow": jnp.power,
        "and": jnp.logical_and,
        "or": jnp.logical_or,
        "xor": jnp.logical_xor,
    }
    for short, fn in binary.items():
        setattr(NamedArray, f"__{short}__", _binary(fn, f"__{short}__"))
        setattr(NamedArray, f"__r{short}__", _binary(fn, f"__r{short}__", reflected=True))
    comparisons = {
        "lt": jnp.less,
        "le": jnp.less_equal,
        "gt": jnp.greater,
        "ge": jnp.greater_equal,
        "eq": jnp.equal,
        "ne": jnp.not_equal,
    }
    for short, fn in comparisons.items():
        setattr(NamedArray, f"__{short}__", _binary(fn, f"__{short}__"))
    unary = {
        "__matmul__": _refuse_matmul,  # there is no positional matmul: use nt.dot with named axes
        "__rmatmul__": _refuse_matmul,
        "__neg__": lambda self: NamedArray(-self.array, self.axes),
        "__pos__": lambda self: self,
        "__abs__": lambda self: NamedArray(jnp.abs(self.array), self.axes),
        "__invert__": lambda self: NamedArray(jnp.invert(self.array), self.axes),
        "__hash__": None,  # defining __eq__ removes hashing; NamedArrays are values, not dict keys
    }
    for name, method in unary.items():
        setattr(NamedArray, name, method)


_install_operators()
