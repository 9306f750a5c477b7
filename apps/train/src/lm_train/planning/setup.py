"""What `lm-train plan` needs besides the config: the hardware, the vocabulary size and the peak FLOP/s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lm_train.config.batch_sizes import planned_batch
from lm_train.config.schema import TrainLmConfig
from lm_train.data.tokenizer import configured_tokenizer_path, exists, tokenizer_json, trained_tokenizer_path
from lm_train.errors import UserError
from lm_train.kinds import training_kind
from lm_train.planning.devices import DeviceSpec, parse_devices, present_devices
from lm_train.planning.figures import Plan
from lm_train.planning.plan import make_plan, with_planned_loss_blocks
from lm_train.planning.shards import Layout

if TYPE_CHECKING:
    from lm_train.run.training_kind import TrainingKind


def plan_vocabulary(config: TrainLmConfig, override: int | None) -> tuple[int, str]:
    """The vocabulary size a run will have, and where it was read, without training or downloading anything."""
    if override is not None:
        if override < 1:
            raise UserError(f"--vocab-size must be a positive number of tokens, got {override}.")
        return override, "--vocab-size"
    data = config.data
    if data.tokenizer:
        path = tokenizer_json(configured_tokenizer_path(data))
        if not exists(path):
            raise UserError(
                f"data.tokenizer: {data.tokenizer} is not on this machine, so the vocabulary size is unknown. "
                "Pass it: --vocab-size N (32000 for Llama 2's tokenizer, 50257 for GPT-2's)."
            )
        import shard_cache

        size = shard_cache.load_tokenizer(str(path)).get_vocab_size(with_added_tokens=True)
        return size, f"tokenizer {data.tokenizer}"
    trained = trained_tokenizer_path(data)
    if exists(trained):
        import shard_cache

        size = shard_cache.load_tokenizer(str(trained)).get_vocab_size(with_added_tokens=True)
        return size, f"the trained tokenizer {trained}"
    return data.vocab_size, "data.vocab_size (the BPE a first run trains)"


def _peak(spec: DeviceSpec) -> tuple[float, str]:
    if spec.chip is not None:
        return spec.chip.bf16_flops, f"{spec.chip.name} data sheet, dense bf16"
    from lm_train.run.chips import cpu_peak

    machine = cpu_peak()
    return machine / spec.count, f"f32 matmuls measured on this machine, shared by {spec.count} devices"


def _check_present(spec: DeviceSpec, requested: str | None) -> None:
    if requested is None:
        return
    here = present_devices()
    if (here.count, here.chip) != (spec.count, spec.chip):
        raise UserError(
            f"--compile compiles on the devices present ({here.describe()}), not on --devices {requested}. Drop "
            f"--devices, or plan for what is here: --devices {here.text}."
        )


def plan_for(
    config: TrainLmConfig,
    devices: str | None,
    *,
    vocab_size: int | None = None,
    mfu: float | None = None,
    compile_check: bool = False,
    kind: TrainingKind | None = None,
) -> tuple[Plan, dict[str, int] | None]:
    """The plan of a config on the spec'd (or present) devices, for a kind of training (default `lm-train run`'s),
    and XLA's figures when asked to compile."""
    if mfu is not None and not 0.0 < mfu <= 1.0:
        raise UserError(f"--mfu must be in (0, 1], got {mfu}.")
    kind = kind or training_kind()
    kind.check_config(config)  # plan the run that its command would start, or say why it would not
    spec = parse_devices(devices) if devices else present_devices()
    # A batch-size schedule is planned at its largest size, the step that needs the most memory.
    data_size = Layout.for_devices(config.trainer, spec.count).data_size
    kind.check_batch_sizes(config, data_size)
    config = planned_batch(config, data_size)
    if compile_check:
        _check_present(spec, devices)
    vocab, vocab_from = plan_vocabulary(config, vocab_size)
    peak, peak_from = _peak(spec)
    xla = None
    if compile_check:
        from lm_train.planning.xla_check import xla_memory

        # The step as the run would compile it here (the loss in blocks where its logits would not fit).
        xla = xla_memory(with_planned_loss_blocks(config, spec, vocab), vocab, kind=kind)
    plan = make_plan(
        config, spec, vocab_size=vocab, vocab_from=vocab_from, mfu=mfu, peak_flops=peak, peak_flops_from=peak_from,
        kind=kind, compiled_peak=xla["peak_bytes"] if xla else None,
    )  # fmt: skip
    return plan, xla
