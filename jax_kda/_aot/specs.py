"""Every kernel specialisation the package ships, and the names they are exported under.

Standalone (stdlib only) so that CMake can run it as a script at configure time:
`python specs.py` prints one export prefix per line.
"""

from __future__ import annotations

import dataclasses
import os

ARCHS = ("sm_90a", "sm_100a")
PREPARE_INVERSES = {"stable": 0, "neumann": 1}  # name -> attribute value (docs/kernel_abi.md)
RECURRENCE_BLOCK_VS = (16, 32, 64, 128)
# block_v attribute value of the baseline recurrence (one CTA per (sequence, head), state in shared
# memory); equal to jax_kda._checks.BASELINE_BLOCK_V (tested), repeated here to stay stdlib-only.
BASELINE_BLOCK_V = 0
# Kernels the package may be built without: when their source is not in the tree they are left
# out (the library then reports no such kernel at run time), even without JAX_KDA_AOT_ALLOW_MISSING.
OPTIONAL_KERNELS = ("recurrence_baseline",)
KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
ARCHS_ENV = "JAX_KDA_ARCHS"  # e.g. "sm_90a" to build one architecture only (faster local builds)


@dataclasses.dataclass(frozen=True)
class Spec:
    kernel: str  # "prepare" | "recurrence" | "recurrence_baseline" (module in jax_kda/kernels)
    variant: str | int  # inverse name for prepare, block_v for recurrence, "baseline"
    arch: str  # "sm_90a" | "sm_100a"

    @property
    def call(self) -> str:
        """The custom call that launches it: "prepare" or "recurrence" (docs/kernel_abi.md)."""
        return "prepare" if self.kernel == "prepare" else "recurrence"

    @property
    def variant_id(self) -> int:
        """The attribute value the custom call carries for this variant (inverse or block_v)."""
        if self.kernel == "prepare":
            return PREPARE_INVERSES[self.variant]
        if self.kernel == "recurrence_baseline":
            return BASELINE_BLOCK_V
        return int(self.variant)

    @property
    def sm(self) -> int:
        return int(self.arch.removeprefix("sm_").removesuffix("a"))

    @property
    def prefix(self) -> str:
        """C symbol prefix and file stem of the exported object, unique per specialisation."""
        tags = {"prepare": f"_{self.variant}", "recurrence": f"_bv{self.variant}"}
        return f"jax_kda_{self.kernel}{tags.get(self.kernel, '')}_{self.arch.replace('_', '')}"


def selected_archs() -> tuple[str, ...]:
    raw = os.environ.get(ARCHS_ENV, "").strip()
    if not raw:
        return ARCHS
    archs = tuple(a.strip() for a in raw.split(",") if a.strip())
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise ValueError(f"{ARCHS_ENV}={raw!r}: unknown architecture(s) {unknown}; known: {ARCHS}")
    return archs


def all_specs(archs: tuple[str, ...] | None = None) -> list[Spec]:
    archs = selected_archs() if archs is None else archs
    specs = []
    for arch in archs:
        specs += [Spec("prepare", inv, arch) for inv in PREPARE_INVERSES]
        specs += [Spec("recurrence", bv, arch) for bv in RECURRENCE_BLOCK_VS]
        specs.append(Spec("recurrence_baseline", "baseline", arch))
    return specs


def kernel_source_present(kernel: str, kernels_dir: str = KERNELS_DIR) -> bool:
    """Whether `kernel`'s CuTe DSL source is in `kernels_dir` (default: this package's, which a
    built package ships, so tests can tell which kernels its library must hold)."""
    return os.path.exists(os.path.join(kernels_dir, f"{kernel}.py"))


def present_specs(kernels_dir: str = KERNELS_DIR, archs: tuple[str, ...] | None = None) -> list[Spec]:
    """The specialisations whose kernel source exists in `kernels_dir` (partial builds)."""
    return [s for s in all_specs(archs) if kernel_source_present(s.kernel, kernels_dir)]


if __name__ == "__main__":
    import sys

    # `specs.py [KERNELS_DIR]`: with a directory, list only kernels whose source is there.
    chosen = present_specs(sys.argv[1]) if len(sys.argv) > 1 else all_specs()
    for spec in chosen:
        print(spec.prefix)
