"""Named axes over jax arrays: broadcasting, contraction and reduction by axis name.

The public API is what this module lists in `__all__`, plus the `nn` (layers) and `random` namespaces. The
modules behind it are private (`named_tensors._core`, ...): import from `named_tensors`, not from them.
"""

from importlib import metadata as _metadata

from ._lazy import lazy_exports

__version__ = _metadata.version("named-tensors")  # the installed distribution's: no copy to drift

# Axis, the checkpoint policies and the layer names need no jax: configs that use only them decode without it.
__getattr__, __dir__, __all__ = lazy_exports(
    __name__, __file__, light=("._axis", "._policies", "._layer_names", "._lazy")
)
