"""The jax_kda variants a benchmark can time: each turns a case's inputs into (fn, args)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .cases import Case

TRAINING_KINDS = ("train", "backward")  # forward + backward, the backward alone: bench/training.py
KINDS = ("prepare", "recurrence", "total", "reference") + TRAINING_KINDS
AUTO = "auto"  # Variant.block_v: the launch heuristic's choice (kda_prefill(recurrence="auto"))
BASELINE = "baseline"  # Variant.block_v: the baseline recurrence kernel (one CTA per head)
FLASHKDA = "flashkda"  # Variant.numerics of the default mode: its names carry no mode tag


class VariantUnavailable(RuntimeError):
    """The variant cannot run here (no kernels, no GPU); the benchmark records why and goes on."""


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str  # prepare | recurrence | total | reference | decode kinds | fla | flashkda | jla
    # kda_prefill(recurrence=...): value columns per CTA, AUTO or BASELINE (the baseline kernel)
    block_v: int | str | None = None
    numerics: str = FLASHKDA  # the jax_kda numerics mode (contract.NUMERICS) it runs
    # kda_prefill(sequence_parallel=segments): an int or "auto" (total, fp32 only; None: "off")
    segments: int | str | None = None

    @property
    def name(self) -> str:
        """e.g. total:bv=auto, and total:fp32:bv=auto in another mode: the default mode's names
        are those of results written before the modes existed."""
        parts = [self.kind]
        if self.numerics != FLASHKDA:
            parts.append(self.numerics)
        if self.block_v is not None:
            parts.append(f"bv={self.block_v}")
        if self.segments is not None:
            parts.append(f"sp={self.segments}")
        return ":".join(parts)

    @property
    def uses_kernels(self) -> bool:
        return self.kind in ("prepare", "recurrence", "total")


def kernels_status() -> tuple[bool, str]:
    """(available, why not) for jax_kda's GPU kernels on this process's default device."""
    import jax

    from .. import _ffi

    if not _ffi.kernels_available():
        return False, f"kernels unavailable: {_ffi.unavailable_reason()}"
    if jax.default_backend() != "gpu":
        return False, f"no CUDA GPU (JAX default backend is {jax.default_backend()})"
    return True, ""


def prefill_options(case: Case, inverse: str) -> dict:
    """kda_prefill's scale, lower_bound and inverse in every timed case."""
    return {"scale": 128**-0.5, "lower_bound": -5.0, "inverse": inverse}


def sequence_kwargs(case: Case, x: dict) -> dict:
    """cu_seqlens for a packed (varlen) case, nothing for a batched one."""
    return {"cu_seqlens": x["cu_seqlens"]} if case.layout == "varlen" else {}


def _packed(a):
    """[B, T, ...] -> [1, B*T, ...]: every case as packed sequences (docs/kernel_abi.md)."""
    return a.reshape((1, a.shape[0] * a.shape[1]) + a.shape[2:])


def _scalars(opts: dict) -> dict:
    return {"scale": opts["scale"], "lower_bound": opts["lower_bound"]}


def zero_times(x):
    """0 * one element of x, in f32: a value XLA must compute (0 * inf is not 0), so whatever takes
    it depends on x at the cost of a tiny fusion."""
    import jax.numpy as jnp

    return 0.0 * x.reshape(-1)[0].astype(jnp.float32)


def _state_feedback(args, outs):
    """For the kernels behind fn(q, k, v, g, beta, A_log, dt_bias, state) -> (out, final_state):
    the next call starts from this call's final state (as chunked prefill does), and A_log
    depends on it too, so the state-independent prepare step cannot be merged away. The custom
    calls keep `out` alive themselves."""
    q, k, v, g, beta, A_log, dt_bias, _ = args
    _, final_state = outs
    return q, k, v, g, beta, A_log + zero_times(final_state), dt_bias, final_state


def _reference_feedback(args, outs):
    """As _state_feedback, plus a dependency on every output element: XLA would otherwise drop
    (or slice away) the reference's output computation, which nothing else uses."""
    import jax.numpy as jnp

    q, k, v, g, beta, A_log, dt_bias, state = _state_feedback(args, outs)
    return q, k, v, g, beta, A_log + 0.0 * jnp.sum(outs[0].astype(jnp.float32)), dt_bias, state


def _prepare_feedback(args, workspace):
    q, k, g, beta, A_log, dt_bias, cu = args
    return q, k, g, beta, A_log + zero_times(workspace), dt_bias, cu


def _recurrence_feedback(args, outs):
    v, beta, workspace, cu, _ = args
    return v, beta, workspace, cu, outs[1]  # the custom call keeps `out` alive itself


def compute_workspace(prepare, prepare_args):
    """The recurrence's input, computed once outside the timed program."""
    import jax

    return jax.block_until_ready(jax.jit(prepare)(*prepare_args))


def unavailable_reason(variant: Variant, inverse: str) -> str | None:
    """Why kda_prefill has no such variant (None: it has), known before any input is made: the
    option rules of jax_kda.options."""
    from .. import options

    try:
        options.check_numerics("kda_prefill", variant.numerics, inverse)
        if variant.block_v is not None:
            options.check_recurrence("kda_prefill", variant.block_v, numerics=variant.numerics,
                                     pooled=False, checkpoint_every=None)
    except ValueError as err:
        return str(err)
    return None


def _state_dtype(variant: Variant):
    """The state a variant chains: bf16 in the flashkda mode, f32 in the fp32 mode, so that the
    fp32 recurrence's f32 state path is what is timed (not a bf16 state widened on every call)."""
    import jax.numpy as jnp

    return jnp.float32 if variant.numerics == "fp32" else jnp.bfloat16


def _initial_state(variant: Variant, x: dict):
    """The case's initial state (bf16 in x) in the variant's state dtype; a copy only if it
    differs."""
    dtype = _state_dtype(variant)
    return x["state"] if x["state"].dtype == dtype else x["state"].astype(dtype)


def build(variant: Variant, case: Case, x: dict, *, inverse: str):
    """(fn, args, feedback, info): fn(*args) runs the variant once on the case's (jax) inputs x;
    feedback(args, outputs) gives the next call's args (see timing.py); info holds what the
    variant resolved (the block_v that "auto" picked; "baseline" for the baseline kernel)."""
    import jax.numpy as jnp

    from .. import kda_prefill

    if variant.kind in TRAINING_KINDS:
        from . import training

        return training.build(variant, case, x, inverse=inverse)
    why_not = unavailable_reason(variant, inverse)
    if why_not:
        raise VariantUnavailable(why_not)
    opts = prefill_options(case, inverse)
    extra = sequence_kwargs(case, x)
    state = _initial_state(variant, x)
    gate_args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], state)
    numerics = variant.numerics

    if variant.kind == "reference":
        def reference(q, k, v, g, beta, A_log, dt_bias, state):
            return kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                               output_final_state=True, backend="reference", numerics=numerics,
                               **opts, **extra)
        return reference, gate_args, _reference_feedback, {}

    ok, why = kernels_status()
    if not ok:
        raise VariantUnavailable(why)
    from .. import _kernel_path, _launch
    from ..problem import Problem

    launch = _launch.resolve(variant.block_v or AUTO, num_seqs=case.num_seqs, heads=case.heads,
                             numerics=variant.numerics, tokens=case.tokens,
                             baseline_allowed=True)  # plain prefill, as kda_prefill resolves it
    info = {"block_v_used": launch}
    cu = jnp.asarray(case.cu_seqlens(), jnp.int32)  # the packed view of batched inputs too
    # The packed view as the kernel path sees it: B = 1, T = every token, N sequences.
    packed = Problem(batch=1, seqlen=case.tokens, heads=case.heads, num_seqs=case.num_seqs,
                     varlen=True, state_dtype=np.dtype(_state_dtype(variant)),
                     numerics=numerics, inverse=inverse, **_scalars(opts))

    if variant.kind == "total":
        # fp32: serial unless the variant names segments (an int or "auto")
        split = {} if numerics == FLASHKDA else {
            "sequence_parallel": "off" if variant.segments is None else variant.segments}

        def total(q, k, v, g, beta, A_log, dt_bias, state):
            return kda_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state=state,
                               output_final_state=True, backend="kernel", numerics=numerics,
                               recurrence=launch, **opts, **extra, **split)
        return total, gate_args, _state_feedback, info

    def prepare(q, k, g, beta, A_log, dt_bias, cu):
        return _kernel_path.prepare_workspace(_packed(q), _packed(k), _packed(g), _packed(beta),
                                              A_log, dt_bias, cu, problem=packed)

    prepare_args = (x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], cu)
    if variant.kind == "prepare":
        return prepare, prepare_args, _prepare_feedback, {}

    if variant.kind == "recurrence":
        workspace = compute_workspace(prepare, prepare_args)

        def recurrence(v, beta, workspace, cu, state):
            return _kernel_path.plain_recurrence(_packed(v), _packed(beta), workspace, cu, state,
                                                 problem=packed, launch=launch)
        return recurrence, (x["v"], x["beta"], workspace, cu, state), _recurrence_feedback, info

    raise ValueError(f"unknown variant kind {variant.kind!r}")
