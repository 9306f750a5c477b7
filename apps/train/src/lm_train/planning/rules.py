"""How XLA treats each jaxpr primitive, as far as buffers go: the tables the liveness model reads."""

from __future__ import annotations

GATHER_MARK = "lm_train_plan_all_gather"
# A collective that gives each device an array of its operand's shape from another (a ring's permute, an
# all-to-all): one op with a buffer of its own, in the forward and in the backward.
EXCHANGE_MARK = "lm_train_plan_exchange"

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
SCATTERS = IN_PLACE - {"dynamic_update_slice"}
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
