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
ARCHS_ENV = "JAX_KDA_ARCHS"  # e.g. "sm_90a" to build one architecture only (faster local builds)


@dataclasses.dataclass(frozen=True)
class Spec:
    kernel: str  # "prepare" | "recurrence"
    variant: str | int  # inverse name for prepare, block_v for recurrence
    arch: str  # "sm_90a" | "sm_100a"

    @property
    def variant_id(self) -> int:
        """The attribute value the custom call carries for this variant."""
        if self.kernel == "prepare":
            return PREPARE_INVERSES[self.variant]
        return int(self.variant)

    @property
    def sm(self) -> int:
        return int(self.arch.removeprefix("sm_").removesuffix("a"))

    @property
    def prefix(self) -> str:
        """C symbol prefix and file stem of the exported object, unique per specialisation."""
        tag = self.variant if self.kernel == "prepare" else f"bv{self.variant}"
        return f"jax_kda_{self.kernel}_{tag}_{self.arch.replace('_', '')}"


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
    return specs


def present_specs(kernels_dir: str) -> list[Spec]:
    """The specialisations whose kernel source exists in `kernels_dir` (partial builds)."""
    return [s for s in all_specs() if os.path.exists(os.path.join(kernels_dir, f"{s.kernel}.py"))]


if __name__ == "__main__":
    import sys

    # `specs.py [KERNELS_DIR]`: with a directory, list only kernels whose source is there.
    chosen = present_specs(sys.argv[1]) if len(sys.argv) > 1 else all_specs()
    for spec in chosen:
        print(spec.prefix)
