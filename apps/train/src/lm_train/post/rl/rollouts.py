"""RL's rollouts: each step, the serving engine samples G completions of each of B prompts from the trainer's current
weights (in process, no copy through disk); they are scored, their advantages computed, their log-probs taken as
the old policy, and they become the step's batch. Every completion is saved under <run_dir>/rollouts/."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

import named_tensors as nt
from lm_models import inference_mode
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import DataError
from lm_train.post.rl.objective import ADVANTAGE, FRESH, OLD_LOGPROB, group_advantages, token_log_probs
from lm_train.post.rl.prompts import Prompt, PromptSet, step_prompts
from lm_train.post.rl.rewards import Reward, score_all
from lm_train.post.rl.sampling_memory import engine_config
from lm_train.run.preflight import RunSetup
from lm_train.serve.engine import Engine
from lm_train.serve.params import SamplingParams
from lm_train.serve.source import EOS_NAMES

FIELDS = ("input_ids", "loss_mask", ADVANTAGE, OLD_LOGPROB)
"""The fields of an RL step's batch (and FRESH with several updates per batch of completions)."""


def batch_fields(updates_per_batch: int) -> tuple[str, ...]:
    """The fields of the step's batch: FIELDS, and FRESH where a batch of completions feeds several updates."""
    return FIELDS if updates_per_batch == 1 else (*FIELDS, FRESH)


def eos_id(tokenizer: Any) -> int | None:
    """The tokenizer's end-of-text token, where it has one of the usual names."""
    for name in EOS_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    return None


def request_seed(seed: int, step: int, prompt: int) -> int:
    """The engine's seed of a step's prompt: the engine folds in the sample's index, then the token's."""
    return int(np.random.default_rng([seed, step, prompt]).integers(2**31))


def _rescorer(plan: Any) -> Any:
    """The sampled tokens' log-probs as the train step computes them: the same function, under the same mapping of
    axes to the mesh, on a batch laid out as the step's."""

    def rescore(model: Any, input_ids: nt.NamedArray, loss_mask: nt.NamedArray) -> Any:
        with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
            return token_log_probs(model, nt.shard(input_ids), nt.shard(loss_mask))

    return eqx.filter_jit(rescore)


class Rollouts:
    """The prompts of each step (for the prefetcher) and the step's batch sampled from the current state."""

    def __init__(
        self, setup: RunSetup, prompts: PromptSet, rewards: list[Reward], tokenizer: Any, held_out: list[Prompt]
    ):
        config: TrainLmConfig = setup.config
        self.setup, self.rl, self.prompts, self.rewards, self.tokenizer = setup, config.rl, prompts, rewards, tokenizer
        self.seq_len, self.seed = config.model.Pos.size, config.trainer.seed
        self.eos = eos_id(tokenizer)
        self.held_out = held_out
        self.engine: Engine | None = None
        self.metrics: dict[int, dict[str, float]] = {}
        self.out_dir = Path(setup.paths.run_dir) / "rollouts" if setup.is_main else None
        self._rescore = _rescorer(setup.plan)
        self._last: tuple[float, float] | None = None  # the last rollout's start and its sampling time
        self.updates = config.rl.updates_per_batch
        self.minibatch = config.trainer.train_batch_size
        self._batch: tuple[int, dict[str, np.ndarray]] | None = None  # the current rollout's first step and rows

    def step_prompts(self, step: int) -> np.ndarray:
        """Indices of the B prompts of the rollout that step `step` trains on."""
        return step_prompts(len(self.prompts), step // self.updates, self.rl.prompts_per_step, self.seed)

    def _engine(self, model: Any) -> Engine:
        if self.engine is None:
            lengths = [int(self.prompts.records.lengths().max()), *(len(p.ids) for p in self.held_out)]
            waiting = max(self.rl.prompts_per_step, len(self.held_out))
            config = engine_config(self.setup.config, max(lengths), waiting)
            self.engine = Engine(model, config, eos_token_id=self.eos, decode=self.tokenizer.decode)
        else:
            # The same model with other weights: no recompile. Between rollouts the engine is idle and holds no page,
            # so no key or value computed with the old weights can be shared with a new prompt.
            assert not self.engine.busy
            self.engine.model = inference_mode(model)
        return self.engine

    def rollout(self, step: int, indices: np.ndarray, state: Any) -> dict[str, np.ndarray]:
        """This process's rows of step `step`: the completions of its prompts sampled from `state`'s model, or, on a
        later update of the same rollout, the next minibatch of the completions sampled then."""
        if self.updates == 1:
            return self._sample(step, indices, state)
        first, update = step - step % self.updates, step % self.updates
        if update == 0:
            self._batch = (first, self._sample(step, indices, state))
            self._keep(first, self._batch[1])
        elif self._batch is None or self._batch[0] != first:  # resumed inside a rollout's updates
            self._batch = (first, self._kept(first, step))
        rows = self._batch[1]
        total = len(rows["input_ids"])
        start = (update % (total // self.minibatch)) * self.minibatch
        chosen = np.arange(start, start + self.minibatch, dtype=np.int64)
        part = chosen[self.setup.part.of(np.arange(self.minibatch, dtype=np.int64))]
        out = {name: value[part] for name, value in rows.items()}
        out[FRESH] = np.full(len(part), 1.0 if update == 0 else 0.0, np.float32)
        return out

    def _kept_path(self, first: int) -> Path:
        return Path(self.setup.paths.run_dir) / "rollouts" / f"step-{first + 1:06d}.npz"

    def _keep(self, first: int, rows: dict[str, np.ndarray]) -> None:
        """The rollout's rows, exactly, for a run resumed from a checkpoint between its updates."""
        path = self._kept_path(first)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        with temporary.open("wb") as f:
            np.savez(f, **rows)
        temporary.replace(path)

    def _kept(self, first: int, step: int) -> dict[str, np.ndarray]:
        path = self._kept_path(first)
        if not path.is_file():
            raise DataError(
                f"resuming at step {step}, inside the updates of the rollout sampled at step {first + 1}, needs its "
                f"completions in {path}, which is missing; restore that file, or resume from a checkpoint taken at a "
                f"multiple of rl.updates_per_batch ({self.updates})."
            )
        with np.load(path) as saved:
            return {name: saved[name] for name in saved.files}

    def _sample(self, step: int, indices: np.ndarray, state: Any) -> dict[str, np.ndarray]:
        """Every row of the rollout that starts at step `step`: sampled, scored, rescored by the trainer."""
        started = time.perf_counter()
        rl, G = self.rl, self.rl.group_size
        model = self.setup.policy.cast_to_compute(state.model)
        engine = self._engine(model)
        chosen = [self.prompts[int(i)] for i in indices]
        requests = []
        for i, prompt in enumerate(chosen):
            params = SamplingParams(
                max_tokens=rl.max_new_tokens,
                temperature=rl.temperature,
                seed=request_seed(self.seed, step // self.updates, i),
                n=G,
                logprobs=0,
            )
            requests.append(engine.submit(list(prompt.ids), params))
        while not all(r.done for r in requests):
            engine.step()
        outputs = [r.wait() for r in requests]
        sampled = time.perf_counter()
        texts, rows, masks, engine_lps, records = [], [], [], [], []
        lengths = []
        for prompt, choices in zip(chosen, outputs, strict=True):
            for choice in choices:
                tokens = list(choice.tokens)
                if choice.finish_reason == "stop" and self.eos is not None:
                    tokens.append(self.eos)  # the model learns to stop: the end token is trained like the others
                ids = np.zeros(self.seq_len, np.int32)
                full = [*prompt.ids, *tokens]
                ids[: len(full)] = full
                mask = np.zeros(self.seq_len, np.bool_)
                mask[len(prompt.ids) - 1 : len(full) - 1] = True  # the positions that predict the completion
                engine_lp = np.full(self.seq_len, np.nan, np.float32)
                start = len(prompt.ids) - 1
                engine_lp[start : start + len(choice.logprobs or [])] = [t.logprob for t in choice.logprobs or []]
                rows.append(ids), masks.append(mask), engine_lps.append(engine_lp)
                texts.append(choice.text), records.append((prompt.record, prompt.where)), lengths.append(len(tokens))
        scores = score_all(self.rewards, records, texts, rl.on_reward_error)
        weights = np.array([r.weight for r in self.rewards])
        total = weights @ scores
        advantages = group_advantages(total, G, scale_by_std=rl.loss != "dr_grpo")
        Batch, Pos = nt.Axis("batch", len(rows)), self.setup.config.model.Pos
        input_ids, loss_mask = np.stack(rows), np.stack(masks)
        # Laid out as the train step lays out its batch, so that each device computes the same rows with the same
        # program shapes as in the step, and the old policy's log-probs are the step's own, bit for bit.
        sharding = self.setup.plan.batch_sharding()
        named = [
            nt.named(jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index]), (Batch, Pos))
            for x in (input_ids, loss_mask)
        ]
        old = np.asarray(jax.device_get(self._rescore(model, *named)))
        gap = np.abs(np.stack(engine_lps) - old)
        metrics = {
            f"rl/reward/{reward.label}/{stat}": float(fn(scores[i]))
            for i, reward in enumerate(self.rewards)
            for stat, fn in (("mean", np.mean), ("std", np.std))
        }
        groups = total.reshape(-1, G)
        metrics |= {
            "rl/reward/mean": float(total.mean()),
            "rl/reward/std": float(total.std()),
            "rl/completion_length/mean": float(np.mean(lengths)),
            "rl/completion_length/max": float(np.max(lengths)),
            "rl/zero_advantage_groups": float(np.mean(np.all(groups == groups[:, :1], axis=1))),
            # The engine's decode log-probs against the trainer's forward (the old policy is the latter).
            "rl/sampler_logprob_gap": float(np.nanmax(gap)) if np.any(~np.isnan(gap)) else 0.0,
            "rl/sampling_seconds": sampled - started,
            "rl/samples_per_second": len(rows) / max(sampled - started, 1e-9),
        }
        if self._last is not None:  # the step before's time spent sampling, over its whole step (known only now)
            last_start, last_sampling = self._last
            metrics["rl/sampling_share"] = last_sampling / max(started - last_start, 1e-9)
        self._last = (started, sampled - started)
        self.metrics[step + 1] = metrics
        if self.out_dir is not None:
            self._save(step, indices, chosen, outputs, texts, scores, advantages)
        part = self.setup.part.of(np.arange(len(rows), dtype=np.int64)) if self.updates == 1 else slice(None)
        return {
            "input_ids": input_ids[part],
            "loss_mask": loss_mask[part],
            ADVANTAGE: advantages[part],
            OLD_LOGPROB: old[part],
        }

    def _save(self, step, indices, chosen, outputs, texts, scores, advantages) -> None:
        assert self.out_dir is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lines, j = [], 0
        for index, prompt, choices in zip(indices, chosen, outputs, strict=True):
            for choice in choices:
                entry = {
                    "step": step + 1,
                    "prompt": int(index),
                    "where": prompt.where,
                    "prompt_tokens": list(prompt.ids),
                    "sample": choice.index,
                    "completion": texts[j],
                    "tokens": list(choice.tokens),
                    "finish_reason": choice.finish_reason,
                    "rewards": {r.label: float(scores[i, j]) for i, r in enumerate(self.rewards)},
                    "advantage": float(advantages[j]),
                }
                lines.append(json.dumps(entry) + "\n")
                j += 1
        path = self.out_dir / f"step-{step + 1:06d}.jsonl"
        temporary = path.with_suffix(".tmp")
        temporary.write_text("".join(lines), encoding="utf-8")
        temporary.replace(path)  # a rerun after a kill rewrites the same file whole

    def evaluate(self, model: Any, done: int) -> dict[str, float]:
        """Each reward's mean over the held-out prompts, answered greedily by `model` (eval/rl/reward/...)."""
        engine = self._engine(self.setup.policy.cast_to_compute(model))
        params = SamplingParams(max_tokens=self.rl.max_new_tokens, temperature=0.0, seed=0)
        outputs = engine.generate([list(p.ids) for p in self.held_out], params)
        records = [(p.record, p.where) for p in self.held_out]
        scores = score_all(self.rewards, records, [o[0].text for o in outputs], self.rl.on_reward_error)
        metrics = {f"eval/rl/reward/{r.label}/mean": float(scores[i].mean()) for i, r in enumerate(self.rewards)}
        metrics["eval/rl/reward/mean"] = float((np.array([r.weight for r in self.rewards]) @ scores).mean())
        return metrics

    def data_metrics(self, done: int) -> dict[str, float]:
        """The rollout metrics of the step that ended at `done` (and drops older ones)."""
        for step in [s for s in self.metrics if s < done]:
            del self.metrics[step]
        return self.metrics.pop(done, {})
