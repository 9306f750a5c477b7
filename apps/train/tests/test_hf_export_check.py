"""export-hf's last step: the export is loaded once and compared with the model it was written from."""

from __future__ import annotations

import json
import shutil
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_bridge
import lm_models
import named_tensors as nt
from lm_train.errors import ExportError
from lm_train.tools.hf_export import check_export


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny GPT-2 of ours with random weights, exported once in float32."""
    config = lm_models.Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2)
    # Random normal weights, made without the (slow, eager) initialiser; none is zero, as biases would be.
    shapes = eqx.filter_eval_shape(lambda: config.build(nt.Axis("vocab", 32), key=jax.random.key(0)))
    rng = np.random.default_rng(0)
    model = jax.tree.map(
        lambda leaf: nt.NamedArray(jnp.asarray(rng.normal(0.0, 0.2, leaf.array.shape).astype(np.float32)), leaf.axes),
        shapes,
        is_leaf=nt.is_named,
    )
    out = tmp_path_factory.mktemp("export") / "hf"
    hf_bridge.save_pretrained(model, config, out)
    return model, out


def _tensor_bytes(path, name):
    """Where tensor `name`'s bytes lie in a safetensors file (start, end), read with plain struct and json."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start, end = header[name]["data_offsets"]
    return 8 + n + start, 8 + n + end


def test_an_intact_export_passes_and_a_bfloat16_one_is_compared_after_the_cast(exported, tmp_path):
    model, out = exported
    check_export(model, str(out), dtype=None, source="step-1")
    config = lm_models.Gpt2Config(seq_len=8, hidden_dim=16, num_layers=2, num_heads=2)
    hf_bridge.save_pretrained(model, config, tmp_path / "bf16", dtype="bfloat16")
    check_export(model, str(tmp_path / "bf16"), dtype="bfloat16", source="step-1")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_value_changed_after_writing_is_an_error_naming_the_tensor_and_the_fix(exported, tmp_path, where):
    model, out = exported
    copy = tmp_path / "hf"
    shutil.copytree(out, copy)
    file = copy / "model.safetensors"
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        names = sorted(k for k in json.loads(f.read(n)) if k != "__metadata__")
    name = {"first": names[0], "middle": names[len(names) // 2], "last": names[-1]}[where]
    start, end = _tensor_bytes(file, name)
    data = bytearray(file.read_bytes())
    data[(start + end) // 2] ^= 0x10  # one bit of one value: the file stays a valid safetensors file
    file.write_bytes(bytes(data))
    with pytest.raises(ExportError) as error:
        check_export(model, str(copy), dtype=None, source="runs/x/checkpoints/step-4")
    message = str(error.value)
    assert str(copy) in message and "runs/x/checkpoints/step-4" in message and "--overwrite" in message, message
    assert "reads back tensor" in message, message


def test_a_truncated_export_is_an_error_that_says_to_export_again(exported, tmp_path):
    model, out = exported
    copy = tmp_path / "hf"
    shutil.copytree(out, copy)
    file = copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ExportError) as error:
        check_export(model, str(copy), dtype=None, source="step-4")
    assert "does not load back" in str(error.value) and "model.safetensors" in str(error.value)
