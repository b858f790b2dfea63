"""Benchmark command for jax_kda: `python -m jax_kda.bench --help`.

Times the prepare kernel, the recurrence kernel per column split (block_v), both kernels through
`kda_prefill`, optionally the pure-JAX reference, and optionally fla's `chunk_kda` and FlashKDA
(through torch, when importable), side by side in one process. Writes JSON, CSV and a PNG plot.
"""

from .cli import main

__all__ = ["main"]
