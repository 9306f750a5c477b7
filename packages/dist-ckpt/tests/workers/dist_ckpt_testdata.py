"""Reference data shared by the dist-ckpt tests and their worker processes (plain numpy, seeded)."""

import ml_dtypes
import numpy as np

SHAPES = {"embed": (16, 8), "mlp": (8, 32), "bias": (32,)}


def reference_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """Global values of a small training state, as numpy arrays with the dtypes a trainer uses."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal(SHAPES["embed"], dtype=np.float32),
        "mlp": rng.standard_normal(SHAPES["mlp"]).astype(ml_dtypes.bfloat16),
        "bias": rng.standard_normal(SHAPES["bias"], dtype=np.float32),
        "mu": rng.integers(-(2**31), 2**31 - 1, size=(16, 8), dtype=np.int32),
        "key": rng.integers(0, 2**32 - 1, size=(2,), dtype=np.uint32),
        "mask": rng.random((8, 4)) > 0.5,
    }
