"""LAPACK from inside a compiled step on XLA:CPU: eigh one matrix per call, and OpenBLAS on one thread.

A step on several CPU devices runs each device's program on XLA's shared intra-op thread pool, and jaxlib's CPU
LAPACK kernels run on those threads. Two things then deadlock (each seen as SOAP's step hanging at 0% CPU on 8
simulated devices):

- jaxlib 0.10's kernel for a batch of matrices splits the batch over the same pool and blocks its thread until the
  parts finish. With every pool thread inside such a kernel, the parts wait in the queue behind them for ever. A
  batch of one runs in the calling thread, so `eigenvectors` calls eigh once per matrix on CPU.
- The LAPACK that jaxlib calls is scipy's OpenBLAS, which runs its own threads. Called from several threads at once
  it hung in its thread server (exec_blas_async). OpenBLAS's FAQ asks a multi-threaded program to set it to one
  thread; `single_threaded_blas` does so for the process (XLA's own matmuls do not use it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def eigenvectors(factors: jax.Array) -> jax.Array:
    """The eigenvectors of each symmetric matrix of a stack (B, d, d): one LAPACK call per matrix on CPU, a
    batched call elsewhere (cuSOLVER's batch has no such pool)."""
    return jax.lax.platform_dependent(
        factors,
        cpu=lambda fs: jax.lax.map(lambda f: jnp.linalg.eigh(f)[1], fs),
        default=lambda fs: jnp.linalg.eigh(fs)[1],
    )


@functools.cache
def single_threaded_blas() -> None:
    """Set every BLAS library loaded in this process (scipy's OpenBLAS, which jaxlib's CPU LAPACK calls,
    loaded first) to one thread, once."""
    import scipy.linalg.cython_lapack  # noqa: F401  (loads the library, so that the limit reaches it)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
