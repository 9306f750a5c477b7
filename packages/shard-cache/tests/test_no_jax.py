import subprocess
import sys


def test_import_does_not_pull_jax_or_ray():
    code = "import sys, shard_cache, shard_cache.cli; print('jax' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
