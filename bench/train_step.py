"""Tokens/s and MFU of the lm-train train step on GPT-2, Llama and Mixtral shapes, each against a plain-JAX model of
the same math measured in the same run.

Prints one JSON line per shape. Run: `uv run python bench/train_step.py` (about 4 minutes on a busy 2-core
machine; `--shapes nano` alone under 2 minutes).

Ours: the state from `lm_train.run.state.init_state`, the step from `lm_train.run.step.make_train_step` jitted with
`eqx.filter_jit(..., donate="all")` and called inside the mesh and axis mapping, exactly as the trainer does.
Reference: the same GPT-2 written here in plain JAX (no named tensors, no equinox): learned positions, pre-LN,
tanh-GELU MLP, tied embeddings, causal softmax attention, mean next-token cross-entropy, layers run by
`lax.scan` like ours (`--reference-layers unrolled` unrolls them), and the same optax AdamW with global-norm
clipping and the same weight-decay mask. Its weights are copied from ours, and the first two steps on the same
batches must give the same losses (checked, reported as `loss_step1_*`, `loss_step2_*`): the first checks the
forward math, the second that the two optimizer updates agree. Then the two steps are timed in alternation
(ABAB..., the first of each pair alternating too) so that noise from neighbours hits both alike.

The `llama_nano` and `mixtral_nano` rows do the same with lm_models' Llama and Mixtral (4 experts, top 2) against
bench/decoder_reference.py. The Mixtral row also times that reference with an ideal dispatch (each expert an equal,
contiguous share of the token copies: the same matmuls, no routing data movement) and reports the dispatch's
share of the step, 1 - ideal / reference step time, and of ours. Its auxiliary losses are weighted 0, so both
steps optimise the cross-entropy alone.

ratio = ours tokens/s / reference tokens/s (from the summed step times; the median of the per-pair ratios is
reported alongside). MFU = tokens/s x model FLOPs per token (lm_models' formula, the trainer's) / peak FLOP/s:
on CPU the peak is measured in this run (best f32 matmul, as bench/peak.py) and the trainer's own denominator
(`lm_train.run.chips`) is reported too; on an accelerator it is the chip's data-sheet bf16 peak. On CPU,
`ours_mfu_same_window` divides each timed step's FLOP rate by a 1024³ matmul's rate probed right after its
round (best over a quarter second), and takes the median over rounds: a shared VM's speed drifts by 10-20% within
a run, which moves `ours_mfu` (one peak, measured before any step) but cancels out of this one.

Each GPT-2 shape in f32 on CPU also prints `train_step.<shape>.torch_peer` (`--no-torch-peer` leaves it out):
Hugging Face's GPT2LMHeadModel trained by torch in eager mode (bench/torch_peer.py), from the same weights with
the same loss and AdamW, its first two losses checked against ours, timed in alternation with our first
layout. ratio = ours tokens/s / torch's (issue 24's aim: >= 1.25). It needs the `parity` group's CPU torch.

Last, the line `train_step.features_off` (bench/features_off.py; `--no-features-off` skips it): the step that
`lm-train run`'s loop builds with each optional feature off lowers to the same program as the bare step timed
above, turning trainer.watch or fcm_prob on changes it, and the loop's hooks for its host-side features cost
about nothing per step when off (timed against a bare loop of the same compiled step).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import emit, log, median
from decoder_reference import check_balanced, flat_params, make_loss
from features_off import features_off
from peak import CPU_PEAK_SIZES, MatmulProbe, matmul_flops
from torch_peer import TorchPeer
from torch_peer import available as torch_available

import lm_models
import named_tensors as nt
from lm_train.config import AdamConfig, TrainerConfig, TrainLmConfig
from lm_train.optim import build_optimizer, weight_decay_mask
from lm_train.run import chips as lm_chips
from lm_train.run.batch import TokenBatch
from lm_train.run.host_memory import restart_with_hugepage_malloc
from lm_train.run.mesh import check_batch_fits, plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, trainable
from lm_train.run.step import StepSettings, make_train_step


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    seq: int
    vocab: int
    batch: int
    family: str = "gpt2"
    kv_heads: int = 0
    mlp: int = 0
    experts: int = 0


CPU_SHAPES = {
    "nano": Shape(hidden=128, layers=4, heads=4, seq=128, vocab=4096, batch=32),
    # GPT-2-small width (768, 12 heads, 4x MLP, GPT-2's vocabulary), 2 layers: the head is most of the FLOPs.
    # Batch 2 keeps a step near 5-15 s on a busy 2-core machine; raise it with --batch on a quiet one.
    "small2": Shape(hidden=768, layers=2, heads=12, seq=512, vocab=50257, batch=2),
    # issue 24's width-256 comparison with torch eager: 4 layers, seq 256, batch 16, a 512-token vocabulary
    "w256": Shape(hidden=256, layers=4, heads=4, seq=256, vocab=512, batch=16),
    "llama_nano": Shape(128, 4, 4, 128, 4096, 32, family="llama", kv_heads=2, mlp=352),
    "mixtral_nano": Shape(128, 4, 4, 128, 4096, 32, family="mixtral", kv_heads=2, mlp=176, experts=4),
}
# With 2 layers, scan's per-layer bookkeeping (stacked residuals and gradients, zero-filled, then updated in
# place) costs ~5-7% of the small2 step on CPU. A user with a shallow model avoids it with unrolled layers
# (model.scan_layers: false, per-layer weights) or with a fully unrolled scan over the same stacked weights
# (model.scan_unroll: true), so small2 is measured all three ways.
LAYOUTS = ("scan", "scan_unrolled", "unrolled")
DEFAULT_LAYOUTS = {
    "nano": ("scan",),
    "small2": LAYOUTS,
    "w256": ("scan",),
    "llama_nano": ("scan",),
    "mixtral_nano": ("scan",),
}
ACCELERATOR_SHAPES = {
    "nano": CPU_SHAPES["nano"],
    "small2": Shape(hidden=768, layers=2, heads=12, seq=1024, vocab=50257, batch=32),
    "w256": CPU_SHAPES["w256"],
    "llama_nano": CPU_SHAPES["llama_nano"],
    "mixtral_nano": CPU_SHAPES["mixtral_nano"],
}


def model_config(shape: Shape, layers: str) -> Any:
    """Our config for a shape: GPT-2, Llama or Mixtral."""
    common = dict(
        seq_len=shape.seq,
        hidden_dim=shape.hidden,
        num_layers=shape.layers,
        num_heads=shape.heads,
        gradient_checkpointing=False,
        scan_layers=layers != "unrolled",
        scan_unroll=layers == "scan_unrolled",
    )
    if shape.family == "gpt2":
        return lm_models.Gpt2Config(**common)
    decoder = dict(common, intermediate_dim=shape.mlp, num_kv_heads=shape.kv_heads)
    if shape.family == "llama":
        return lm_models.LlamaConfig(**decoder)
    return lm_models.MixtralConfig(**decoder, n_routed_experts=shape.experts, num_experts_per_tok=2, lbl_coef=None,
                                   rzl_coef=None, rope=lm_models.RopeConfig())  # fmt: skip


# ---------------------------------------------------------------------------------------------- ours


class Ours:
    """The lm-train step, set up the way lm_train.run.loop.train sets it up."""

    def __init__(
        self, shape: Shape, mp: str, num_steps: int, layers: str, remat: bool = False, **model_overrides: Any
    ) -> None:
        self.config = config = self.config_for(shape, mp, num_steps, layers, remat, **model_overrides)
        self.model_config, self.optimizer_config, trainer = config.model, config.optimizer, config.trainer
        self.plan = plan_mesh(trainer)
        self.Vocab = nt.Axis("vocab", shape.vocab)
        self.Batch = nt.Axis(trainer.batch_axis, shape.batch)
        self.optimizer, self.schedule = build_optimizer(self.optimizer_config, num_steps)
        self.state = init_state(config, self.plan, self.Vocab, self.optimizer)
        self.settings = StepSettings(
            parse_policy(mp), check_batch_fits(trainer, self.plan, 1), config.z_loss_weight, trainer.batch_axis
        )
        with self.plan.mesh, nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            self.step_fn = eqx.filter_jit(make_train_step(self.optimizer, self.settings, self.schedule), donate="all")

    @staticmethod
    def config_for(
        shape: Shape, mp: str, num_steps: int, layers: str, remat: bool = False, **model_overrides: Any
    ) -> TrainLmConfig:
        """The run's config for a shape: the model, the trainer's batch and precision, AdamW with clipping."""
        model = dataclasses.replace(model_config(shape, layers), gradient_checkpointing=remat, **model_overrides)
        trainer = TrainerConfig(train_batch_size=shape.batch, mp=mp, num_train_steps=num_steps)
        optimizer = AdamConfig(learning_rate=1e-3, weight_decay=0.1, warmup=0.0, max_grad_norm=1.0)
        return TrainLmConfig(model=model, trainer=trainer, optimizer=optimizer)

    def batch(self, ids: np.ndarray) -> nt.NamedArray:
        array = jax.make_array_from_process_local_data(self.plan.batch_sharding(), ids)
        return nt.NamedArray(array, (self.Batch, self.model_config.Pos))

    def step(self, ids: nt.NamedArray) -> float:
        """One train step; blocks until the new state exists; returns the loss."""
        with self.plan.mesh, nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            self.state, metrics = self.step_fn(self.state, TokenBatch(ids))
        jax.block_until_ready(self.state)
        return float(metrics["train/loss"])


# ----------------------------------------------------------------------------------------- reference


def reference_params(model: Any, shape: Shape) -> dict[str, Any]:
    """Our model's weights as a plain dict of fresh jax arrays, matrices laid out (in, out) as in GPT-2."""
    L, E, hd = shape.layers, shape.hidden, shape.hidden  # heads x head_size == hidden for GPT-2

    def a(x: nt.NamedArray, *axes: str, shape_: tuple[int, ...] | None = None) -> jax.Array:
        array = nt.permute(x, axes).array
        return jnp.array(array.reshape(shape_) if shape_ else array, copy=True)  # ours is donated: copy

    blocks = model.blocks.stacked if isinstance(model.blocks, nt.Stacked) else model.blocks.stack().stacked
    attn, mlp = blocks.attn, blocks.mlp
    layers = {
        "ln1_g": a(blocks.ln_1.weight, "layers", "embed"),
        "ln1_b": a(blocks.ln_1.bias, "layers", "embed"),
        "ln2_g": a(blocks.ln_2.weight, "layers", "embed"),
        "ln2_b": a(blocks.ln_2.bias, "layers", "embed"),
        "w_up": a(mlp.up.weight, "layers", "embed", "mlp"),
        "b_up": a(mlp.up.bias, "layers", "mlp"),
        "w_down": a(mlp.down.weight, "layers", "mlp", "embed"),
        "b_down": a(mlp.down.bias, "layers", "embed"),
        "wo": a(attn.o_proj.weight, "layers", "heads", "head_size", "embed", shape_=(L, hd, E)),
        "bo": a(attn.o_proj.bias, "layers", "embed"),
    }
    for name in ("q", "k", "v"):
        proj = getattr(attn, f"{name}_proj")
        heads = "heads" if name == "q" else proj.weight.axes[1].name  # kv_heads == heads for GPT-2
        layers[f"w{name}"] = a(proj.weight, "layers", "embed", heads, "head_size", shape_=(L, E, hd))
        layers[f"b{name}"] = a(proj.bias, "layers", heads, "head_size", shape_=(L, hd))
    return {
        "wte": a(model.token_embeddings.weight, "vocab", "embed"),
        "wpe": a(model.position_embeddings.weight, "position", "embed"),
        "blocks": layers,
        "lnf_g": a(model.ln_f.weight, "embed"),
        "lnf_b": a(model.ln_f.bias, "embed"),
    }


def reference_decay_mask(model: Any) -> dict[str, Any]:
    """Which reference parameters get weight decay: the same choice lm_train.optim makes for ours."""
    ours = weight_decay_mask(trainable(model))
    blocks = ours.blocks.stacked if isinstance(ours.blocks, nt.Stacked) else ours.blocks.stack().stacked
    attn, mlp = blocks.attn, blocks.mlp
    layer_mask = {
        "ln1_g": blocks.ln_1.weight,
        "ln1_b": blocks.ln_1.bias,
        "ln2_g": blocks.ln_2.weight,
        "ln2_b": blocks.ln_2.bias,
        "w_up": mlp.up.weight,
        "b_up": mlp.up.bias,
        "w_down": mlp.down.weight,
        "b_down": mlp.down.bias,
        "wo": attn.o_proj.weight,
        "bo": attn.o_proj.bias,
        **{f"w{n}": getattr(attn, f"{n}_proj").weight for n in "qkv"},
        **{f"b{n}": getattr(attn, f"{n}_proj").bias for n in "qkv"},
    }
    return {
        "wte": ours.token_embeddings.weight,
        "wpe": ours.position_embeddings.weight,
        "blocks": {k: bool(v) for k, v in layer_mask.items()},
        "lnf_g": ours.ln_f.weight,
        "lnf_b": ours.ln_f.bias,
    }


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """GPT-2's LayerNorm, computed in float32 and cast back (as ours does for narrow dtypes)."""
    xf = x.astype(jnp.float32)
    centred = xf - xf.mean(-1, keepdims=True)
    y = centred * jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + eps)
    return (y * g.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def make_reference(shape: Shape, compute_dtype: Any, eps: float, layers: str):
    """The plain-JAX GPT-2 next-token loss of (params, ids[batch, seq])."""
    H, D = shape.heads, shape.hidden // shape.heads

    def block(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
        B, T, _ = x.shape
        h = layer_norm(x, w["ln1_g"], w["ln1_b"], eps)
        q = (h @ w["wq"] + w["bq"]).reshape(B, T, H, D)
        k = (h @ w["wk"] + w["bk"]).reshape(B, T, H, D)
        v = (h @ w["wv"] + w["bv"]).reshape(B, T, H, D)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(D))
        causal = jnp.tril(jnp.ones((T, T), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, H * D)
        x = x + attended @ w["wo"] + w["bo"]
        h = layer_norm(x, w["ln2_g"], w["ln2_b"], eps)
        return x + jax.nn.gelu(h @ w["w_up"] + w["b_up"], approximate=True) @ w["w_down"] + w["b_down"]

    def loss(params: dict[str, Any], ids: jax.Array) -> jax.Array:
        p = jax.tree_util.tree_map(lambda t: t.astype(compute_dtype), params)
        T = ids.shape[1]
        x = p["wte"][ids] + p["wpe"][:T]
        if layers != "unrolled":
            unroll = layers == "scan_unrolled"
            x, _ = jax.lax.scan(lambda carry, w: (block(carry, w), None), x, p["blocks"], unroll=unroll)
        else:
            for w in p["blocks"]:
                x = block(x, w)
        h = layer_norm(x, p["lnf_g"], p["lnf_b"], eps)
        logits = (h @ p["wte"].T).astype(jnp.float32)
        targets = jnp.roll(ids, -1, axis=1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        per_token = jax.nn.logsumexp(logits, axis=-1) - picked
        return per_token[:, :-1].mean()  # the last position has no next token

    return loss


class Reference:
    """Plain-JAX GPT-2 (or Llama, Mixtral) + optax AdamW, starting from a copy of our initial weights."""

    def __init__(self, ours: Ours, shape: Shape, mp: str, layers: str, ideal_dispatch: bool = False) -> None:
        c = ours.optimizer_config
        model = ours.state.model
        compute_dtype = parse_policy(mp).compute_dtype
        if shape.family == "gpt2":
            self.params = reference_params(model, shape)
            decay_mask = reference_decay_mask(model)
            loss_fn = make_reference(shape, compute_dtype, ours.model_config.layer_norm_epsilon, layers)
        else:
            if layers != "scan":
                raise SystemExit(f"{shape.family} rows are measured with scanned layers only")
            self.params = flat_params(trainable(model))
            decay_mask = flat_params(weight_decay_mask(trainable(model)))
            loss_fn = make_loss(shape.family, ours.model_config, compute_dtype, ideal_dispatch=ideal_dispatch)
        if layers == "unrolled":  # per-layer weights, as ours holds them (nt.BlockSeq): no stacked gradient
            stacked = self.params["blocks"]
            self.params["blocks"] = [{k: v[i] for k, v in stacked.items()} for i in range(shape.layers)]
            decay_mask["blocks"] = [decay_mask["blocks"]] * shape.layers
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(c.max_grad_norm),
            optax.adamw(
                ours.schedule,
                b1=c.beta1,
                b2=c.beta2,
                eps=c.epsilon,
                weight_decay=c.weight_decay,
                mask=decay_mask,
            ),
        )
        self.opt_state = self.optimizer.init(self.params)

        def step(params, opt_state, ids):
            loss, grads = jax.value_and_grad(loss_fn)(params, ids)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
            return optax.apply_updates(params, updates), opt_state, metrics

        self.step_fn = jax.jit(step, donate_argnums=(0, 1))

    def batch(self, ids: np.ndarray) -> jax.Array:
        return jnp.asarray(ids)

    def step(self, ids: jax.Array) -> float:
        self.params, self.opt_state, metrics = self.step_fn(self.params, self.opt_state, ids)
        jax.block_until_ready(self.params)
        return float(metrics["loss"])


# ------------------------------------------------------------------------------------------- driver


PROBE_SIZE = 1024  # the fastest f32 size on these CPUs (see peak_flops); ~4 ms a product at ~500 GFLOP/s
# Seconds of probing per round: right after small2 steps a best-of-3 probe read 353-465 GFLOP/s where the best
# of a second read 454-483, so a few dozen timings are needed to find the rate the machine had.
PROBE_BUDGET_S = 0.25


def peak_flops(budget_s: float) -> tuple[float, str, float]:
    """(peak FLOP/s for MFU, what it is, the trainer's own denominator for the whole mesh)."""
    device = jax.devices()[0]
    trainer_peak = lm_chips.peak_flops_per_device(device) * jax.device_count()
    if device.platform == "cpu":
        # The sizes bench/peak.py measures: on a quiet machine the 1024³ matmul is the fastest (~520 GFLOP/s
        # here against ~490 at 512³), so a peak taken from the small sizes alone would flatter the MFU.
        best = max(matmul_flops(n, jnp.float32, 5, 1, budget_s) for n in CPU_PEAK_SIZES)
        return best, "measured f32 matmul peak (best of 256³ to 2048³ timings, as bench/peak.py)", trainer_peak
    return trainer_peak, f"data-sheet bf16 peak of {jax.device_count()} x {device.device_kind}", trainer_peak


def same_window_mfu(step_s: list[float], probe_rates: list[float], flops_per_step: float) -> dict:
    """MFU against the matmul rate probed in the same round as each step (median over rounds), on CPU.

    A shared VM's speed drifts by 10-20% over minutes (other tenants, boost clocks), so a peak measured once
    before the steps flatters or understates them; a probe next to every step cancels that drift.
    """
    if not probe_rates:
        return {"ours_mfu_same_window": None, "peak_same_window_gflops": None, "peak_same_window_range_gflops": None}
    mfus = [flops_per_step / s / rate for s, rate in zip(step_s, probe_rates, strict=True)]
    return {
        "ours_mfu_same_window": round(median(mfus), 4),
        "peak_same_window_gflops": round(median(probe_rates) / 1e9, 1),
        "peak_same_window_range_gflops": [round(min(probe_rates) / 1e9, 1), round(max(probe_rates) / 1e9, 1)],
    }


def run_shape(name: str, shape: Shape, args: argparse.Namespace, peak: float, trainer_peak: float) -> dict:
    log(f"train_step[{name}]: {shape}, ours {args.layers}, reference {args.reference_layers}")
    num_steps = 2 + args.rounds + 10
    ours = Ours(shape, args.mp, num_steps, args.layers)
    ref = Reference(ours, shape, args.mp, args.reference_layers)
    peer = torch_peer(ours, shape, args)
    ideal = None
    if shape.family == "mixtral":
        check_balanced(ours.model_config, shape.batch * shape.seq)
        ideal = Reference(ours, shape, args.mp, args.reference_layers, ideal_dispatch=True)
    rng = np.random.default_rng(0)

    def ids() -> np.ndarray:
        return rng.integers(0, shape.vocab, (shape.batch, shape.seq), dtype=np.int32)

    # Steps 1 and 2 (these include compilation): same batches, same weights -> the same losses.
    compile_s = {}
    losses: dict[str, list[float]] = {"ours": [], "reference": []}
    checked = [("ours", ours), ("reference", ref)] + ([("torch_peer", peer)] if peer is not None else [])
    for _ in range(2):
        batch = ids()
        for label, impl in checked:
            start = time.perf_counter()
            losses.setdefault(label, []).append(impl.step(impl.batch(batch)))
            compile_s.setdefault(label, time.perf_counter() - start)
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["ours"], losses["reference"], strict=True)]
    same = all(r < args.loss_rtol for r in rel)
    log(f"train_step[{name}]: losses ours {losses['ours']} reference {losses['reference']} (rel diff {rel})")
    if not same:
        log(f"train_step[{name}]: WARNING the two implementations disagree: the timings compare different math")

    impls = list(checked)
    if ideal is not None:
        start = time.perf_counter()
        for _ in range(2):  # compiles (twice: the donated outputs are laid out anew); its loss is not compared
            ideal.step(ideal.batch(ids()))
        compile_s["reference_ideal_dispatch"] = time.perf_counter() - start
        impls.append(("reference_ideal_dispatch", ideal))
    times: dict[str, list[float]] = {label: [] for label, _ in impls}
    cpu: dict[str, float] = {label: 0.0 for label, _ in impls}
    probe_rates: list[float] = []
    for r in range(args.rounds):
        batch = ids()
        for label, impl in impls if r % 2 == 0 else impls[::-1]:
            device_ids = impl.batch(batch)
            start, cpu_start = time.perf_counter(), time.process_time()
            impl.step(device_ids)
            times[label].append(time.perf_counter() - start)
            cpu[label] += time.process_time() - cpu_start
        if args.probe is not None:
            probe_rates.append(args.probe.rate(3, PROBE_BUDGET_S))
    # The share of the machine's cores this process got while stepping: on a shared machine, MFU / share
    # estimates what the step would reach with the cores to itself (only meaningful on CPU, and only as good
    # as the peak measured above).
    share = {k: cpu[k] / (sum(times[k]) * (os.cpu_count() or 1)) for k in times}
    tokens = shape.batch * shape.seq
    tps = {k: tokens * len(v) / sum(v) for k, v in times.items()}
    pair_ratios = [r / o for o, r in zip(times["ours"], times["reference"], strict=True)]
    flops_per_token = ours.model_config.flops_per_token(shape.vocab)
    log(f"train_step[{name}]: step seconds {times}")
    same_window = same_window_mfu(times["ours"], probe_rates, tokens * flops_per_token)
    extra = {}
    if ideal is not None:
        mean = {k: sum(v) / len(v) for k, v in times.items()}
        dispatch_s = mean["reference"] - mean["reference_ideal_dispatch"]
        extra = {
            "reference_ideal_dispatch_step_s_mean": round(mean["reference_ideal_dispatch"], 4),
            "dispatch_share_of_reference_step": round(dispatch_s / mean["reference"], 4),
            # Ours dispatches with the same algorithm, so its dispatch costs about what the reference's does.
            "dispatch_share_of_ours_step_estimate": round(dispatch_s / mean["ours"], 4),
        }
    line = emit(
        f"train_step.{name}",
        {
            "shape": dataclasses.asdict(shape),
            "mp": args.mp,
            "layers": args.layers,
            "reference_layers": args.reference_layers,
            "tokens_per_step": tokens,
            "timed_steps": args.rounds,
            "ours_tokens_per_s": round(tps["ours"], 1),
            "ours_step_s_mean": round(sum(times["ours"]) / len(times["ours"]), 4),
            "reference_step_s_mean": round(sum(times["reference"]) / len(times["reference"]), 4),
            "ours_step_s_min": round(min(times["ours"]), 4),
            "reference_step_s_min": round(min(times["reference"]), 4),
            "ratio_median_of_pairs": round(median(pair_ratios), 4),
            "ratio_of_min_steps": round(min(times["reference"]) / min(times["ours"]), 4),
            "flops_per_token": flops_per_token,
            "ours_mfu": round(tps["ours"] * flops_per_token / peak, 4),
            "reference_mfu": round(tps["reference"] * flops_per_token / peak, 4),
            "ours_cpu_share": round(share["ours"], 3),
            "reference_cpu_share": round(share["reference"], 3),
            "ours_mfu_per_cpu_share": round(tps["ours"] * flops_per_token / peak / max(share["ours"], 1e-9), 4),
            "peak_gflops": round(peak / 1e9, 1),
            "peak_means": args.peak_means,
            **same_window,
            "ours_mfu_vs_trainer_denominator": round(tps["ours"] * flops_per_token / trainer_peak, 4),
            "trainer_denominator_gflops": round(trainer_peak / 1e9, 1),
            "compile_and_first_step_s": {k: round(v, 2) for k, v in compile_s.items()},
            "loss_step1_ours": losses["ours"][0],
            "loss_step1_reference": losses["reference"][0],
            "loss_step2_ours": losses["ours"][1],
            "loss_step2_reference": losses["reference"][1],
            "same_loss": same,
            **extra,
        },
        reference={"reference_tokens_per_s": round(tps["reference"], 1)},
        ratio=tps["ours"] / tps["reference"],
        ratio_means="ours tokens/s / plain-JAX reference tokens/s (same shapes, math and weights); aim >= "
        + ("0.98" if shape.family == "gpt2" else "0.95"),
    )
    if peer is not None:
        emit_torch_peer(name, shape, times, losses, tps, args.loss_rtol)
    return line


def torch_peer(ours: Ours, shape: Shape, args: argparse.Namespace) -> TorchPeer | None:
    """HF GPT-2 on torch eager from our initial weights, where it is asked for and can run the same math."""
    f32 = jnp.dtype(parse_policy(args.mp).compute_dtype) == jnp.float32
    if not (args.torch_peer and args.first_layout and shape.family == "gpt2" and f32):
        return None
    if jax.default_backend() != "cpu" or not torch_available():
        log("train_step: no torch_peer line (it needs the CPU backend, torch and transformers: the parity group)")
        return None
    model = ours.state.model
    eps = ours.model_config.layer_norm_epsilon
    lr = float(ours.schedule(0))  # the first step's; the two losses compared depend on no other
    return TorchPeer(reference_params(model, shape), reference_decay_mask(model), shape, eps, ours.optimizer_config, lr)


def emit_torch_peer(name: str, shape: Shape, times: dict, losses: dict, tps: dict, loss_rtol: float) -> dict:
    import torch
    import transformers

    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["ours"], losses["torch_peer"], strict=True)]
    pairs = [t / o for o, t in zip(times["ours"], times["torch_peer"], strict=True)]
    return emit(
        f"train_step.{name}.torch_peer",
        {
            "shape": dataclasses.asdict(shape),
            "timed_steps": len(times["ours"]),
            "ours_tokens_per_s": round(tps["ours"], 1),
            "ours_step_s_mean": round(sum(times["ours"]) / len(times["ours"]), 4),
            "torch_step_s_mean": round(sum(times["torch_peer"]) / len(times["torch_peer"]), 4),
            "ratio_median_of_pairs": round(median(pairs), 4),
            "ratio_of_min_steps": round(min(times["torch_peer"]) / min(times["ours"]), 4),
            "loss_step1_torch": losses["torch_peer"][0],
            "loss_step2_torch": losses["torch_peer"][1],
            # torch sums in another order than XLA: f32 losses agree to ~1e-6, not to the bit
            "same_loss": all(r < max(loss_rtol, 1e-4) for r in rel),
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        reference={"torch_tokens_per_s": round(tps["torch_peer"], 1)},
        ratio=tps["ours"] / tps["torch_peer"],
        ratio_means="ours tokens/s / HF GPT2LMHeadModel on torch eager (same shapes, weights, loss, AdamW), "
        "timed in alternation; aim >= 1.25",
    )


def main() -> None:
    # The trainer enters `with plan.mesh:` (deprecated in jax 0.10); so do we, to time exactly what it runs.
    warnings.filterwarnings("ignore", message=".*mesh.*context manager.*deprecated", category=DeprecationWarning)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_cpu = jax.default_backend() == "cpu"
    shapes = CPU_SHAPES if on_cpu else ACCELERATOR_SHAPES
    parser.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    parser.add_argument("--rounds", type=int, default=None, help="timed steps of each (default: 8, 3 for small2)")
    parser.add_argument("--mp", default="f32" if on_cpu else "p=f32,c=bfloat16", help="trainer.mp of both")
    parser.add_argument(
        "--layers",
        nargs="+",
        choices=LAYOUTS,
        default=None,
        help="ours: model.scan_layers false (unrolled) or true, with model.scan_unroll true (scan_unrolled); one "
        "JSON line per layout (default: scan for nano, all three for small2)",
    )
    parser.add_argument("--reference-layers", choices=LAYOUTS, default=None, help="default: the same as ours")
    parser.add_argument("--loss-rtol", type=float, default=None, help="default 1e-5 (f32) or 2e-2 (bf16)")
    parser.add_argument("--peak-budget", type=float, default=3.0, help="seconds per size measuring the CPU peak")
    parser.add_argument("--batch", type=int, default=None, help="override the batch size of every shape")
    parser.add_argument("--seq", type=int, default=None, help="override the sequence length of every shape")
    parser.add_argument("--vocab", type=int, default=None, help="override the vocabulary size of every shape")
    parser.add_argument(
        "--torch-peer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also print train_step.<shape>.torch_peer for GPT-2 shapes in f32 on CPU: Hugging Face's GPT-2 "
        "trained by torch eager from the same weights, timed in alternation with ours (first layout only)",
    )
    parser.add_argument(
        "--features-off",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also print train_step.features_off: the run's step with its optional features off against the bare "
        "step (program text, and the loop's hooks timed), on the nano shape (bench/features_off.py)",
    )
    args = parser.parse_args()
    if args.loss_rtol is None:
        args.loss_rtol = 1e-5 if jnp.dtype(parse_policy(args.mp).compute_dtype) == jnp.float32 else 2e-2
    peak, peak_means, trainer_peak = peak_flops(args.peak_budget)
    log(f"train_step: peak {peak / 1e9:.1f} GFLOP/s ({peak_means})")
    args.peak_means = peak_means
    # On CPU, the matmul rate is probed again after every round of steps (see same_window_mfu).
    args.probe = MatmulProbe(PROBE_SIZE, jnp.float32) if on_cpu else None
    for name in args.shapes:
        shape = shapes[name]
        shape = dataclasses.replace(
            shape, batch=args.batch or shape.batch, seq=args.seq or shape.seq, vocab=args.vocab or shape.vocab
        )
        rounds = args.rounds or (3 if name == "small2" else 8)
        for i, layers in enumerate(args.layers or DEFAULT_LAYOUTS[name]):
            settings = {**vars(args), "rounds": rounds, "layers": layers, "first_layout": i == 0}
            settings["reference_layers"] = args.reference_layers or layers
            label = name if layers == "scan" else f"{name}_{layers}"
            run_shape(label, shape, argparse.Namespace(**settings), peak, trainer_peak)
    if args.features_off:
        nano = dataclasses.replace(CPU_SHAPES["nano"], batch=args.batch or 32, seq=args.seq or 128)
        features_off(Ours(nano, args.mp, 100, "scan"), rounds=args.rounds or 3, steps_per_round=10)


if __name__ == "__main__":
    restart_with_hugepage_malloc()  # as `lm-train` starts: the step's buffers on huge pages
    main()
