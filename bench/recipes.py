"""The optimizer recipes on the GPT-2 nano model: eval loss after N steps, and step time, each against AdamW's.

AdamW, Muon, SOAP, Kron and MARS each train the nano model (configs/gpt2_nano.yaml's shape, its warm-up and cosine
schedule) for `--steps` steps from the same initial weights (trainer seed 0) on the same batches of the built-in
corpus (this Python's standard library, tokenized by a BPE trained here), first at the learning rate that
docs/optimizers.md recommends, then at that rate times each `--sweep` factor. Each run's eval loss is the mean
next-token loss over the same `--eval-batches` of the validation split. One JSON line per optimizer: its loss at
the docs rate and at the best rate of the sweep, both over AdamW's at its own docs and best rates (below 1: better
than AdamW), and its median step time (the compiling first steps left out) over AdamW's, measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from common import emit, log

import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.data.corpus import split_stdlib
from lm_train.optim import build_optimizer
from lm_train.run.batch import as_host_batch, named_batch
from lm_train.run.evaluation import make_eval_step
from lm_train.run.mesh import check_batch_fits, plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state
from lm_train.run.step import StepSettings, make_train_step

NANO = Path(__file__).resolve().parent.parent / "configs" / "gpt2_nano.yaml"
# The learning rates docs/optimizers.md gives for each (Muon's adam_lr is its AdamW parameters' rate, kept at the
# same ratio to Muon's rate through the sweep).
RECIPES: dict[str, dict[str, float | str]] = {
    "adam": {"learning_rate": 3e-3},
    "muon": {"learning_rate": 0.02, "adam_lr": 0.004},
    "soap": {"learning_rate": 3e-3},
    "kron": {"learning_rate": 3e-3},
    "mars": {"learning_rate": 3e-3},
}


def corpus_windows(max_files: int, vocab: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(train windows, validation windows) of seq_len tokens from the first files of each split, and the vocab size."""
    from shard_cache import train_tokenizer

    split = split_stdlib(0.02)
    read = lambda files: [f.read_text(encoding="utf-8", errors="replace") for f in files]  # noqa: E731
    train_texts, valid_texts = read(split.train[:max_files]), read(split.validation[: max(4, max_files // 20)])
    tokenizer = train_tokenizer(train_texts, vocab)
    eos = tokenizer.token_to_id("<|endoftext|>")

    def windows(texts: list[str]) -> np.ndarray:
        ids = np.concatenate([np.asarray([*e.ids, eos], np.int32) for e in tokenizer.encode_batch(texts)])
        n = len(ids) // seq_len
        return ids[: n * seq_len].reshape(n, seq_len)

    return windows(train_texts), windows(valid_texts), tokenizer.get_vocab_size()


def train_and_evaluate(name: str, lr_scale: float, args, train: np.ndarray, valid: np.ndarray, vocab: int) -> dict:
    """One run: the final eval loss and the step times of `name` at its docs rate times lr_scale."""
    recipe = {k: v * lr_scale if isinstance(v, float) else v for k, v in RECIPES[name].items()}
    overrides = ["--optimizer.type", name, *(x for k, v in recipe.items() for x in (f"--optimizer.{k}", str(v)))]
    overrides += ["--trainer.num_train_steps", str(args.steps), "--trainer.train_batch_size", str(args.batch)]
    overrides += ["--model.hidden_dim", str(args.hidden), "--model.num_layers", str(args.layers)]
    overrides += ["--model.seq_len", str(args.seq_len)]
    if name in ("muon", "mars"):  # these take weight_decay from their own defaults unless told; give AdamW's
        overrides += ["--optimizer.weight_decay", "0.1"]
    config, _ = load_train_config([NANO], overrides)
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, args.steps)
    state = init_state(config, plan, nt.Axis("vocab", vocab), optimizer)
    policy = parse_policy(config.trainer.mp)
    settings = StepSettings(policy, check_batch_fits(config.trainer, plan, 1), 0.0)
    step = eqx.filter_jit(make_train_step(optimizer, settings, schedule), donate="all")
    evaluate = eqx.filter_jit(make_eval_step(policy))
    Pos = config.model.Pos

    def batch(rows: np.ndarray):
        arrays = {
            k: jax.make_array_from_process_local_data(plan.batch_sharding(), v) for k, v in as_host_batch(rows).items()
        }
        return named_batch(arrays, "batch", Pos)

    times = []
    with jax.set_mesh(plan.mesh), nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for i in range(args.steps):
            start = time.perf_counter()
            rows = train[(i * args.batch + np.arange(args.batch)) % len(train)]
            state, metrics = step(state, batch(rows))
            jax.block_until_ready(metrics["train/loss"])
            times.append(time.perf_counter() - start)
        total = count = 0.0
        for b in range(args.eval_batches):
            summed, scored = evaluate(state.model, batch(valid[(b * args.batch + np.arange(args.batch)) % len(valid)]))
            total, count = total + float(summed), count + float(scored)
    loss = total / count
    log(f"{name} x{lr_scale:g} (lr {recipe['learning_rate']:.3g}): eval loss {loss:.4f}, {times[-1]:.3f} s/step")
    return {"loss": loss, "lr": recipe["learning_rate"], "step_s": statistics.median(times[2:] or times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-files", type=int, default=400, help="train files of the corpus to tokenize")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.3, 3.0], help="factors of the docs rate")
    parser.add_argument("--optimizers", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    args = parser.parse_args()
    names = ["adam", *(n for n in args.optimizers if n != "adam")]
    train, valid, vocab = corpus_windows(args.max_files, args.vocab, args.seq_len)
    log(f"{len(train)} train windows, {len(valid)} validation windows of {args.seq_len} tokens, vocab {vocab}")
    runs = {n: {1.0: train_and_evaluate(n, 1.0, args, train, valid, vocab)} for n in names}
    for n in names:
        for factor in args.sweep:
            runs[n][factor] = train_and_evaluate(n, factor, args, train, valid, vocab)
    best = {n: min(runs[n].values(), key=lambda r: r["loss"]) for n in names}
    adam_docs, adam_best = runs["adam"][1.0], best["adam"]
    for n in names:
        docs = runs[n][1.0]
        emit(
            f"recipes.{n}",
            {
                "eval_loss_docs_lr": round(docs["loss"], 4),
                "docs_lr": docs["lr"],
                "eval_loss_best_lr": round(best[n]["loss"], 4),
                "best_lr": best[n]["lr"],
                "sweep": {f"{r['lr']:.3g}": round(r["loss"], 4) for r in runs[n].values()},
                "adam_eval_loss_docs_lr": round(adam_docs["loss"], 4),
                "adam_eval_loss_best_lr": round(adam_best["loss"], 4),
                "ratio_best_lr": round(best[n]["loss"] / adam_best["loss"], 4),
                "step_time_ratio": round(docs["step_s"] / adam_docs["step_s"], 4),
                "step_s": round(docs["step_s"], 5),
                "steps": args.steps,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "hidden": args.hidden,
                "layers": args.layers,
            },
            reference="adam_eval_loss_docs_lr",
            ratio=docs["loss"] / adam_docs["loss"],
            ratio_means="eval loss over AdamW's at each one's docs learning rate: lower is better",
        )


if __name__ == "__main__":
    main()
