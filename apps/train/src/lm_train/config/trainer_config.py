"""The `trainer` section: steps, batch, precision, mesh, pipeline, evaluation, checkpoints, trackers, watching, EMA."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lm_train.config.batch_sizes import ScheduleStep, batch_schedule, check_train_batch_size
from lm_train.config.quantization_config import QuantizationConfig
from lm_train.config.watching_config import EvalHarnessConfig, ProfilerConfig
from lm_train.errors import ConfigError

if TYPE_CHECKING:
    import shard_cache

WATCH_TARGETS = ("grads", "params", "opt_state", "updates")


@dataclass(frozen=True)
class KeepPolicy:
    """Keep a permanent checkpoint every `every` steps (until step `until`, if given)."""

    every: int
    """Keep the checkpoint of every step that is a multiple of this."""
    until: int | None = None
    """Stop keeping them after this step (null: never stop)."""


@dataclass(frozen=True)
class CheckpointerConfig:
    """When checkpoints are written and which are kept."""

    base_path: str | None = None
    """Where checkpoints go; default: <run_dir>/checkpoints."""
    save_interval: timedelta = timedelta(minutes=15)
    """Write a temporary checkpoint this often (e.g. 10m); it is deleted once a newer one is complete."""
    keep: tuple[KeepPolicy, ...] = (KeepPolicy(every=10000),)
    """Permanent checkpoints: a list of {every: N, until: M}."""


class TrackerList(tuple):
    """The value of `trainer.tracker`: tracker configs, decoded and checked by the trackers package."""


@dataclass(frozen=True)
class WatchConfig:
    """Norms and histograms of gradients, parameters, optimizer state or updates, logged from inside the step."""

    watch_targets: tuple[str, ...] = ()
    """What to watch: any of grads, params, opt_state, updates (Levanter's keys); empty: watching is off."""
    include_norms: bool = True
    """Log the global L2 norm of each target (`<target>/norm/total`)."""
    include_per_parameter_norms: bool = True
    """Also log the norm of each parameter (`<target>/norm/<path>`)."""
    include_histograms: bool = False
    """Also log a histogram of each parameter's values (`<target>/hist/<path>`)."""
    split_scan_layers: bool = True
    """Report each layer of a scanned layer stack separately (`.../layer_<i>`) rather than the stack as one."""
    interval: int = 10
    """Log every this many steps; the other steps compute nothing for it."""

    @property
    def enabled(self) -> bool:
        return bool(self.watch_targets) and (self.include_norms or self.include_histograms)

    def __post_init__(self) -> None:
        unknown = [t for t in self.watch_targets if t not in WATCH_TARGETS]
        if unknown:
            raise ConfigError(
                f"trainer.watch.watch_targets: unknown target(s) {unknown}; use some of {', '.join(WATCH_TARGETS)}."
            )
        if self.interval < 1:
            raise ConfigError(f"trainer.watch.interval must be at least 1, got {self.interval}.")


@dataclass(frozen=True)
class WatchdogConfig:
    """A step that runs far too long (a hang, a stuck host) dumps every thread's stack and ends the run."""

    timeout_s: float | None = None
    """Seconds a step may take before every process dumps its threads' stacks into <run_dir>/hangs/ and the run
    exits with status 75 (a launcher restarts it); null: 20x the median of the first 20 steps, at least 300 s
    (nothing is timed before); 0: off."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None and self.timeout_s < 0:
            raise ConfigError(
                f"trainer.watchdog.timeout_s must be a number of seconds, null (automatic) or 0 (off), got "
                f"{self.timeout_s}."
            )


RAY_NODE_PER = ("host", "process")


@dataclass(frozen=True)
class RayClusterConfig:
    """The Ray cluster that cache builds run on; Levanter's `trainer.ray` keys, plus the head's port and CPUs."""

    address: str | None = None
    """A running Ray cluster to build on (host:port); null: $RAY_ADDRESS if set, else see auto_start_cluster."""
    auto_start_cluster: bool = True
    """In a run of processes on several hosts, make one Ray cluster of the hosts (a head on process 0's host),
    so that cache builds use every host's CPUs; false: builds run on process 0's host alone."""
    start_workers: bool = True
    """Start a Ray node on every host, not only the head on process 0's (false: the head alone, no cluster)."""
    node_per: str = "host"
    """One Ray node per `host` (processes on one host share it), or per `process` (several nodes on one host)."""
    port: int = 6379
    """The port of the head's Ray GCS on process 0's host."""
    num_cpus: int | None = None
    """CPUs each node offers to builds; null: all that its host lets the process use."""

    def __post_init__(self) -> None:
        if self.node_per not in RAY_NODE_PER:
            raise ConfigError(f"trainer.ray.node_per must be one of {', '.join(RAY_NODE_PER)}, got {self.node_per!r}.")
        if not 0 < self.port < 65536:
            raise ConfigError(f"trainer.ray.port must be a TCP port (1-65535), got {self.port}.")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"trainer.ray.num_cpus must be at least 1 (null: every usable CPU), got {self.num_cpus}.")


AVERAGING_TYPES = ("ema",)


@dataclass(frozen=True)
class ModelAveragingConfig:
    """An exponential moving average of the trainable weights, updated inside every step and checkpointed."""

    type: str = "ema"
    """The kind of average: `ema` (Levanter's `ema_decay_sqrt` is not built here)."""
    beta: float = 0.999
    """Decay of the average per step: average = beta * average + (1 - beta) * weights (Levanter's key)."""
    eval_ema: bool = True
    """Evaluate the averaged weights too, logged as `eval/ema/loss` beside the current weights' `eval/loss`."""
    export_ema: bool = True
    """Hugging Face exports made during training (hf_save_path) hold the averaged weights; false: the current.
    Also what eval, sample, export-hf and serve of a checkpoint use when --weights is left out."""

    def __post_init__(self) -> None:
        if self.type not in AVERAGING_TYPES:
            raise ConfigError(
                f"trainer.model_averaging.type: unknown type {self.type!r}; lm-train has {', '.join(AVERAGING_TYPES)} "
                "(an exponential moving average of the weights, with trainer.model_averaging.beta)."
            )
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(
                f"trainer.model_averaging.beta must be in [0, 1), got {self.beta}: e.g. 0.999 averages over about "
                "the last 1000 steps."
            )

    def decay(self) -> float:
        """The weight of the old average in each step's update (the new weights get 1 - decay)."""
        return self.beta


PIPELINE_SCHEDULES = ("gpipe",)
"""The schedules lm-train has built; `1f1b` and `interleaved` (virtual_stages > 1) are named in issue 42, not built."""


@dataclass(frozen=True)
class PipelineConfig:
    """Microbatches and schedule of pipeline parallelism; read only when trainer.pipeline_axis_size > 1."""

    microbatches: int | None = None
    """Microbatches that flow through the stages per step (per gradient-accumulation microbatch); null: 2 x stages."""
    schedule: str = "gpipe"
    """Order of the stages' work: `gpipe` (every forward, then every backward, through autodiff)."""
    virtual_stages: int = 1
    """Layer chunks per device for an interleaved schedule; 1: one contiguous chunk of layers per stage."""

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"trainer.pipeline.schedule: {self.schedule!r} is not built; lm-train has "
                f"{', '.join(PIPELINE_SCHEDULES)}. Set trainer.pipeline.schedule to one of them."
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(
                f"trainer.pipeline.microbatches must be at least 1 (null: twice the stages), got {self.microbatches}."
            )
        if self.virtual_stages != 1:
            raise ConfigError(
                f"trainer.pipeline.virtual_stages={self.virtual_stages} needs the interleaved schedule, which is not "
                f"built; lm-train has {', '.join(PIPELINE_SCHEDULES)}. Set trainer.pipeline.virtual_stages to 1."
            )

    def microbatches_for(self, stages: int) -> int:
        """The microbatches per step under `stages` stages: the key, or twice the stages."""
        return self.microbatches if self.microbatches is not None else 2 * stages


@dataclass(frozen=True)
class TrainerConfig:
    """The loop: steps, batch, precision, mesh, evaluation, checkpoints, trackers."""

    seed: int = 0
    """Seed of every random draw (initialisation, dropout, data order): the same seed gives the same bits."""
    num_train_steps: int = 1000
    """Optimizer steps to train for (a resumed run continues up to this step)."""
    train_batch_size: int | tuple[ScheduleStep, ...] = 32
    """Examples per optimizer step, over all devices and processes; or a schedule, a list of {start: STEP, value:
    SIZE} stages (Levanter's), e.g. [{start: 0, value: 256}, {start: 1000, value: 512}]: each step reads the examples
    that follow the earlier steps', and the step compiles once per distinct size."""
    allow_nondivisible_batch_size: bool = False
    """Allow a batch size that does not divide over the data-parallel devices: the batch is padded with rows that
    count in neither the loss nor the token counts (Levanter's key)."""
    per_device_parallelism: int = -1
    """Examples per device per microbatch; -1: the whole batch at once (no gradient accumulation)."""
    per_device_eval_parallelism: int = -1
    """Examples per data-parallel device per evaluation batch; -1: evaluation batches as large as training's largest."""
    mp: str = "auto"
    """jmp precision policy, e.g. `p=f32,c=bfloat16`, `bfloat16` or `f32`; auto: f32 on CPU, p=f32,c=bfloat16 on
    GPU and TPU (the run's config.yaml records the policy it chose)."""
    steps_per_eval: int = 1000
    """Evaluate on the validation data every this many steps (and at the end)."""
    max_eval_batches: int | None = None
    """Evaluate on at most this many batches; null: the whole validation set."""
    log_every: int = 10
    """Log training metrics every this many steps."""
    model_axis_size: int = 1
    """Tensor-parallel degree (the `model` mesh axis)."""
    pipeline_axis_size: int = 1
    """Pipeline stages (the `stage` mesh axis): the layer stack split into this many contiguous chunks."""
    context_axis_size: int = 1
    """Context-parallel degree (the `context` mesh axis): each sequence's positions split over it (ring attention)."""
    expert_axis_size: int = 1
    """Expert-parallel degree (the `expert` mesh axis): MoE experts split over devices that also split the batch."""
    fsdp_axis: str | None = "embed"
    """Parameter axis sharded over the data axis (FSDP); None: replicate parameters."""
    tensor_parallel_axes: tuple[str, ...] = ("mlp", "heads", "kv_heads")
    """Axes sharded over the `model` mesh axis (tensor parallelism) when model_axis_size > 1."""
    batch_axis: str = "batch"
    """Name of the batch axis of the input ids."""
    mesh: dict[str, int] | None = None
    """Explicit mesh sizes, e.g. {replica: 2, data: -1, model: 2} (-1: the rest); overrides model_axis_size."""
    axis_resources: dict[str, Any] | None = None
    """Compute mapping overrides: logical axis -> mesh axis (or list of them, or null)."""
    parameter_axis_resources: dict[str, Any] | None = None
    """Parameter mapping overrides: logical axis -> mesh axis (or list of them, or null)."""
    id: str | None = None
    """Run name; default: derived from the config file name."""
    run_dir: str | None = None
    """Directory of the run; default: runs/<id>."""
    load_checkpoint: bool | None = None
    """True: resume, error if there is no checkpoint; False: start fresh; None: resume if one exists."""
    load_checkpoint_path: str | None = None
    """Resume from this checkpoint (or the newest one under this folder) instead of the run's own."""
    compilation_cache: bool = True
    """Keep compiled programs in JAX's persistent compilation cache, so that a rerun loads instead of compiling."""
    compilation_cache_dir: str | None = None
    """The cache's directory; default: $JAX_COMPILATION_CACHE_DIR if set, else <data.cache_dir>/jax-compiled."""
    checkpointer: CheckpointerConfig = field(default_factory=CheckpointerConfig)
    tracker: TrackerList = field(default_factory=TrackerList)
    """A tracker config ({type: wandb|tensorboard|console|noop|jsonl, ...}) or a list of them; jsonl is always on."""
    watch: WatchConfig = field(default_factory=WatchConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    eval_harness: EvalHarnessConfig = field(default_factory=EvalHarnessConfig)
    ray: RayClusterConfig = field(default_factory=RayClusterConfig)
    model_averaging: ModelAveragingConfig | None = None
    """An average of the weights kept beside them, e.g. {type: ema, beta: 0.999}; null: none (Levanter's key)."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Microbatches and schedule of pipeline parallelism (used when pipeline_axis_size > 1)."""
    quantization: QuantizationConfig | None = None
    """fp8 or int8 matmuls in the model's Linear layers, e.g. {fp8: true}; null: none (Levanter's key)."""

    def __post_init__(self) -> None:
        check_train_batch_size(self.train_batch_size)
        for key in ("num_train_steps", "steps_per_eval", "log_every", "model_axis_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} must be at least 1, got {getattr(self, key)}.")
        if self.pipeline_axis_size < 1:
            raise ConfigError(
                f"trainer.pipeline_axis_size must be at least 1 (1: no pipeline), got {self.pipeline_axis_size}."
            )
        if self.context_axis_size < 1:
            raise ConfigError(f"trainer.context_axis_size must be at least 1 (1: off), got {self.context_axis_size}.")
        if self.expert_axis_size < 1:
            raise ConfigError(
                f"trainer.expert_axis_size must be at least 1 (1: no expert parallelism), got {self.expert_axis_size}."
            )
        for key in ("per_device_parallelism", "per_device_eval_parallelism"):
            value = getattr(self, key)
            if value != -1 and value < 1:
                raise ConfigError(f"trainer.{key} must be -1 (off) or a positive number of examples, got {value}.")

    @property
    def batch_schedule(self) -> shard_cache.BatchSchedule:
        """Examples of each step (one stage for a fixed train_batch_size), and where each step's examples start."""
        return batch_schedule(self.train_batch_size)
