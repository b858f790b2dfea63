"""Ahead-of-time build of the CuTe DSL kernels (runs at package build time, never at import).

`specs` names every specialisation; `build` compiles and exports them; `toolchain` locates the
headers and libraries CMake links against. Only `specs` may be imported without nvidia-cutlass-dsl.
"""
