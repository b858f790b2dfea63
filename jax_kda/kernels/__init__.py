"""CuTe DSL kernel sources (build time only).

The kernel modules (prepare.py, prepare_fp32.py, recurrence.py, recurrence_fp32.py,
recurrence_baseline.py, decode.py) and what they share (prepare_common.py,
recurrence_common.py, ptx.py, compile_utils.py) import nvidia-cutlass-dsl and are used only by
the ahead-of-time build and its tests. This package's __init__ imports nothing, so
`import jax_kda` and the pure-numpy helper `jax_kda.kernels.workspace_layout` never need
cutlass.
"""
