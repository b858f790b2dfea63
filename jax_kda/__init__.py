"""jax_kda: Kimi Delta Attention (KDA) prefill for JAX.

GPU kernels (CuTe DSL, compiled ahead of time, called through XLA FFI) where built and running on
CUDA, and a pure-JAX chunkwise reference that runs anywhere and mirrors the kernels' numerics.
"""

from . import export
from .api import KdaInferenceOnlyError, KernelsUnavailableError, kda_prefill
from .export import disabled_safety_checks
from .sharding import kda_prefill_sharded

__version__ = "0.1.0"
__all__ = [
    "KdaInferenceOnlyError",
    "KernelsUnavailableError",
    "__version__",
    "disabled_safety_checks",
    "export",
    "kda_prefill",
    "kda_prefill_sharded",
]
