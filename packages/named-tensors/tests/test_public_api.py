"""The package's public surface: an explicit list, private modules behind it, and no name users had lost."""

import types

import named_tensors as nt

# Every function, class and constant that `import named_tensors` exported before the list was made explicit.
NAMES_USERS_HAD = [
    "Axis",
    "AxisMapping",
    "AxisSelection",
    "AxisSelector",
    "AxisSpec",
    "BLOCK_OUTPUT",
    "BlockSeq",
    "CHECKPOINT_POLICIES",
    "CheckpointPolicy",
    "DynamicSlice",
    "Filter",
    "IndexUpdateRef",
    "MeshAxes",
    "NamedArray",
    "Stacked",
    "abs",
    "all",
    "any",
    "arange",
    "argmax",
    "argmin",
    "argsort",
    "as_axis_tuple",
    "axis_mapping",
    "axis_name",
    "broadcast_arrays",
    "broadcast_to",
    "check_unique",
    "clip",
    "combine",
    "concatenate",
    "cos",
    "count_parameters",
    "cumprod",
    "cumsum",
    "current_axis_mapping",
    "current_mesh",
    "dot",
    "ds",
    "dynamic_slice",
    "dynamic_update_slice",
    "einsum",
    "elementwise",
    "exp",
    "flatten_axes",
    "fold",
    "full",
    "full_like",
    "gelu",
    "index",
    "infer_sharding",
    "is_floating",
    "is_named",
    "isfinite",
    "log",
    "log_softmax",
    "logical_not",
    "logsumexp",
    "make_mesh",
    "mask",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "named",
    "named_jit",
    "ones",
    "ones_like",
    "pad",
    "partition",
    "partition_spec",
    "path_matches",
    "path_str",
    "permute",
    "prod",
    "rearrange",
    "relu",
    "rename",
    "roll",
    "rsqrt",
    "scan",
    "shard",
    "shard_tree",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "sort",
    "split",
    "sqrt",
    "square",
    "stack",
    "std",
    "stop_gradient",
    "sum",
    "take",
    "tanh",
    "top_k",
    "tree_leaves",
    "tree_map",
    "union_axes",
    "unflatten_axis",
    "var",
    "vmap",
    "where",
    "with_axis",
    "zeros",
    "zeros_like",
    "nn",
    "random",
]


def test_all_lists_every_public_name_and_each_exists():
    assert sorted(set(nt.__all__)) == sorted(nt.__all__), "duplicate entries in __all__"
    missing = [name for name in nt.__all__ if not hasattr(nt, name)]
    assert missing == []
    public = {name for name in vars(nt) if not name.startswith("_")}
    assert public - set(nt.__all__) == set(), "public names that __all__ does not list"


def test_no_name_that_users_used_disappears():
    assert sorted(set(NAMES_USERS_HAD) - set(nt.__all__)) == []


def test_only_the_nn_and_random_namespaces_are_public_modules():
    modules = sorted(name for name in nt.__all__ if isinstance(getattr(nt, name), types.ModuleType))
    assert modules == ["nn", "random"]
    assert nt.random.normal is not None and nt.nn.Linear is not None


def test_star_import_gives_exactly_the_list():
    namespace: dict = {}
    exec("from named_tensors import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(nt.__all__)
