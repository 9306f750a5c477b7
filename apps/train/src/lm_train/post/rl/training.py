"""`lm-train rl`: the training kind that the shared loop runs (prompts, rollouts, the GRPO objective, the frozen
reference), and the checks of an RL config."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import shard_cache
from lm_train.config.optimizer_config import SophiaGConfig, SophiaHConfig
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import ConfigError
from lm_train.post.lora_training import check_lora_base
from lm_train.post.reference_model import frozen_reference, hf_weights, load_reference_weights
from lm_train.post.rl.objective import ADVANTAGE, FRESH, OLD_LOGPROB, rl_objective
from lm_train.post.rl.prompts import (
    Prompt,
    PromptSet,
    build_prompt_cache,
    first_skipped,
    prompt_cache_dir,
    prompt_processor,
)
from lm_train.post.rl.rewards import Reward, load_rewards, score
from lm_train.post.rl.rollouts import Rollouts, batch_fields
from lm_train.post.rl.sampling_memory import check_servable, sampling_memory
from lm_train.run.batch import BatchField
from lm_train.run.objectives import Objective
from lm_train.run.preflight import RunSetup
from lm_train.run.state import init_model
from lm_train.run.train_inputs import TrainInputs
from lm_train.run.training_kind import TrainingKind
from lm_train.serve.params import SamplingParams


def check_rl_config(config: TrainLmConfig) -> None:
    """What RL needs of the rest of the config, checked before anything is started; the rewards are imported and
    each is called once on an empty completion, so a reward that does not import or returns no number fails here."""
    rl, data = config.rl, config.data
    if not data.train_urls:
        raise ConfigError(
            "lm-train rl reads its prompts from data.train_urls (jsonl records with a prompt and the fields the "
            "rewards read); data.builtin, data.id and mixtures (data.configs) are not prompt sources."
        )
    if not data.tokenizer:
        raise ConfigError("data.tokenizer is empty: lm-train rl needs the tokenizer of the model it trains.")
    expected, batch = rl.prompts_per_step * rl.group_size, config.trainer.train_batch_size
    if rl.updates_per_batch == 1 and batch != expected:
        raise ConfigError(
            f"trainer.train_batch_size is {batch}, but each step trains on rl.prompts_per_step "
            f"({rl.prompts_per_step}) x rl.group_size ({rl.group_size}) = {expected} completions; set "
            f"trainer.train_batch_size to {expected} (or, for several optimizer steps per batch of completions, set "
            "rl.updates_per_batch to a multiple of the minibatches that train_batch_size splits them into)."
        )
    if expected % batch or rl.updates_per_batch % (expected // batch):
        raise ConfigError(
            f"rl.updates_per_batch ({rl.updates_per_batch}) must go through the {expected} completions of a rollout "
            f"(rl.prompts_per_step x rl.group_size) in whole minibatches of trainer.train_batch_size ({batch}): "
            "train_batch_size must divide them, and updates_per_batch be a multiple of the minibatches; e.g. "
            f"train_batch_size {expected} with any updates_per_batch, or {expected // 2 if expected % 2 == 0 else 1} "
            f"with updates_per_batch {2 if expected % 2 == 0 else expected}."
        )
    if rl.group_size > 64:
        raise ConfigError(f"rl.group_size is {rl.group_size}: the engine samples at most 64 completions of a prompt.")
    if rl.max_new_tokens >= config.model.Pos.size:
        raise ConfigError(
            f"rl.max_new_tokens ({rl.max_new_tokens}) leaves no room for a prompt in model.seq_len "
            f"({config.model.Pos.size}); lower it or raise model.seq_len."
        )
    SamplingParams(max_tokens=rl.max_new_tokens, temperature=rl.temperature, n=rl.group_size).check(2)
    check_servable(config)
    if isinstance(config.optimizer, SophiaGConfig | SophiaHConfig):
        raise ConfigError("optimizer.type: Sophia estimates the next-token loss's curvature; use adam for lm-train rl.")
    check_lora_base(config)  # here, not only in the run's preflight: `lm-train plan --rl` refuses it too
    if config.lora is not None and config.lora.dropout:
        raise ConfigError(
            f"lora.dropout is {config.lora.dropout}: RL's importance ratios compare the sampler's log-probs with the "
            "step's, and dropout in the step would make them differ; set lora.dropout to 0 for lm-train rl."
        )
    if config.lora is not None and rl.reference_model_path is not None:
        raise ConfigError(
            "rl.reference_model_path: with lora, RL's reference is the base model under the adapters (the adapters "
            "left out), so no other reference is loaded; remove rl.reference_model_path, or the lora section."
        )
    for key in ("z_loss_weight", "fcm_prob"):
        if getattr(config, key):
            raise ConfigError(f"{key} applies to the next-token loss, not to RL's objective; remove it.")
    rewards = load_rewards(rl.rewards)
    for reward in rewards:  # a probe with every field it reads, so that only its return value is checked
        probe = {name: "" for name in reward.fields()} | {rl.prompt_field: ""}
        try:
            score(reward, probe, "a probe record", "", "zero")
        except Exception as error:
            raise ConfigError(str(error).replace(" on a probe record", " on a probe (empty completion)")) from None


@dataclass
class RlData:
    """The tokenizer and the prompts: the train prompt cache, read by index, and the held-out prompts (checked whole
    before the state is built; the caches are built first, in the foreground)."""

    tokenizer_path: str
    prompts: PromptSet
    held_out: list[Prompt]
    """data.validation_urls' prompts, answered greedily at each evaluation."""
    rewards: list[Reward]
    train_cache: str
    build_metrics: Any = None
    builds: list[Any] = field(default_factory=list)

    def tokenizer(self) -> Any:
        return shard_cache.load_tokenizer(self.tokenizer_path)

    def vocab_size(self) -> int:
        return self.tokenizer().get_vocab_size(with_added_tokens=True)

    def train_caches_finished(self) -> bool:
        return True

    def stop_builds(self) -> None:
        return None

    def check_builds(self) -> None:
        return None

    def describe(self) -> str:
        return f"tokenizer {self.tokenizer_path}, prompts {self.train_cache}"


def prepare_prompts(setup: RunSetup) -> RlData:
    """The tokenizer and the prompt caches (found finished, or built now), every prompt checked against the context
    and the rewards' fields."""
    config = setup.config
    if setup.dist.process_count > 1:  # every process would sample on arrays that span the others' devices
        raise ConfigError(
            f"lm-train rl runs in one process for now ({setup.dist.process_count} were started); run it on one host."
        )
    path = config.data.tokenizer
    assert path is not None  # check_rl_config requires it
    rewards = load_rewards(config.rl.rewards)
    rl, context, data = config.rl, config.model.Pos.size, config.data
    processor = prompt_processor(data, path, rl.prompt_field)
    skip = rl.on_bad_prompt == "skip"
    root = prompt_cache_dir(data, path, processor, skip)
    found: dict[str, PromptSet] = {}
    for name, urls in (("train", data.train_urls), ("validation", data.validation_urls)):
        if not urls:
            continue
        skipped = build_prompt_cache(urls, f"{root}/{name}", processor, data, setup.is_main, skip)
        found[name] = PromptSet(f"{root}/{name}")
        lacking = found[name].check(rewards, context, rl.max_new_tokens, skip)
        if (skipped or lacking) and setup.is_main:
            print(skipped_note(f"data.{name}_urls", urls, processor, skipped, lacking), file=sys.stderr, flush=True)
    prompts = found["train"]
    held_out = found["validation"].all() if "validation" in found else []  # every evaluation answers them all
    return RlData(path, prompts, held_out, rewards, f"{root}/train")


def skipped_note(key: str, urls: Any, processor: Any, skipped: dict[str, int], lacking: list[str]) -> str:
    """The line that says how many prompt records rl.on_bad_prompt: skip left out, why, and where the first were."""
    count = sum(skipped.values()) + len(lacking)
    reasons = [f"{n} {reason}" for reason, n in sorted(skipped.items())]
    reasons += [f"{len(lacking)} without a field a reward reads"] if lacking else []
    first = (first_skipped(urls, processor) if skipped else []) + lacking
    return (
        f"rl.on_bad_prompt: skip: left out {count} prompt record{'s' * (count != 1)} of {key} "
        f"({', '.join(reasons)}); the first: {', '.join(first[:5])}"
    )


def rl_inputs(setup: RunSetup, data: RlData) -> TrainInputs:
    """The loop's inputs for RL: each step's prompts, turned into its batch by sampling from the current state."""
    rollouts = Rollouts(setup, data.prompts, data.rewards, data.tokenizer(), data.held_out)
    return TrainInputs(
        rollouts.step_prompts,
        batch_fields(setup.config.rl.updates_per_batch),
        rollouts.evaluate,
        bool(data.held_out),
        rollouts.data_metrics,
        rollout=rollouts.rollout,
    )


def reference_model(setup: RunSetup, Vocab: Any) -> Any:
    """RL's frozen reference, in the compute dtype, on the model's shardings: rl.reference_model_path, else the
    run's initial weights; None with LoRA, whose objective uses the policy's base weights (adapters off)."""
    config = setup.config
    if _reference_left_out(config) is not None:
        if setup.is_main:
            print("RL reference model: the base model (LoRA adapters off)", file=sys.stderr, flush=True)
        return None
    path = config.rl.reference_model_path
    if path is not None:
        model, source = load_reference_weights(setup, Vocab, path, "rl.reference_model_path")
    elif config.initialize_from_hf:
        model, source = hf_weights(setup, Vocab, str(config.initialize_from_hf)), str(config.initialize_from_hf)
    else:
        model, source = init_model(config, setup.plan, Vocab), "the initial weights"
    if setup.is_main:
        print(f"RL reference model: {source}", file=sys.stderr, flush=True)
    return frozen_reference(setup, model)


def _reference_left_out(config: TrainLmConfig) -> str | None:
    """Why a run keeps no reference model: with LoRA, the objective uses the policy's base weights (adapters off)."""
    if config.lora is None:
        return None
    return (
        "no reference model is kept: with lora, RL's reference is the base model under the adapters (the adapters "
        "left out), the policy's own weights"
    )


def _objective(config: TrainLmConfig) -> Objective:
    rl = config.rl
    return rl_objective(rl.loss, rl.clip_epsilon, rl.kl_coef, rl.max_new_tokens)


def _fields(config: TrainLmConfig) -> tuple[str, ...]:
    return batch_fields(config.rl.updates_per_batch)


RL = TrainingKind(
    command="rl",
    prepare_data=prepare_prompts,
    inputs=rl_inputs,
    objective=_objective,
    batch_fields=_fields,
    extra_fields={
        ADVANTAGE: BatchField(np.float32, per_token=False),
        OLD_LOGPROB: BatchField(np.float32),
        FRESH: BatchField(np.float32, per_token=False),
    },
    check_config=check_rl_config,
    frozen_model=reference_model,
    frozen_left_out=_reference_left_out,
    flops_scale=4 / 3,  # the policy's forward and backward plus the reference's forward (sampling not counted)
    plan_note="sampled completions, and a frozen reference model",
    sampling_memory=sampling_memory,
    frozen_label=("reference model", "(RL's, frozen, compute dtype)"),
)
