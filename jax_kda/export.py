"""jax.export of functions that call kda_prefill.

jax.export refuses custom calls it does not know to be stable. Ours are versioned (the `_v1` in
each target name changes whenever the ABI in docs/kernel_abi.md does), so exporting them is safe as
long as the machine that runs the artifact has a jax_kda with the same targets installed (importing
jax_kda registers them). Pass `disabled_safety_checks()` to jax.export.export, or use `export` here:

    exp = jax_kda.export.export(jax.jit(model), platforms=("cuda", "cpu"))(*avals)
    blob = exp.serialize()                      # needs the `flatbuffers` package
    out = jax.export.deserialize(blob).call(*args)   # on a CUDA device: the kernels;
                                                     # on CPU: the pure-JAX reference

With backend="auto" a multi-platform export holds both paths; the platform that runs it picks its
own (lax.platform_dependent). An export for ("cuda",) alone runs only on CUDA devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jax import export as jax_export

from .contract import CUSTOM_CALL_TARGETS


def disabled_safety_checks() -> list[jax_export.DisabledSafetyCheck]:
    """The jax.export safety checks to disable for jax_kda's custom calls (one per target)."""
    return [jax_export.DisabledSafetyCheck.custom_call(target) for target in CUSTOM_CALL_TARGETS]


def export(
    fun_jit, *, platforms: Sequence[str] | None = None,
    disabled_checks: Sequence[jax_export.DisabledSafetyCheck] = (),
) -> Callable[..., jax_export.Exported]:
    """jax.export.export with jax_kda's custom calls allowed; other arguments as there."""
    return jax_export.export(
        fun_jit, platforms=platforms,
        disabled_checks=[*disabled_safety_checks(), *disabled_checks],
    )
