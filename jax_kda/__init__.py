"""jax_kda: Kimi Delta Attention (KDA) prefill and decode for JAX.

GPU kernels (CuTe DSL, compiled ahead of time, called through XLA FFI) where built and running on
CUDA, and a pure-JAX chunkwise reference that runs anywhere and mirrors the kernels' numerics.
"""

from . import checkpoints, export, options, segments
from ._ffi import kernels_available, unavailable_reason
from ._vjp import KdaInferenceOnlyError
from .api import KernelsUnavailableError, kda_decode, kda_prefill
from .checkpoints import checkpoint_offsets
from .export import disabled_safety_checks
from .segments import cu_seqlens_from_segment_ids
from .sharding import kda_decode_sharded, kda_prefill_sharded

__version__ = "0.1.0"
__all__ = [
    "KdaInferenceOnlyError",
    "KernelsUnavailableError",
    "__version__",
    "checkpoint_offsets",
    "checkpoints",
    "cu_seqlens_from_segment_ids",
    "disabled_safety_checks",
    "export",
    "kda_decode",
    "kda_decode_sharded",
    "kda_prefill",
    "kda_prefill_sharded",
    "kernels_available",
    "options",
    "segments",
    "unavailable_reason",
]
