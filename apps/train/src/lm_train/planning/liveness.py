"""Peak memory of a jaxpr without compiling it: which buffers are live at each operation, under XLA-like rules.

The rules model what XLA does with a program, not what the jaxpr spells out: elementwise chains are fused into
their consumers (no buffer of their own), except a forward value that the backward reads too, which is kept;
reshapes, copies and sharding annotations are free; an update in place
reuses its operand's buffer; a loop's body runs with one iteration's temporaries at a time, and its stacked
outputs exist whole. Two marked calls (`rules.GATHER_MARK`) stand for an FSDP all-gather and its transpose, the
reduce-scatter of the gradients: a gathered array that only loops consume is gathered one iteration's slice at
a time, as XLA's partitioner does inside the layer loop, and the gradients a loop stacks only to reduce-scatter
are stacked at their scattered size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lm_train.planning.program import Op, Program, Values
from lm_train.planning.rules import ALIAS, EXPENSIVE, FREE_TO_RECOMPUTE, FUSIBLE, IN_PLACE, REDUCE, SCATTERS


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
        if op.prim == "gather" and len(users) == 1 and users[0][0].prim == "select_n":
            # XLA fuses a gather into the one select that reads it: a paged cache's gathered keys, with this
            # step's new keys put in their places, are one buffer.
            self.virtual.add(vid)
            return
        if op.prim not in FUSIBLE or not users or not all(u.prim in FUSIBLE or u.prim in REDUCE for u, _ in users):
            return
        # Fusing into several consumers duplicates the computation: XLA does not duplicate an expensive one.
        costly = op.prim in EXPENSIVE or any(i in self.costly for i in op.ins)
        # A rematerialised forward value that the backward reads is kept from its recomputation until then.
        if op.recompute and op.prim not in FREE_TO_RECOMPUTE and any(not u.recompute for u, _ in users):
            return
        # A forward value that the forward reads on and the backward reads again is computed once and kept (XLA:CPU
        # keeps SwiGLU's silu(gate) beside silu(gate) * up, for one): a buffer, not fused into both passes.
        read_by = {u.backward for u, _ in users}
        if not (op.backward or op.recompute) and op.prim not in FREE_TO_RECOMPUTE and read_by == {True, False}:
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
    if not until_backward:
        # XLA:CPU fills the buffers that scatters of one shape write into from one broadcast of zeros, copied once
        # per scatter, and schedules those copies at the start of the computation: each is held from there (in an
        # MoE step, every layer's dispatch buffers and their gradients' are held in the first layer's forward). A
        # scatter of a shape of its own writes into its broadcast in place, when it runs.
        live.update({v: a.size(v) for v in _zero_filled_scatters(program, a) if v not in free_outputs})
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
        new = {o: a.size(o) for o in op.outs if a.owns_buffer(o) and o not in free_outputs and o not in live}
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


def _zero_filled_scatters(program: Program, a: _Analysis) -> list[int]:
    """The outputs of the program's scatters into a fresh broadcast (zeros) whose shape and dtype another such
    scatter shares: XLA merges those broadcasts into one and gives each scatter a copy of it."""
    by_kind: dict[tuple, list[int]] = {}
    for op in program.ops:
        source = a.producer.get(op.ins[0]) if op.prim in SCATTERS and op.ins else None
        if source is not None and source.prim == "broadcast_in_dim":
            for o in op.outs:
                if a.owns_buffer(o):
                    by_kind.setdefault((a.values.shape[o], str(a.values.dtype[o])), []).append(o)
    return [o for outs in by_kind.values() if len(outs) > 1 for o in outs]


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
    if op.prim == "while" and op.body is not None:
        # A while loop's body writes its carries into the loop's own buffers (XLA aliases them): an update of a
        # carry in place (a decode loop's KV cache) is no second copy of it.
        carried = set(op.body.outputs)
        for inner in reversed(op.body.ops):  # a carry written as a reshape of an update is that update
            if inner.prim in ALIAS and inner.outs[0] in carried:
                carried.add(inner.ins[0])
        body = peak_bytes(op.body, values, free_outputs=carried)
        return max([body, *(peak_bytes(b, values) for b in op.branches)], key=lambda p: p.bytes)
    candidates = [peak_bytes(b, values) for b in ([op.body] if op.body else []) + op.branches]
    return max(candidates, key=lambda p: p.bytes, default=Peak(0, [], ""))
