"""Every kernel specialisation the package ships, and the names they are exported under.

Standalone (stdlib only) so that CMake can run it as a script at configure time:
`python specs.py` prints one export prefix per line.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

try:
    from .. import contract
except ImportError:  # run as a script by the build: the stdlib-only contract one folder up
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import contract

ARCHS_ENV = "JAX_KDA_ARCHS"  # e.g. "sm_90a" to build one architecture only (faster local builds)


@dataclasses.dataclass(frozen=True)
class Spec:
    # module in jax_kda/kernels: "prepare" | "recurrence" | "recurrence_baseline" | "decode" |
    # "prepare_fp32" | "recurrence_fp32" (the fp32 numerics mode's prefill kernels) |
    # "decode_fp32" (its fused decode) |
    # "state_chain" (the backward pass's serial chains)
    kernel: str
    # inverse name (prepare, decode), block_v (recurrence), None (baseline, state_chain)
    variant: str | int | None
    arch: str  # a key of contract.ARCHS
    # "bf16" | "f32": a state-pool kernel (the serving recurrence, the decode kernel); None: the
    # prefill kernels
    state_dtype: str | None = None
    intermediate: bool = False  # decode, decode_fp32: also writes the state after every token
    # prepare, prepare_fp32, decode, decode_fp32: q and k on fewer heads than the value heads
    # (grouped value heads; value head h reads query/key head h // (H // Hk))
    grouped: bool = False

    @property
    def call(self) -> str:
        """The custom call that launches it: "prepare", "recurrence", "recurrence_pool",
        "decode", "prepare_fp32", "recurrence_fp32", "recurrence_fp32_pool", "decode_fp32" or
        "state_chain"
        (docs/kernel_abi.md)."""
        if self.kernel == "recurrence" and self.state_dtype is not None:
            return "recurrence_pool"
        if self.kernel == "recurrence_fp32" and self.state_dtype is not None:
            return "recurrence_fp32_pool"
        if self.kernel == "recurrence_baseline":
            return "recurrence"
        return self.kernel

    @property
    def options(self) -> dict:
        """Keyword arguments of the kernel module's compile_kernel(arch=..., **options)."""
        if self.call in ("recurrence_pool", "recurrence_fp32_pool"):
            return {"block_v": self.variant, "state_dtype": self.state_dtype, "serving": True}
        if self.kernel == "decode":
            return {"inverse": self.variant, "state_dtype": self.state_dtype,
                    "intermediate": self.intermediate, "grouped": self.grouped}
        return {"prepare": {"inverse": self.variant, "grouped": self.grouped},
                "prepare_fp32": {"grouped": self.grouped},
                "decode_fp32": {"state_dtype": self.state_dtype,
                                "intermediate": self.intermediate, "grouped": self.grouped},
                "recurrence": {"block_v": self.variant},
                "recurrence_fp32": {"block_v": self.variant}}.get(self.kernel, {})

    @property
    def variant_id(self) -> int:
        """The attribute value the custom call carries for this variant (inverse or block_v)."""
        if self.kernel in ("prepare", "decode"):
            return contract.INVERSE_IDS[self.variant]
        if self.kernel in ("prepare_fp32", "decode_fp32"):  # one inverse: `inverse` = stable
            return contract.INVERSE_IDS["stable"]
        if self.kernel == "recurrence_baseline":
            return contract.BASELINE_BLOCK_V
        if self.kernel == "state_chain":  # one specialisation: both chains in one launch
            return 0
        return int(self.variant)

    @property
    def state_dtype_id(self) -> int:
        """contract.STATE_DTYPE_IDS of the pool's dtype (state-pool kernels only)."""
        return contract.STATE_DTYPE_IDS[self.state_dtype]

    @property
    def sm(self) -> int:
        return contract.arch_sm(self.arch)

    @property
    def prefix(self) -> str:
        """C symbol prefix and file stem of the exported object, unique per specialisation."""
        arch = self.arch.replace("_", "")
        if self.grouped:
            arch = f"grouped_{arch}"
        if self.call == "recurrence_pool":
            return f"jax_kda_recurrence_pool_{self.state_dtype}_bv{self.variant}_{arch}"
        if self.call == "recurrence_fp32_pool":
            return f"jax_kda_recurrence_fp32_pool_{self.state_dtype}_bv{self.variant}_{arch}"
        if self.kernel == "decode":
            states = "_states" if self.intermediate else ""
            return f"jax_kda_decode_{self.variant}_{self.state_dtype}{states}_{arch}"
        if self.kernel == "decode_fp32":
            states = "_states" if self.intermediate else ""
            return f"jax_kda_decode_fp32_{self.state_dtype}{states}_{arch}"
        tags = {"prepare": f"_{self.variant}", "recurrence": f"_bv{self.variant}",
                "recurrence_fp32": f"_bv{self.variant}"}
        return f"jax_kda_{self.kernel}{tags.get(self.kernel, '')}_{arch}"


def selected_archs() -> tuple[str, ...]:
    raw = os.environ.get(ARCHS_ENV, "").strip()
    if not raw:
        return tuple(contract.ARCHS)
    archs = tuple(a.strip() for a in raw.split(",") if a.strip())
    unknown = [a for a in archs if a not in contract.ARCHS]
    if unknown:
        raise ValueError(f"{ARCHS_ENV}={raw!r}: unknown architecture(s) {unknown}; "
                         f"known: {tuple(contract.ARCHS)}")
    return archs


def all_specs(archs: tuple[str, ...] | None = None) -> list[Spec]:
    archs = selected_archs() if archs is None else archs
    specs = []
    for arch in archs:
        specs += [Spec("prepare", inv, arch, grouped=grouped)
                  for grouped in (False, True) for inv in contract.INVERSE_IDS]
        specs += [Spec("recurrence", bv, arch) for bv in contract.COLUMN_SPLITS]
        specs.append(Spec("recurrence_baseline", None, arch))
        specs += [Spec("recurrence", bv, arch, state_dtype=dt)
                  for dt in contract.STATE_DTYPE_IDS for bv in contract.COLUMN_SPLITS]
        specs += [Spec("decode", inv, arch, state_dtype=dt, intermediate=states,
                       grouped=grouped)
                  for grouped in (False, True) for inv in contract.INVERSE_IDS
                  for dt in contract.STATE_DTYPE_IDS for states in (False, True)]
        specs += [Spec("prepare_fp32", None, arch, grouped=grouped) for grouped in (False, True)]
        specs += [Spec("recurrence_fp32", bv, arch) for bv in contract.COLUMN_SPLITS]
        specs += [Spec("recurrence_fp32", bv, arch, state_dtype=dt)
                  for dt in contract.STATE_DTYPE_IDS for bv in contract.COLUMN_SPLITS]
        specs += [Spec("decode_fp32", None, arch, state_dtype=dt, intermediate=states,
                       grouped=grouped)
                  for grouped in (False, True) for dt in contract.STATE_DTYPE_IDS
                  for states in (False, True)]
        specs.append(Spec("state_chain", None, arch))
    return specs


if __name__ == "__main__":
    for spec in all_specs():
        print(spec.prefix)
