"""Peak memory of a jaxpr without compiling it: which buffers are live at each operation, under XLA-like rules.

The rules model what XLA does with a program, not what the jaxpr spells out: elementwise chains are fused into
their consumers (no buffer of their own); reshapes, copies and sharding annotations are free; an update in place
reuses its operand's buffer; a loop's body runs with one iteration's temporaries at a time, and its stacked
outputs exist whole. Two marked calls (`gather_marker`) stand for an FSDP all-gather and its transpose, the
reduce-scatter of the gradients: a gathered array that only loops consume is gathered one iteration's slice at
a time, as XLA's partitioner does inside the layer loop, and the gradients a loop stacks only to reduce-scatter
are stacked at their scattered size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.extend as jex
import jax.numpy as jnp
import numpy as np

GATHER_MARK = "lm_train_plan_all_gather"

# Ops that XLA turns into bitcasts or removes: the output shares its operand's buffer.
ALIAS = {
    "reshape", "squeeze", "expand_dims", "copy", "copy_p", "reshard", "sharding_constraint", "name",
    "stop_gradient", "optimization_barrier", "pvary", "mesh_cast", "device_put",
}  # fmt: skip
# Loop-fusible ops: their output need not exist when every consumer fuses it in.
FUSIBLE = {
    "add", "add_any", "sub", "mul", "div", "rem", "neg", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "max", "min", "select_n", "clamp", "convert_element_type", "integer_pow",
    "pow", "sqrt", "rsqrt", "cbrt", "square", "eq", "ne", "lt", "gt", "le", "ge", "and", "or", "not", "xor",
    "abs", "sign", "erf", "erf_inv", "erfc", "is_finite", "floor", "ceil", "round", "nextafter", "atan2",
    "broadcast_in_dim", "iota", "slice", "dynamic_slice", "concatenate", "pad", "transpose", "rev",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "real", "imag",
    "reduce_precision", "random_wrap", "random_unwrap", "random_fold_in", "threefry2x32", "random_bits",
    "stack", "split",
}  # fmt: skip
# Fusible ops too costly to recompute: XLA fuses them into a consumer only when they have just one.
EXPENSIVE = {
    "div", "rem", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "pow",
    "sqrt", "rsqrt", "cbrt", "erf", "erf_inv", "erfc", "atan2", "integer_pow", "threefry2x32", "random_bits",
}  # fmt: skip
# Fusible ops that XLA recomputes in every consumer rather than keep.
FREE_TO_RECOMPUTE = {"broadcast_in_dim", "iota", "convert_element_type", "slice", "transpose", "concatenate", "pad"}
# Reductions read fused inputs; their (smaller) outputs are buffers.
REDUCE = {
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin",
}  # fmt: skip
# Updates in place: the output takes over operand 0's buffer when that operand is not needed afterwards.
IN_PLACE = {"dynamic_update_slice", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul"}
CALLS = {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "remat",
    "remat2",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
}


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
    position axis on both sides); None for other ops."""


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
            if name in CALLS and GATHER_MARK not in str(eqn.params.get("name", "")):
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
            if name in CALLS:  # a marked gather (or its transpose): which one, by the direction of the sizes
                grows = sum(self.values.size[o] for o in outs) > sum(self.values.size[i] for i in ins)
                op.prim = "all_gather" if grows else "reduce_scatter"
            elif name == "scan":
                args = [self._read(env, a) for a in eqn.invars]
                op.ins = args
                body_jaxpr = eqn.params["jaxpr"]
                n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
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


@dataclass
class Peak:
    """The peak of a program: bytes live at its worst moment beyond its inputs, and what was live then."""

    bytes: int
    live: list[int]
    where: str


class _Analysis:
    """Which values own buffers, and until when each is needed, in one program."""

    def __init__(self, program: Program, values: Values, streamed_inputs: set[int], stacked_outputs: int = 0):
        self.program, self.values = program, values
        self.producer: dict[int, Op] = {}
        self.consumers: dict[int, list[Op]] = {}
        for op in program.ops:
            for o in op.outs:
                self.producer[o] = op
            for i in op.ins:
                self.consumers.setdefault(i, []).append(op)
        self.outputs = set(program.outputs)
        # A loop body's per-iteration outputs are written straight into the loop's stacked buffers.
        self.into_stack = set(program.outputs[len(program.outputs) - stacked_outputs :]) if stacked_outputs else set()
        self.streamed_inputs = streamed_inputs
        self.virtual: set[int] = set()
        self.streamed: set[int] = set()  # gathered values that only loops read: gathered per iteration
        self.in_stack: set[int] = set()  # a loop body's outputs that live in the loop's stacked buffers
        self.scattered: dict[int, int] = {}  # loop outputs that only a reduce-scatter reads -> its output
        self.costly: set[int] = set()  # fused values whose expression holds an expensive op
        for op in program.ops:  # in order: a value's class depends on what its inputs became
            for o in op.outs:
                self._classify(op, o)

    def _effective_consumers(self, vid: int) -> list[tuple[Op, int]]:
        """(op, value it reads) for every op that reads vid's buffer, looking through free aliases."""
        found = []
        for op in self.consumers.get(vid, []):
            if op.prim in ALIAS:
                found.extend(self._effective_consumers(op.outs[0]))
            else:
                found.append((op, vid))
        return found

    def _classify(self, op: Op, vid: int) -> None:
        if vid in self.into_stack and op.prim in FUSIBLE | ALIAS:
            self.in_stack.add(vid)  # computed straight into its slot of the stack; later readers read it there
            return
        if vid in self.outputs:
            return
        if op.prim in ALIAS:
            self.virtual.add(vid)
            return
        users = self._effective_consumers(vid)
        gathered = op.prim == "all_gather" or (
            op.prim in FUSIBLE and op.ins and all(i in self.streamed for i in op.ins)
        )
        if (
            gathered
            and users
            and all(u.prim == "scan" and u.ins.index(v) >= u.num_consts + u.num_carry for u, v in users)
        ):
            self.streamed.add(vid)
            return
        if op.prim == "scan" and users and all(u.prim == "reduce_scatter" for u, _ in users):
            self.scattered[vid] = users[0][0].outs[0]
            return
        if op.prim not in FUSIBLE or not users or not all(u.prim in FUSIBLE or u.prim in REDUCE for u, _ in users):
            return
        # Fusing into several consumers duplicates the computation: XLA does not duplicate an expensive one.
        costly = op.prim in EXPENSIVE or any(i in self.costly for i in op.ins)
        # A rematerialised forward value that the backward reads is kept from its recomputation until then.
        if op.recompute and op.prim not in FREE_TO_RECOMPUTE and any(not u.recompute for u, _ in users):
            return
        if len(users) == 1 or not costly:
            self.virtual.add(vid)
            if costly:
                self.costly.add(vid)

    def owns_buffer(self, vid: int) -> bool:
        return vid in self.producer and not (vid in self.virtual or vid in self.streamed or vid in self.in_stack)

    def size(self, vid: int) -> int:
        if vid in self.scattered:
            return self.values.size[self.scattered[vid]]
        op = self.producer.get(vid)
        if op is not None and op.prim == "reduce_scatter" and any(i in self.scattered for i in op.ins):
            return 0  # the loop already holds the scattered gradients
        return self.values.size[vid]

    def last_uses(self) -> dict[int, int]:
        """For every value, the index of the last op that needs its buffer (len(ops) for outputs)."""
        end = len(self.program.ops)
        last: dict[int, int] = {v: end for v in self.outputs if v not in self.virtual}
        for index in range(end - 1, -1, -1):
            op = self.program.ops[index]
            needed = index
            for o in op.outs:
                if o in self.virtual or o in self.streamed:
                    needed = max(needed, last.get(o, index))
            for i in op.ins:
                last[i] = max(last.get(i, -1), needed)
        return last


def peak_bytes(
    program: Program,
    values: Values,
    streamed_inputs: Sequence[int] = (),
    free_outputs: set[int] = frozenset(),
    stacked_outputs: int = 0,
) -> Peak:
    """The most bytes live at once while `program` runs, beyond its inputs (which the caller holds).

    streamed_inputs: inputs that this program must materialise itself (one loop iteration's gathered slice);
    free_outputs: outputs written into buffers the caller already holds (a donated state updated in place).
    """
    return _simulate(program, values, streamed_inputs, free_outputs, stacked_outputs, until_backward=False)


def live_before_backward(program: Program, values: Values, free_outputs: set[int] = frozenset()) -> Peak | None:
    """What is live when the backward pass starts (inside the microbatch loop, if there is one): the forward's
    saved activations, its logits and whatever else the backward reads. None if the program has no backward."""
    found = _simulate(program, values, (), free_outputs, 0, until_backward=True)
    return found if found.where == BACKWARD else None


BACKWARD = "start of the backward pass"


def _has_backward(program: Program) -> bool:
    return any(op.backward or (op.body is not None and _has_backward(op.body)) for op in program.ops)


def _simulate(
    program: Program,
    values: Values,
    streamed_inputs: Sequence[int],
    free_outputs: set[int],
    stacked_outputs: int,
    until_backward: bool,
) -> Peak:
    a = _Analysis(program, values, set(streamed_inputs), stacked_outputs)
    last = a.last_uses()
    frees: dict[int, list[int]] = {}
    for vid, index in last.items():
        frees.setdefault(index, []).append(vid)
    live: dict[int, int] = {vid: values.size[vid] for vid in streamed_inputs}
    total = sum(live.values())
    best = Peak(total, list(live), "start")
    for index, op in enumerate(program.ops):
        if until_backward and op.backward:
            return Peak(total, list(live), BACKWARD)
        if until_backward and op.body is not None and _has_backward(op.body):
            inner = _simulate(op.body, values, _streamed_into(op, a), set(), 0, True)
            if inner.where == BACKWARD:
                return Peak(total + inner.bytes, [*live, *inner.live], BACKWARD)
        if op.prim in IN_PLACE and op.ins and op.ins[0] in live and last.get(op.ins[0], -1) <= index:
            total -= live.pop(op.ins[0])  # the update writes into its operand's buffer
        new = {o: a.size(o) for o in op.outs if a.owns_buffer(o) and o not in free_outputs}
        inner = _inner_peak(op, a, values) if not until_backward else Peak(0, [], "")
        now = total + sum(new.values())
        if now + inner.bytes > best.bytes:
            best = Peak(now + inner.bytes, [*live, *new, *inner.live], f"{op.prim} (op {index})")
        live.update(new)
        total = now
        for vid in frees.get(index, ()):
            if vid in live and vid not in a.outputs:
                total -= live.pop(vid)
    return best


def _streamed_into(op: Op, outer: _Analysis) -> list[int]:
    """The body inputs of a loop that receive a gathered array one iteration's slice at a time."""
    if op.prim != "scan" or op.body is None:
        return []
    first_x = op.num_consts + op.num_carry
    return [b for arg, b in zip(op.ins[first_x:], op.body.inputs[first_x:], strict=True) if arg in outer.streamed]


def _inner_peak(op: Op, outer: _Analysis, values: Values) -> Peak:
    """What an op needs beyond its inputs and outputs while it runs: one iteration of a loop, the worst branch."""
    if op.prim == "scan" and op.body is not None:
        stacked = len(op.body.outputs) - op.num_carry
        return peak_bytes(op.body, values, _streamed_into(op, outer), stacked_outputs=stacked)
    candidates = [peak_bytes(b, values) for b in ([op.body] if op.body else []) + op.branches]
    return max(candidates, key=lambda p: p.bytes, default=Peak(0, [], ""))


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
    """Shapes of the batched matmul outputs that pair `length` positions with `length` positions (q·k)."""
    found: set[tuple[int, ...]] = set()
    for op in program.ops:
        if op.free_sizes is not None and length in op.free_sizes[0] and length in op.free_sizes[1]:
            found.add(values.shape[op.outs[0]])
        for sub in ([op.body] if op.body else []) + op.branches:
            found |= attention_score_shapes(sub, values, length)
    return found
