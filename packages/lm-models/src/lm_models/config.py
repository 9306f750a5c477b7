"""LmConfig: the abstract base of model configs (no jax: configs decode and check without it), and the checks
the family configs share."""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import named_tensors as nt
from lm_models.registry import config_registry
from named_tensors import CHECKPOINT_POLICIES, Axis, CheckpointPolicy

# At run time, not only for type checkers: draccus resolves LmConfig's annotations (hf_mapping's among them).
from .hf_layout import HfMapping

if TYPE_CHECKING:
    import equinox as eqx
    import jax

ConfigT = TypeVar("ConfigT", bound=type)


@config_registry("model")
class LmConfig(abc.ABC):
    """Base of every model config; also a draccus choice type, so YAML `model: {type: gpt2, ...}` decodes."""

    # -- what every model config provides ------------------------------------------------------------------
    # Annotations only (LmConfig is not a dataclass): each family declares these as fields with its own defaults;
    # the strings under them document the key once for every family.
    seq_len: int
    """Tokens per training example (the length of the `position` axis)."""
    hidden_dim: int
    """Width of the residual stream: the size of the `embed` axis."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Attention (query) heads per block."""
    activation_function: str
    """The MLP's nonlinearity: gelu, gelu_new, gelu_pytorch_tanh, quick_gelu, relu, sigmoid, silu, swish or tanh."""
    initializer_range: float
    """Standard deviation of the normal distribution that weights are initialised from."""
    layer_norm_epsilon: float
    """Added to the variance inside every LayerNorm/RMSNorm, for numerical stability."""
    attn_pdrop: float
    """Dropout probability on the attention weights, in [0, 1); 0: none (evaluation never drops)."""
    upcast_attn: bool
    """Compute the attention softmax in float32 even when activations are bfloat16/float16."""
    gradient_checkpointing: bool | str
    """What the backward pass recomputes per block: true (= full), false (= none), or a policy: none (store all
    activations), full (store only each block's input), save_block_outputs (store each block's output too),
    nested (full, with the layer scan split into about sqrt(num_layers) groups that are checkpointed as well)."""
    scan_layers: bool
    """Run the blocks as one jax.lax.scan over a stacked `layers` axis (fast compile); false: a Python loop."""
    scan_unroll: bool | int | str
    """Layers per scan step when scan_layers (a positive int; 1: no unrolling); true: unroll every layer; auto (the
    default): every layer on CPU when gradient_checkpointing is false, else 1."""
    use_flash_attention: bool
    """Blockwise (flash) attention, which never holds the whole seq_len x seq_len score matrix."""
    flash_attention_block_size: int | None
    """Query/key block length of flash attention, in positions; null: 128."""
    attn_backend: str
    """The attention kernel: default (cuDNN's fused kernel on NVIDIA GPUs, the Pallas splash kernel on TPUs, where
    they apply; else ours), vanilla (ours), jax_flash (ours, blockwise), xla or cudnn (jax.nn.dot_product_attention's
    implementations), splash (interpreted off a TPU: slow)."""
    cross_entropy_block_size: int | None
    """Score the vocabulary in blocks of this many entries in the training loss, so that the full float32 logits
    never exist at once; null: blocks of 8192 on GPUs and TPUs for vocabularies of 32768 or more, else all at once."""

    if TYPE_CHECKING:  # installed at run time by @config_registry above; declared for type checkers

        @classmethod
        def register_subclass(cls, name: str) -> Callable[[ConfigT], ConfigT]: ...
        @classmethod
        def get_choice_class(cls, name: str) -> type[LmConfig]: ...
        @classmethod
        def get_known_choices(cls) -> dict[str, type[LmConfig]]: ...
        @classmethod
        def get_choice_name(cls, subcls: type) -> str: ...
        @classmethod
        def default_choice_name(cls) -> str | None: ...
        @classmethod
        def unregister(cls, name: str) -> None: ...

    @property
    def model_type(self) -> str:
        """The registered `type` name of this config."""
        return LmConfig.get_choice_name(type(self))

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model can take (learned position tables), or None when unlimited."""
        return None

    @property
    def Pos(self) -> Axis:
        return Axis("position", self.seq_len)

    @property
    def KeyPos(self) -> Axis:
        return Axis("key_position", self.seq_len)

    @property
    def Embed(self) -> Axis:
        return Axis("embed", self.hidden_dim)

    @property
    def Heads(self) -> Axis:
        return Axis("heads", self.num_heads)

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_heads)

    @property
    def HeadSize(self) -> Axis:
        return Axis("head_size", self.hidden_dim // self.num_heads)

    @property
    def Layers(self) -> Axis:
        return Axis("layers", self.num_layers)

    @property
    @abc.abstractmethod
    def Mlp(self) -> Axis:
        """The hidden axis of the feed-forward block."""

    model_class: ClassVar[str | None] = None
    """The family's model class as "module:Class"; `build` imports it then, so that configs need no jax."""

    hf_mapping: ClassVar[HfMapping | None] = None
    """The family's Hugging Face mapping (config.json keys both ways, tensor layout); None: it has none. A class's
    own, never inherited: a subclass registered as another type states its own (see hf_families)."""

    def build(self, Vocab: Axis, *, key: jax.Array) -> eqx.Module:
        """A freshly initialised model over the vocabulary axis `Vocab`: the model class's `init`."""
        if self.model_class is None:
            raise TypeError(
                f"{type(self).__name__} cannot build a model: set its class variable model_class to the model's "
                "'module:Class' (e.g. 'lm_models.gpt2:Gpt2LMHeadModel'), or override build()"
            )
        module, _, name = self.model_class.partition(":")
        return getattr(importlib.import_module(module), name).init(Vocab, self, key=key)

    @abc.abstractmethod
    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token, attention included, for MFU."""

    def aux_loss_weights(self) -> dict[str, float]:
        """The weight of each auxiliary loss the model reports (LmHeadModel.activations_and_aux); {} for none."""
        return {}

    def needs_plain_positions(self) -> str | None:
        """Why training must give this model whole sequences at positions 0 .. seq_len - 1 in order (no packing, no
        context parallelism), naming the key that asks for it; None when it takes any positions."""
        return None


def register_model(name: str) -> Callable[[ConfigT], ConfigT]:
    """Class decorator: `@register_model("gpt2")` is `@LmConfig.register_subclass("gpt2")`."""
    return LmConfig.register_subclass(name)


def hf_families() -> dict[str, tuple[type[LmConfig], HfMapping]]:
    """Every registered family with a Hugging Face mapping: our `type` name -> (config class, mapping)."""
    out: dict[str, tuple[type[LmConfig], HfMapping]] = {}
    claimed: dict[str, str] = {}
    for name, cls in LmConfig.get_known_choices().items():
        mapping = vars(cls).get("hf_mapping")
        if mapping is None:
            continue
        other = claimed.setdefault(mapping.hf_model_type, name)
        if other != name:
            raise ValueError(
                f"Model types {other!r} and {name!r} both map to Hugging Face model_type {mapping.hf_model_type!r}; "
                "give one of them another hf_model_type in its hf_mapping."
            )
        out[name] = (cls, mapping)
    return out


def checkpoint_policy(value: bool | str) -> CheckpointPolicy:
    """The nt.Stacked policy name for a `gradient_checkpointing` setting (True: "full", False: "none")."""
    if value is True:
        return "full"
    if value is False:
        return "none"
    if isinstance(value, str) and value in CHECKPOINT_POLICIES:
        return cast(CheckpointPolicy, value)  # one of the policy names, as just checked
    raise ValueError(
        f"gradient_checkpointing={value!r} is not valid: use true, false, or one of the policy names "
        f"{list(CHECKPOINT_POLICIES)}"
    )


def check_layer_stack(config: Any) -> None:
    """Raise a ValueError for a bad `gradient_checkpointing` or `scan_unroll` (the layer stack's settings)."""
    checkpoint_policy(config.gradient_checkpointing)
    unroll = config.scan_unroll
    if unroll != SCAN_UNROLL_AUTO and not isinstance(unroll, bool) and (not isinstance(unroll, int) or unroll < 1):
        raise ValueError(
            f"{type(config).__name__}.scan_unroll must be true (run every layer in one unrolled scan step), a "
            f"positive number of layers per scan step, or auto, got {unroll!r}"
        )


SCAN_UNROLL_AUTO = "auto"


def resolve_scan_unroll(config: Any, platform: str | None = None) -> bool | int:
    """config.scan_unroll as the layer scan takes it, on `platform` (default: the devices present).

    `auto` unrolls every layer on CPU when nothing is recomputed: there, a rolled scan zero-fills, updates and
    slices stacked per-layer residuals, which cost 16-25% of the step, and holds more memory than unrolled layers.
    Elsewhere it is 1 (rolled): with remat, jax 0.10's XLA:CPU keeps every unrolled layer's activations; on GPUs and
    TPUs the rolled scan compiles in a time that does not grow with depth.
    """
    unroll = config.scan_unroll
    if unroll != SCAN_UNROLL_AUTO:
        return unroll
    if checkpoint_policy(config.gradient_checkpointing) != "none":
        return 1
    if platform is None:
        import jax  # here, not at the top: reading a config does not import jax

        platform = jax.default_backend()
    return True if platform == "cpu" else 1


def check_activation(config: Any) -> None:
    """Raise a ValueError unless `activation_function` names an activation named-tensors has."""
    name = config.activation_function
    if name not in nt.ACTIVATION_NAMES:
        raise ValueError(
            f"{type(config).__name__}.activation_function: Unknown activation {name!r}; choose one of "
            f"{list(nt.ACTIVATION_NAMES)}"
        )


def check_positive(config: Any, *names: str) -> None:
    """Raise a ValueError naming the first field among `names` that is not a positive int."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive integer, got {value!r}")


def check_heads_divide(config: Any) -> None:
    """Raise unless num_heads divides hidden_dim (every head gets the same head size)."""
    if config.hidden_dim % config.num_heads != 0:
        raise ValueError(
            f"{type(config).__name__}: num_heads={config.num_heads} does not divide "
            f"hidden_dim={config.hidden_dim}; choose a hidden_dim that is a multiple of num_heads"
        )


def check_probability(config: Any, *names: str) -> None:
    """Raise unless each named field is a probability in [0, 1)."""
    for name in names:
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{type(config).__name__}.{name} must be in [0, 1), got {value!r}")


ATTN_BACKENDS = ("default", "vanilla", "jax_flash", "xla", "cudnn", "splash")
NOT_BUILT = {"nvte": "TransformerEngine attention"}


def check_attn_backend(config: Any) -> None:
    """Raise a ValueError for an unknown attn_backend, or one that contradicts use_flash_attention."""
    name, backend = type(config).__name__, config.attn_backend
    if backend in NOT_BUILT:
        raise ValueError(
            f"{name}.attn_backend: {backend!r} ({NOT_BUILT[backend]}) is not built here; use one of "
            f"{list(ATTN_BACKENDS)} (default picks cuDNN's fused kernel on NVIDIA GPUs, splash on TPUs and ours "
            "elsewhere)"
        )
    if backend not in ATTN_BACKENDS:
        raise ValueError(f"{name}.attn_backend must be one of {list(ATTN_BACKENDS)}, got {backend!r}")
    if config.use_flash_attention and backend not in ("default", "jax_flash"):
        raise ValueError(
            f"{name}: use_flash_attention is true but attn_backend is {backend!r}; drop use_flash_attention (it "
            "means attn_backend: jax_flash) or the attn_backend"
        )


def check_cross_entropy_block_size(config: Any) -> None:
    """Raise unless cross_entropy_block_size is null or a positive number of vocabulary entries."""
    size = config.cross_entropy_block_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(
            f"{type(config).__name__}.cross_entropy_block_size must be a positive number of vocabulary entries or "
            f"null, got {size!r}"
        )
