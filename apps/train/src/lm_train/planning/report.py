"""`lm-train plan`'s output: the plan as the text a person reads, or as one JSON object."""

from __future__ import annotations

from typing import Any

from lm_train.planning.figures import Estimate, Plan

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:8.3f}" if abs(n) < 10 * GiB else f"{n / GiB:8.2f}"


def _line(label: str, value: float, note: str = "") -> str:
    return f"    {label:<40}{_gib(value)} GiB  {note}".rstrip()


def _policy_rows(plan: Plan, own: str) -> list[str]:
    base = plan.estimate.executed_flops or 1.0
    rows = []
    for name, e in plan.policies.items():
        mark = "  (this config)" if name == own else ""
        fit = "fits" if e.peak_bytes <= plan.usable_bytes_per_device else "does not fit"
        rows.append(
            f"    {name:<20} peak {_gib(e.peak_bytes)} GiB   saved activations {_gib(e.saved_activation_bytes)} GiB   "
            f"matmul FLOPs x{e.executed_flops / base:.2f}   {fit}{mark}"
        )
    return rows


BATCH_FIELD_WORDS = {
    "input_ids": "token ids",
    "segment_ids": "segment ids",
    "loss_mask": "loss mask",
}


def _batch_contents(fields: list[str]) -> str:
    """What the batch holds, in words: "token ids, segment ids, positions, loss mask"."""
    return ", ".join(BATCH_FIELD_WORDS.get(name, name.replace("_", " ")) for name in fields)


def _scores_note(e: Estimate) -> str:
    kernels = f"; kernel: {', '.join(e.attention_kernels)}" if e.attention_kernels else ""
    if not e.attention_scores_bytes:
        return f"not materialised{kernels}"
    return f"one layer's (its largest block), materialised; {e.attention_scores_saved} saved for the backward{kernels}"


def render_text(plan: Plan, config_name: str, xla: dict[str, int] | None = None) -> str:
    """The plan as the few screens a person reads."""
    e = plan.estimate
    mesh = " x ".join(f"{k} {v}" for k, v in plan.mesh.items())
    per_micro = e.local_batch // e.microbatches
    micro = f" ({e.microbatches} microbatches of {per_micro})" if e.microbatches > 1 else ""
    note = f" ({plan.kind}: {plan.kind_note})" if plan.kind_note else ""
    frozen, frozen_note = plan.frozen_label
    out = [
        f"lm-train plan: {config_name} on {plan.devices} ({plan.device_count} x {plan.chip}, "
        f"{plan.memory_bytes_per_device / GiB:.0f} GiB each){note}",
        f"  mesh {mesh}; {plan.parameter_count / 1e9:.3g}B parameters; vocabulary {plan.vocab_size} "
        f"({plan.vocab_from})",
        f"  per device: batch {e.local_batch}{micro} x {_positions(plan)} positions; {plan.mp}; gradient checkpointing "
        f"{e.policy}",
        "",
        "  memory per device",
        _line("parameters", plan.parameters_bytes),
        _line("optimizer state", plan.optimizer_state_bytes),
        *([_line(frozen, plan.frozen_bytes, frozen_note)] if plan.frozen_bytes else []),
        _line("batch", plan.batch_bytes, f"({_batch_contents(plan.batch_fields)})"),
        _line("gradients", plan.gradients_bytes, "(during the update)"),
        _line("activations saved for the backward", e.saved_activation_bytes, "(per microbatch, end of the forward)"),
        _line("attention scores", e.attention_scores_bytes, _scores_note(e)),
        _line("logits and loss buffers", e.logits_bytes, "(per microbatch, end of the forward)"),
        _line(
            "peak estimate" if plan.sampling is None else "train step's peak estimate",
            e.peak_bytes,
            f"= state and batch {_gib(e.argument_bytes).strip()} + temporaries "
            f"{_gib(e.temporary_bytes).strip()} GiB (at {e.peak_at})",
        ),
        *_sampling_rows(plan),
    ]
    if xla is not None:
        ratio = e.peak_bytes / xla["peak_bytes"] if xla["peak_bytes"] else float("nan")
        out.append(_line("XLA's peak (compiled here)", xla["peak_bytes"], f"estimate / XLA = {ratio:.3f}"))
    out += ["", "  gradient checkpointing policies (peak per device):", *_policy_rows(plan, e.policy), ""]
    out.append(
        f"  speed: {plan.model_flops_per_step:.3g} model FLOPs per step; at MFU {plan.mfu:.2f} of "
        f"{plan.peak_flops_per_device / 1e12:.4g} TFLOP/s per device ({plan.peak_flops_from}): "
        f"step {plan.step_seconds:.3g} s, {plan.tokens_per_second:,.0f} tokens/s"
    )
    usable = f"{plan.usable_bytes_per_device / GiB:.2f} GiB usable ({plan.usable_why})"
    compiled = plan.compiled_peak_bytes
    peak = f"peak {e.peak_bytes / GiB:.2f} GiB" if compiled is None else f"XLA's peak {compiled / GiB:.2f} GiB"
    if plan.sampling is not None:
        judged = plan.usable_bytes_per_device - plan.margin_bytes
        peak = f"peak {judged / GiB:.2f} GiB with sampling" + (f" (the step's, XLA's: {peak})" if compiled else "")
    if plan.fits:
        spare = plan.margin_bytes / GiB
        out.append(f"  verdict: fits: {peak} of {usable}, {spare:.2f} GiB to spare")
    else:
        short = -plan.margin_bytes / GiB
        out.append(f"  verdict: does not fit by {short:.2f} GiB: {peak}, {usable}")
        if plan.suggestions:
            out.append("  changes that fit (each alone):")
            out += [f"    {s}" for s in plan.suggestions]
        else:
            tried = "remat policy, microbatches, model axis, blockwise attention, loss blocks"
            out.append(f"  no single change tried ({tried}) fits")
    out += [f"  note: {n}" for n in plan.notes]
    return "\n".join(out)


def _sampling_rows(plan: Plan) -> list[str]:
    """The rows of what sampling holds beside the train step, and the peak with it."""
    s = plan.sampling
    if s is None:
        return []
    return [
        _line("KV cache (sampling engine)", s.kv_cache_bytes, s.kv_cache_note),
        _line("engine's counts and weights", s.kept_bytes, "(penalty counts; a weight copy where compute differs)"),
        _line("sampling buffers", s.buffers_bytes, s.buffers_note),
        _line(
            "peak estimate",
            plan.peak_bytes_per_device,
            "= the train step beside the engine, or sampling beside the state, the larger",
        ),
    ]


def plan_json(plan: Plan, xla: dict[str, int] | None = None) -> dict[str, Any]:
    """The plan as one JSON object (peak_bytes_per_device, fits, and xla_peak_bytes_per_device with --compile)."""
    out = plan.to_json()
    if xla is not None:
        out["xla"] = xla
        out["xla_peak_bytes_per_device"] = xla["peak_bytes"]
        # XLA's figure is the train step's: compared with the step's own estimate (the engine's are beside it).
        out["estimate_over_xla"] = plan.estimate.peak_bytes / xla["peak_bytes"] if xla["peak_bytes"] else None
    return out


def _positions(plan: Plan) -> str:
    """The positions one device holds: all of them, or its share under context parallelism."""
    context = plan.mesh.get("context", 1)
    return str(plan.seq_len) if context == 1 else f"{plan.seq_len // context} (of {plan.seq_len}, over context)"
