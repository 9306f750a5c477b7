"""A jaxpr as a flat program of operations over value ids (calls inlined, loops nested), with every value's size.

The builder reads jax's name stack to tell the forward pass from the backward (`transpose(`) and from a
rematerialised forward (`rematted_computation`); a marked call (`rules.GATHER_MARK`) stays one operation, an
FSDP all-gather (or, transposed, the gradients' reduce-scatter), and so does an exchange between devices
(`rules.EXCHANGE_MARK`: a ring's permute, an all-to-all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from lm_train.planning.rules import CALLS, EXCHANGE_MARK, GATHER_MARK


@dataclass
class Op:
    """One operation of a program: its kind, the value ids it reads and writes, and a loop body if it has one."""

    prim: str
    ins: list[int]
    outs: list[int]
    body: Program | None = None
    branches: list[Program] = field(default_factory=list)
    num_consts: int = 0
    num_carry: int = 0
    length: int = 1
    backward: bool = False
    """Part of the backward pass (a transposed computation), as jax's name stack says."""
    recompute: bool = False
    """Part of a rematerialised forward computation (inside the backward pass)."""
    flops: float = 0.0
    """Multiply-adds x 2 of a matmul (dot_general); 0 for other ops."""
    free_sizes: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    """A batched matmul's (lhs, rhs) non-contracted, non-batch dimension sizes (attention scores have the
    query positions on the left and the key positions on the right); None for other ops."""


@dataclass
class Program:
    """A flat list of operations over integer value ids (calls inlined; loops and branches nested)."""

    ops: list[Op]
    inputs: list[int]
    outputs: list[int]


@dataclass
class Values:
    """What is known of every value id: its size in bytes, its shape and the name of the op that made it."""

    size: dict[int, int] = field(default_factory=dict)
    shape: dict[int, tuple[int, ...]] = field(default_factory=dict)
    dtype: dict[int, Any] = field(default_factory=dict)
    upcast_bf16: bool = False
    """Count computed 16-bit floats at 4 bytes (XLA's CPU backend computes bfloat16 in float32)."""

    def new(self, aval: Any, computed: bool = True) -> int:
        vid = len(self.size)
        shape = tuple(getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        try:
            itemsize = np.dtype(dtype).itemsize
            if computed and self.upcast_bf16 and jnp.issubdtype(dtype, jnp.floating) and itemsize == 2:
                itemsize = 4
        except TypeError:
            itemsize = getattr(dtype, "itemsize", 8) or 8  # PRNG keys and other extended dtypes
        self.size[vid] = math.prod(shape) * itemsize if dtype is not None else 0
        self.shape[vid] = shape
        self.dtype[vid] = dtype
        return vid


def _closed(jaxpr: Any) -> tuple[Any, Sequence[Any]]:
    if isinstance(jaxpr, jex.core.ClosedJaxpr):
        return jaxpr.jaxpr, jaxpr.consts
    return jaxpr, ()


def _call_jaxpr(eqn: Any) -> Any:
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


class _Builder:
    def __init__(self, upcast_bf16: bool) -> None:
        self.values = Values(upcast_bf16=upcast_bf16)

    def program(
        self, jaxpr: Any, inputs: list[int] | None = None, backward: bool = False, recompute: bool = False
    ) -> Program:
        jaxpr, _ = _closed(jaxpr)
        env: dict[Any, int] = {}
        for var in jaxpr.constvars:  # constants live in the executable, not in the heap
            env[var] = self.values.new(None)
        if inputs is None:
            inputs = [self.values.new(v.aval, computed=False) for v in jaxpr.invars]
        env.update(zip(jaxpr.invars, inputs, strict=True))
        ops: list[Op] = []
        self._emit(jaxpr, env, ops, backward, recompute)
        return Program(ops, list(inputs), [self._read(env, v) for v in jaxpr.outvars])

    def _read(self, env: dict[Any, int], atom: Any) -> int:
        if isinstance(atom, jex.core.Literal):
            return self.values.new(None)
        return env[atom]

    def _emit(self, jaxpr: Any, env: dict[Any, int], ops: list[Op], backward: bool, recompute: bool) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            stack = str(eqn.source_info.name_stack)
            in_backward = backward or "transpose(" in stack
            in_recompute = recompute or "rematted_computation" in stack
            ins = [self._read(env, a) for a in eqn.invars if not isinstance(a, jex.core.Literal)]
            marked = any(mark in str(eqn.params.get("name", "")) for mark in (GATHER_MARK, EXCHANGE_MARK))
            if name in CALLS and not marked:
                inner, _ = _closed(_call_jaxpr(eqn))
                inner_env: dict[Any, int] = {v: self.values.new(None) for v in inner.constvars}
                args = [self._read(env, a) for a in eqn.invars]
                inner_env.update(zip(inner.invars, args, strict=True))
                self._emit(inner, inner_env, ops, in_backward, in_recompute)
                for outer, inner_out in zip(eqn.outvars, inner.outvars, strict=True):
                    env[outer] = self._read(inner_env, inner_out)
                continue
            outs = [self.values.new(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outs, strict=True))
            op = Op(name, ins, outs, backward=in_backward, recompute=in_recompute)
            if name == "dot_general":
                (contract, rhs_contract), (batch, rhs_batch) = eqn.params["dimension_numbers"]
                lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
                op.flops = 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
                if batch:
                    op.free_sizes = (
                        tuple(n for d, n in enumerate(lhs) if d not in contract and d not in batch),
                        tuple(n for d, n in enumerate(rhs) if d not in rhs_contract and d not in rhs_batch),
                    )
            if name in CALLS and EXCHANGE_MARK in str(eqn.params.get("name", "")):
                op.prim = "exchange"
            elif name in CALLS:  # a marked gather (or its transpose): which one, by the direction of the sizes
                grows = sum(self.values.size[o] for o in outs) > sum(self.values.size[i] for i in ins)
                op.prim = "all_gather" if grows else "reduce_scatter"
            elif name == "scan":
                args = [self._read(env, a) for a in eqn.invars]
                op.ins = args
                body_jaxpr = eqn.params["jaxpr"]
                n_consts, n_carry = _scan_counts(eqn.params, len(args))
                body_inputs = [
                    arg if i < n_consts + n_carry else self.values.new(v.aval)
                    for i, (arg, v) in enumerate(zip(args, _closed(body_jaxpr)[0].invars, strict=True))
                ]
                op.body = self.program(body_jaxpr, body_inputs, in_backward, in_recompute)
                op.num_consts, op.num_carry, op.length = n_consts, n_carry, eqn.params["length"]
            elif name == "while":
                op.body = self.program(eqn.params["body_jaxpr"], backward=in_backward)
                op.branches = [self.program(eqn.params["cond_jaxpr"], backward=in_backward)]
            elif name == "cond":
                op.branches = [self.program(b, backward=in_backward) for b in eqn.params["branches"]]
            ops.append(op)


def _scan_counts(params: dict[str, Any], n_inputs: int) -> tuple[int, int]:
    """A scan's (constants, carries) counts: jax 0.10 names them; jax 0.11 groups its inputs in a tree, `ft_in`."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, xs = (len(list(group)) for group in params["ft_in"].unpack())
    if consts + carry + xs != n_inputs:
        raise ValueError(f"plan: a scan whose ft_in {params['ft_in']} does not list its {n_inputs} inputs")
    return consts, carry


def build_program(closed_jaxpr: Any, *, upcast_bf16: bool = False) -> tuple[Program, Values]:
    """The program of a closed jaxpr (dead code removed first, as jit's lowering does)."""
    jaxpr = closed_jaxpr
    try:
        from jax._src.interpreters import partial_eval as pe

        pruned, _ = pe.dce_jaxpr(closed_jaxpr.jaxpr, [True] * len(closed_jaxpr.jaxpr.outvars), instantiate=True)
        jaxpr = jex.core.ClosedJaxpr(pruned, closed_jaxpr.consts)
    except (ImportError, AttributeError, TypeError):  # a jax without this internal: analyse as traced
        pass
    builder = _Builder(upcast_bf16)
    return builder.program(jaxpr), builder.values


def matmul_flops(program: Program) -> float:
    """FLOPs of every matmul the program runs, loop bodies counted once per iteration (recomputation included)."""
    total = 0.0
    for op in program.ops:
        total += op.flops
        if op.body is not None:
            total += matmul_flops(op.body) * (op.length if op.prim == "scan" else 1)
        if op.branches and op.prim == "cond":
            total += max(matmul_flops(b) for b in op.branches)
    return total


def attention_score_shapes(program: Program, values: Values, length: int) -> set[tuple[int, ...]]:
    """Shapes of the batched matmul outputs that pair queries with all `length` key positions (q·k): a layer's
    scores, or its last block of queries' where causal attention computes them in blocks."""
    found: set[tuple[int, ...]] = set()
    for op in program.ops:
        if op.free_sizes is not None and op.free_sizes[0] and length in op.free_sizes[1]:
            found.add(values.shape[op.outs[0]])
        for sub in ([op.body] if op.body else []) + op.branches:
            found |= attention_score_shapes(sub, values, length)
    return found
