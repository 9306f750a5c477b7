"""Every package's wheel installs alone in a fresh venv, imports, and runs a smoke example there."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> (import name, smoke code, modules that must NOT be installed in its venv)
PACKAGES = {
    "storage-io": (
        "storage_io",
        "import sys, storage_io\n"
        "fs, path = storage_io.open_fs(sys.argv[1] + '/a.json')\n"
        "storage_io.write_atomic(fs, path, b'{}')\n"
        "assert storage_io.read_bytes(fs, path) == b'{}'\n",
        ("jax", "pyarrow"),
    ),
    "named-tensors": (
        "named_tensors",
        "import jax.numpy as jnp, named_tensors as nt\n"
        "x = nt.named(jnp.ones((2, 3)), ('batch', 'embed'))\n"
        "assert nt.sum(x, 'embed').shape == {'batch': 2}\n",
        (),
    ),
    "dist-ckpt": (
        "dist_ckpt",
        "import sys, numpy as np, dist_ckpt\n"
        "dist_ckpt.save({'w': np.arange(4.0)}, sys.argv[1] + '/step-1', step=1)\n"
        "dist_ckpt.wait()\n"
        "target = {'w': np.zeros(4)}\n"
        "assert (dist_ckpt.load(sys.argv[1] + '/step-1', target)['w'] == np.arange(4.0)).all()\n",
        (),
    ),
    "trackers": (
        "trackers",
        "import sys, trackers\n"
        "t = trackers.JsonlTracker(sys.argv[1] + '/m.jsonl')\n"
        "t.log({'loss': 1.5}, step=1); t.finish()\n"
        "assert trackers.read_jsonl(sys.argv[1] + '/m.jsonl')[0]['loss'] == 1.5\n",
        ("jax", "wandb", "tensorboardX"),
    ),
    "shard-cache": (
        "shard_cache",
        "import shard_cache, shard_cache.cli\n",
        ("jax", "jaxlib"),
    ),
    "lm-models": (
        "lm_models",
        "import jax, lm_models\n"
        "cfg = lm_models.Gpt2Config(seq_len=8, hidden_dim=16, num_layers=1, num_heads=2)\n"
        "import named_tensors as nt\n"
        "model = cfg.build(nt.Axis('vocab', 11), key=jax.random.key(0))\n",
        ("torch", "transformers"),
    ),
    "hf-bridge": ("hf_bridge", "import hf_bridge\n", ("torch", "transformers")),
    "lm-train": ("lm_train", "import lm_train.cli\n", ("torch",)),
}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for package in PACKAGES:
        subprocess.run(
            ["uv", "build", "--package", package, "--wheel", "--out-dir", str(out)],
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=300,
        )
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="needs uv to build wheels")
@pytest.mark.parametrize("package", list(PACKAGES))
def test_wheel_installs_alone_and_runs(package: str, wheels: Path, tmp_path: Path) -> None:
    module, smoke, forbidden = PACKAGES[package]
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "--python", sys.executable, str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    wheel = next(wheels.glob(f"{package.replace('-', '_')}-*.whl"))
    install = subprocess.run(
        ["uv", "pip", "install", "--python", str(python), "--find-links", str(wheels), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr
    script = tmp_path / "smoke.py"
    version = wheel.name.split("-")[1]
    # a package that states a __version__ states its wheel's
    check_version = f"v = getattr({module}, '__version__', {version!r})\nassert v == {version!r}, v\n"
    script.write_text(smoke + f"import {module}\n" + check_version + "print('ok')\n")
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run([str(python), str(script), str(work)], cwd=work, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    for name in forbidden:
        found = subprocess.run(
            [str(python), "-c", f"import importlib.util as u; print(u.find_spec('{name}'))"],
            capture_output=True,
            text=True,
        )
        assert found.stdout.strip() == "None", f"{package}'s venv has {name}, which it must not need"
