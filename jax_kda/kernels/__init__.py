"""CuTe DSL kernel sources (build time only).

The modules here that define kernels (prepare.py, recurrence.py, common.py, ...) import
nvidia-cutlass-dsl and are used only by the ahead-of-time build and its tests. This
package's __init__ imports nothing, so `import jax_kda` and the pure-numpy helper
`jax_kda.kernels.workspace_layout` never need cutlass.
"""
