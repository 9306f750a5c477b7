"""Faults in exported safetensors, each made for real: truncation, flipped header bits, a deleted shard, a file
that cannot be read, a full disk (a small tmpfs), a half-written export from a kill, and storage that does not
keep what was written. Each gives one clear HfBridgeError naming the file and the fix, never a raw traceback,
and no export that looks complete is left behind. Also: what an export writes gets the modes the umask says."""

import ctypes
import json
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import hf_bridge
from hf_bridge import HfBridgeError
from lm_models import Gpt2Config

SHARD = "model-00002-of-00003.safetensors"
FIX = "Export it again"


@pytest.fixture(scope="module")
def exported(make_model, tmp_path_factory):
    """A GPT-2 exported in three files, its model and config."""
    config = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=3, num_heads=4)
    model = make_model(config, 64)
    path = tmp_path_factory.mktemp("faults") / "export"
    hf_bridge.save_pretrained(model, config, path, max_shard_size=60_000)
    assert SHARD in os.listdir(path) and "model-00004-of-00004.safetensors" not in os.listdir(path)
    return path, model, config


@pytest.fixture
def copy(exported, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(exported[0], target)
    return target


def _load_fails(path, *patterns):
    with pytest.raises(HfBridgeError) as error:
        hf_bridge.load_pretrained(path)
    message = str(error.value)
    for pattern in patterns:
        assert pattern in message, message
    return message


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


@pytest.mark.parametrize("keep", [0.5, 0.99, "header", 5])
def test_truncated_shard(copy, keep):
    file = copy / SHARD
    size = file.stat().st_size
    cut = {"header": 8 + len(_header(file)) // 2, 5: 5}.get(keep) or int(size * keep)
    os.truncate(file, cut)
    _load_fails(copy, str(file), "truncated", FIX)


def _flip(file: Path, position: int, bit: int = 0) -> None:
    data = bytearray(file.read_bytes())
    data[position] ^= 1 << bit
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["length", "length-high", "offset", "dtype", "shape", "key", "brace"])
def test_flipped_bit_in_a_header(copy, where):
    file = copy / SHARD
    header = _header(file)
    # The last digit of a number, flipped in its lowest bit, is another digit: the JSON stays valid.
    end_offset = re.search(rb'"data_offsets":\[0,(\d+)\]', header).end(1) - 1
    first_dim = re.search(rb'"shape":\[(\d+)', header).end(1) - 1
    position, expected = {
        "length": ((0, 2), "not valid JSON"),
        "length-high": ((6, 0), "which no safetensors file has"),
        "offset": ((8 + end_offset, 0), "where its shape needs"),
        "shape": ((8 + first_dim, 0), "where its shape needs"),
        "dtype": ((8 + header.index(b'"F32"') + 1, 0), "unknown dtype"),
        "key": ((8 + header.index(b'"transformer') + 1, 0), "do not belong together"),
        "brace": ((8, 1), "not valid JSON"),
    }[where]
    _flip(file, *position)
    message = _load_fails(copy, SHARD, expected)
    assert "Traceback" not in message, message


def test_deleted_shard(copy):
    (copy / SHARD).unlink()
    _load_fails(copy, SHARD, "incomplete", "export it again")


# Linux capabilities are per thread: a thread that drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH is bound by
# permission bits even as root, while the rest of the process keeps them.
CAPGET, CAPSET = {"x86_64": (125, 126), "aarch64": (90, 91)}.get(platform.machine(), (None, None))


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_file_capabilities_of_this_thread() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    if libc.syscall(CAPGET, ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.syscall(CAPSET, ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def _in_thread_without_file_capabilities(fn):
    result = {}

    def run():
        try:
            if os.geteuid() == 0:
                _drop_file_capabilities_of_this_thread()
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result


def test_shard_without_read_permission(copy):
    file = copy / SHARD
    file.chmod(0)
    if CAPSET is None and os.geteuid() == 0:
        pytest.skip(f"no capset syscall number for {platform.machine()}: root would read the file anyway")
    probe = _in_thread_without_file_capabilities(lambda: file.read_bytes())
    if "error" not in probe:
        pytest.skip("this process reads a file of mode 000 even without CAP_DAC_OVERRIDE (no permission fault)")
    assert isinstance(probe["error"], PermissionError)
    outcome = _in_thread_without_file_capabilities(lambda: hf_bridge.load_pretrained(copy))
    error = outcome.get("error")
    assert isinstance(error, HfBridgeError), outcome
    message = str(error)
    assert str(file) in message and "Permission denied" in message and "give the user running this" in message.lower()


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted for the test (skipped where mounting is impossible)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up here ({done.stderr.strip() or done.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_export_onto_a_full_disk_fails_clearly_and_leaves_the_old_export(make_model, exported, small_disk):
    path, model, _ = exported
    old = small_disk / "export"
    shutil.copytree(path, old)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    big_config = Gpt2Config(seq_len=16, hidden_dim=128, num_layers=4, num_heads=4)  # about 3.5 MB of weights
    big = make_model(big_config, 64)
    for target, overwrite in ((old, True), (small_disk / "new", False)):
        with pytest.raises(HfBridgeError) as error:
            hf_bridge.save_pretrained(big, big_config, target, max_shard_size=300_000, overwrite=overwrite)
        message = str(error.value)
        assert "No space left on device" in message and str(target) in message, message
        assert "Nothing was published" in message and "free space" in message.lower(), message
        assert sorted(p.name for p in small_disk.iterdir()) == ["export"]  # no temporary directory is left
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    again, _ = hf_bridge.load_pretrained(old)
    np.testing.assert_array_equal(np.asarray(again.ln_f.weight.array), np.asarray(model.ln_f.weight.array))


KILLED_EXPORT = """
    import sys, time
    import numpy as np
    import hf_bridge, hf_bridge.writer
    from conftest import random_model
    from lm_models import Gpt2Config

    config = Gpt2Config(seq_len=16, hidden_dim=32, num_layers=3, num_heads=4)
    model = random_model(config, 64)
    real_write, calls = hf_bridge.writer._write, []

    def write_then_pause(out, handle, record, entry, data):
        real_write(out, handle, record, entry, data)
        calls.append(entry.key)
        if record.name.startswith("model-00002") and len(calls) > 1:
            handle.flush()
            print("PAUSED", flush=True)
            time.sleep(120)

    hf_bridge.writer._write = write_then_pause
    hf_bridge.save_pretrained(model, config, sys.argv[1], max_shard_size=60_000)
"""


def test_an_export_killed_half_way_leaves_nothing_that_looks_complete(exported, tmp_path):
    target = tmp_path / "out" / "export"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_EXPORT), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent), XLA_FLAGS="--xla_force_host_platform_device_count=1")
    child = subprocess.Popen([sys.executable, str(script), str(target)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.strip() == "PAUSED", line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert not target.exists()
    (leftover,) = (tmp_path / "out").iterdir()  # the temporary directory, with the half-written second file
    assert leftover.name.startswith(".export.hf_bridge_tmp_")
    half = leftover / SHARD
    assert half.exists() and half.stat().st_size < (exported[0] / SHARD).stat().st_size
    _load_fails(target, "does not exist")
    _load_fails(leftover, "has neither model.safetensors nor model.safetensors.index.json")  # both come last
    # With every other file in place, the half-written one is named as such.
    for name in ("config.json", "model.safetensors.index.json", "model-00003-of-00003.safetensors"):
        shutil.copy(exported[0] / name, leftover)
    _load_fails(leftover, str(half), "truncated")
    hf_bridge.save_pretrained(exported[1], exported[2], target)  # the same command again succeeds
    assert hf_bridge.load_pretrained(target)[1] == exported[2]


@pytest.mark.parametrize("damage", ["flip", "append", "index"])
def test_an_export_that_reads_back_wrong_is_not_published(exported, tmp_path, monkeypatch, damage):
    import hf_bridge.save

    _, model, config = exported
    real_verify = hf_bridge.save.verify_export

    def storage_that_changes_a_file(written, files, shown):
        # Between writing and checking, the storage loses what was written (a bad disk, a broken upload).
        local = Path(written.root)
        last = local / files[-1].name
        if damage == "flip":
            _flip(last, last.stat().st_size - 3, 5)
        elif damage == "append":
            with open(last, "ab") as f:
                f.write(b"\0")
        else:
            (local / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
        return real_verify(written, files, shown)

    monkeypatch.setattr(hf_bridge.save, "verify_export", storage_that_changes_a_file)
    target = tmp_path / "export"
    with pytest.raises(HfBridgeError) as error:
        hf_bridge.save_pretrained(model, config, target, max_shard_size=60_000)
    name = "model.safetensors.index.json" if damage == "index" else "model-00003-of-00003.safetensors"
    message = str(error.value)
    assert f"{target}/{name}" in message and "was not published" in message, message
    assert {"flip": "other bytes for tensor", "append": "bytes where", "index": "does not map"}[damage] in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_an_export_gets_the_modes_the_umask_gives(exported, tmp_path, umask):
    _, model, config = exported
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    old = os.umask(umask)
    try:
        target = tmp_path / f"export-{uuid.uuid4().hex[:6]}"
        hf_bridge.save_pretrained(model, config, target, max_shard_size=60_000, tokenizer=tokenizer)
        alone = tmp_path / "tokenizer-alone"
        hf_bridge.save_tokenizer(tokenizer, alone)
    finally:
        os.umask(old)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask
    files = list(target.iterdir()) + list(alone.iterdir())
    assert len(files) > 6 and "tokenizer.json" in {f.name for f in files}
    for file in files:
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file


def test_a_bad_tokenizer_leaves_no_temporary_directory(exported, tmp_path):
    _, model, config = exported
    with pytest.raises(HfBridgeError, match="does not exist"):
        hf_bridge.save_pretrained(model, config, tmp_path / "export", tokenizer=tmp_path / "no-tokenizer.json")
    assert list(tmp_path.iterdir()) == []
