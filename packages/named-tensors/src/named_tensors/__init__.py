"""Named axes over jax arrays: broadcasting, contraction and reduction by axis name."""

from importlib import metadata as _metadata

from . import nn, ops, random, sharding
from .core import (
    Axis,
    AxisSelection,
    AxisSelector,
    AxisSpec,
    NamedArray,
    as_axis_tuple,
    axis_name,
    broadcast_arrays,
    broadcast_to,
    check_unique,
    dot,
    elementwise,
    is_named,
    named,
    permute,
    rename,
    union_axes,
)
from .creation import *
from .hof import *
from .indexing import *
from .ops import (
    abs,
    all,
    any,
    argmax,
    argmin,
    clip,
    cos,
    exp,
    gelu,
    isfinite,
    log,
    log_softmax,
    logical_not,
    logsumexp,
    max,
    maximum,
    mean,
    min,
    minimum,
    prod,
    relu,
    rsqrt,
    sigmoid,
    silu,
    sin,
    softmax,
    sqrt,
    square,
    std,
    stop_gradient,
    sum,
    tanh,
    var,
    where,
)
from .sharding import *
from .stacked import *
from .structure import *
from .tree import *

__version__ = _metadata.version("named-tensors")  # the installed distribution's: no copy to drift
