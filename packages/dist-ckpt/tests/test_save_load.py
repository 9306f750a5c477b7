"""Save with one mesh, load with another: bitwise equality, casts, subtrees, plain-tensorstore readability."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from dist_ckpt_testdata import reference_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt


def mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def put(value, mesh_, spec):
    return jax.device_put(value, NamedSharding(mesh_, spec))


def saved_tree():
    ref = reference_arrays()
    m = mesh((2, 4), ("data", "model"))
    return ref, {
        "params": {
            "embed": put(ref["embed"], m, P("data", "model")),
            "mlp": put(ref["mlp"], m, P(None, "model")),
            "bias": put(ref["bias"], m, P()),
        },
        "opt": [put(ref["mu"], m, P("model", "data")), None],
        "key": put(ref["key"], m, P()),
        "mask": put(ref["mask"], m, P("data")),
        "step": 12,
        "scale": 0.1,
        "flag": True,
        "name": "run-a",
        "host": np.linspace(0, 1, 5),  # float64 numpy: host-side state keeps its dtype
    }


def target_on(mesh_, ref, specs=None):
    specs = specs or {}

    def sds(name, shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh_, specs.get(name, P())))

    return {
        "params": {
            "embed": sds("embed", (16, 8), np.float32),
            "mlp": sds("mlp", (8, 32), ml_dtypes.bfloat16),
            "bias": sds("bias", (32,), np.float32),
        },
        "opt": [sds("mu", (16, 8), np.int32), None],
        "key": sds("key", (2,), np.uint32),
        "mask": sds("mask", (8, 4), np.bool_),
        "step": 0,
        "scale": 0.0,
        "flag": False,
        "name": "",
        "host": np.zeros(5),
    }


def test_save_one_mesh_load_another_is_bitwise_equal(tmp_path):
    ref, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "step-12", step=12, metadata={"lr": 0.001}, block=True)
    other = mesh((4, 2), ("a", "b"))
    specs = {"embed": P("b", "a"), "mlp": P("a", "b"), "bias": P(("a", "b")), "mu": P(None, "a")}
    loaded = dist_ckpt.load(tmp_path / "step-12", target_on(other, ref, specs))
    got = {**loaded["params"], "mu": loaded["opt"][0], "key": loaded["key"], "mask": loaded["mask"]}
    for name, expected in ref.items():
        assert got[name].sharding == NamedSharding(other, specs.get(name, P()))
        assert np.asarray(got[name]).dtype == expected.dtype
        assert np.asarray(got[name]).tobytes() == expected.tobytes(), name
    assert loaded["opt"][1] is None
    assert (loaded["step"], loaded["scale"], loaded["flag"], loaded["name"]) == (12, 0.1, True, "run-a")
    assert type(loaded["step"]) is int and type(loaded["scale"]) is float
    assert loaded["host"].dtype == np.float64 and loaded["host"].tobytes() == np.linspace(0, 1, 5).tobytes()


def test_load_onto_real_arrays_uses_their_shardings(tmp_path):
    ref, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "ck", step=1, block=True)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    target = jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, s.dtype), one_device) if isinstance(s, jax.ShapeDtypeStruct) else s,
        target_on(mesh((8,), ("d",)), ref),
    )
    loaded = dist_ckpt.load(tmp_path / "ck", target)
    assert loaded["params"]["embed"].sharding == one_device
    assert np.asarray(loaded["params"]["embed"]).tobytes() == ref["embed"].tobytes()


def test_dtype_cast_on_load_matches_numpy_astype(tmp_path):
    ref, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "ck", step=1, block=True)
    m = mesh((8,), ("d",))
    target = {
        "embed": jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=NamedSharding(m, P("d"))),
        "mlp": jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=NamedSharding(m, P(None, "d"))),
        "bias": np.zeros(32, np.float16),
    }
    loaded = dist_ckpt.load(tmp_path / "ck", target, subtree="['params']")
    np.testing.assert_array_equal(np.asarray(loaded["embed"]), ref["embed"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(loaded["mlp"]), ref["mlp"].astype(np.float32))
    assert loaded["bias"].dtype == np.float16
    np.testing.assert_array_equal(loaded["bias"], ref["bias"].astype(np.float16))


class Block(eqx.Module):
    weight: jax.Array
    bias: jax.Array | None
    activation: str = eqx.field(static=True)


class Model(eqx.Module):
    blocks: list[Block]
    scale: jax.Array


def test_equinox_module_round_trip_with_static_fields_and_none(tmp_path):
    key = jax.random.key(0)
    model = Model(
        blocks=[
            Block(jax.random.normal(key, (4, 4)), None, "relu"),
            Block(jax.random.normal(jax.random.fold_in(key, 1), (4, 4)), jnp.ones(4), "gelu"),
        ],
        scale=jnp.float32(2.0),
    )
    dist_ckpt.save(model, tmp_path / "model", step=0, block=True)
    blank = jax.tree.map(lambda x: jnp.zeros_like(x), model)
    loaded = dist_ckpt.load(tmp_path / "model", blank)
    assert loaded.blocks[1].activation == "gelu" and loaded.blocks[0].bias is None
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    names = [entry["path"] for entry in dist_ckpt.read_manifest(tmp_path / "model")["leaves"]]
    assert names == [".blocks[0].weight", ".blocks[1].weight", ".blocks[1].bias", ".scale"]


def test_plain_tensorstore_reads_saved_arrays(tmp_path):
    ref, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "step-3", step=3, block=True)
    for name, path in [("embed", "params.embed"), ("mlp", "params.mlp"), ("mu", "opt.0"), ("mask", "mask")]:
        store = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/step-3/arrays/{path}/"}).result()
        assert store.read().result().tobytes() == ref[name].tobytes()
        assert store.dtype.numpy_dtype == ref[name].dtype


def test_ocdbt_packs_arrays_into_one_database_readable_by_plain_tensorstore(tmp_path):
    ref, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "ck", step=3, ocdbt=True, block=True)
    assert not (tmp_path / "ck" / "arrays").exists()
    database = tmp_path / "ck" / "arrays.ocdbt"
    files = sorted(str(p.relative_to(database)) for p in database.rglob("*") if p.is_file())
    # One database: its manifest and content-addressed data files, not a directory of chunks per array. (How many
    # data files depends on how tensorstore batched the writes into commits: 4-5 on a quiet machine, 8 under load.)
    assert files[-1] == "manifest.ocdbt" and all(f.startswith("d/") for f in files[:-1]), files
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_path}/ck/arrays.ocdbt/", "path": "params.embed/"},
    }
    assert ts.open(spec).result().read().result().tobytes() == ref["embed"].tobytes()
    loaded = dist_ckpt.load(tmp_path / "ck", target_on(mesh((4, 2), ("a", "b")), ref))
    assert np.asarray(loaded["opt"][0]).tobytes() == ref["mu"].tobytes()


def test_load_without_target_returns_flat_numpy_dict(tmp_path):
    ref, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "ck", step=3, block=True)
    flat = dist_ckpt.load(tmp_path / "ck")
    assert flat["['params']['embed']"].tobytes() == ref["embed"].tobytes()
    assert flat["['opt'][0]"].tobytes() == ref["mu"].tobytes()
    assert flat["['step']"] == 12 and flat["['name']"] == "run-a"
    assert set(dist_ckpt.load(tmp_path / "ck", subtree="['params']")) == {
        "['params']['embed']",
        "['params']['mlp']",
        "['params']['bias']",
    }


def test_python_scalars_round_trip_exactly(tmp_path):
    tree = {"nan": math.nan, "inf": -math.inf, "tiny": 5e-324, "big": 2**70, "third": 1 / 3, "no": False}
    dist_ckpt.save(tree, tmp_path / "ck", step=0, block=True)
    loaded = dist_ckpt.load(tmp_path / "ck", {k: type(v)() for k, v in tree.items()})
    assert math.isnan(loaded.pop("nan"))
    assert loaded == {k: v for k, v in tree.items() if k != "nan"}


def test_manifest_records_step_time_metadata_and_shapes(tmp_path):
    _, tree = saved_tree()
    dist_ckpt.save(tree, tmp_path / "ck", step=12, metadata={"lr": 0.001, "tags": ["a"]}, block=True)
    manifest = dist_ckpt.read_manifest(tmp_path / "ck")
    assert manifest["step"] == 12 and manifest["metadata"] == {"lr": 0.001, "tags": ["a"]}
    assert manifest["time"].startswith("20")
    embed = next(e for e in manifest["leaves"] if e["path"] == "['params']['embed']")
    assert (embed["dtype"], embed["shape"]) == ("float32", [16, 8])


def test_large_arrays_are_split_into_chunks_within_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(dist_ckpt.storage, "MAX_CHUNK_BYTES", 4 * 1024)  # a small cap keeps the test small
    value = np.arange(64 * 96, dtype=np.float32).reshape(64, 96)
    sharded = put(value, mesh((8,), ("d",)), P("d"))  # shards of 8 x 96 floats = 3 KiB: one chunk each
    dist_ckpt.save({"big": value, "sharded": sharded}, tmp_path / "ck", step=0, block=True)
    big, shard = dist_ckpt.read_manifest(tmp_path / "ck")["leaves"]
    assert big["chunk_shape"] == [32, 24] and shard["chunk_shape"] == [8, 96]
    assert len(list((tmp_path / "ck/arrays/big/c").rglob("*"))) == 2 + 2 * 4  # 2 row dirs, 2 x 4 chunks
    loaded = dist_ckpt.load(tmp_path / "ck", {"big": np.zeros_like(value), "sharded": np.zeros_like(value)})
    assert loaded["big"].tobytes() == value.tobytes() and loaded["sharded"].tobytes() == value.tobytes()


def test_resume_on_saved_layout_gives_arrays_that_survive_donation(tmp_path):
    """Whole-chunk regions are read into buffers that jax adopts; a donating step must not corrupt them."""
    m = mesh((2, 4), ("data", "model"))
    value = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)
    tree = {"sharded": put(value, m, P("data", "model")), "replicated": put(value, m, P())}
    dist_ckpt.save(tree, tmp_path / "ck", step=0, block=True)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)
    loaded = dist_ckpt.load(tmp_path / "ck", target)
    for name, array in loaded.items():
        assert array.sharding == tree[name].sharding
        for shard in array.addressable_shards:
            assert np.asarray(shard.data).tobytes() == value[shard.index].tobytes(), name

    stepped = jax.jit(lambda t: jax.tree.map(lambda a: a * 2 + 1, t), donate_argnums=0)(loaded)
    for array in stepped.values():
        for shard in array.addressable_shards:  # every replica updated once, none twice
            assert np.asarray(shard.data).tobytes() == (value[shard.index] * 2 + 1).tobytes()
    again = dist_ckpt.load(tmp_path / "ck", target)
    assert all(np.asarray(a).tobytes() == value.tobytes() for a in again.values())


class _OldBlock(eqx.Module):
    input_layernorm: jax.Array
    mlp: jax.Array


class _NewBlock(eqx.Module):
    pre_attn_norm: jax.Array
    mlp: jax.Array


def test_renames_read_a_checkpoint_saved_before_fields_were_renamed(tmp_path):
    """A tree saved under old field names loads onto the renamed tree, value for value; without the renames (or
    with renames that do not explain the difference) it is the usual mismatch error."""
    old = {"block": _OldBlock(jnp.arange(4.0), jnp.arange(6.0).reshape(2, 3)), "step": 3}
    dist_ckpt.save(old, tmp_path / "ckpt", step=3, block=True, progress=False)
    target = {"block": _NewBlock(jnp.zeros(4), jnp.zeros((2, 3))), "step": 0}
    loaded = dist_ckpt.load(tmp_path / "ckpt", target, renames={"input_layernorm": "pre_attn_norm"})
    np.testing.assert_array_equal(np.asarray(loaded["block"].pre_attn_norm), np.arange(4.0))
    np.testing.assert_array_equal(np.asarray(loaded["block"].mlp), np.arange(6.0).reshape(2, 3))
    assert loaded["step"] == 3
    with pytest.raises(dist_ckpt.TreeMismatchError, match=r"pre_attn_norm|input_layernorm"):
        dist_ckpt.load(tmp_path / "ckpt", target)
    with pytest.raises(dist_ckpt.TreeMismatchError, match=r"pre_attn_norm|input_layernorm"):
        dist_ckpt.load(tmp_path / "ckpt", target, renames={"input": "pre_attn_norm"})  # whole names only
