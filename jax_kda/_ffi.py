"""The FFI library: find it, load it, register its custom calls, and call them.

libjax_kda_ffi.so (built by ffi/CMakeLists.txt during `pip install`) holds the C++ handlers and
every kernel specialisation. This module never imports CuTe DSL. Loading and registration happen
once, when this module is first imported; `kernels_available()` says whether they succeeded and
`unavailable_reason()` why not. The wrappers take the flat varlen layout of docs/kernel_abi.md
([T_total, H, 128] etc.); kda_prefill reshapes batched inputs into it.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import sys
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import contract

HEAD_DIM = contract.HEAD_DIM

LIBRARY_NAME = "libjax_kda_ffi.so"
LIBRARY_ENV = "JAX_KDA_FFI_LIBRARY"  # explicit path, overrides the search below
# Stage -> exported handler symbol. Modules are loaded per device at instantiate (compile time)
# and initialize; execute only launches, so it is safe under CUDA-graph capture.
_HANDLER_NAMES = {  # custom-call target -> exported handler name (+ stage)
    contract.PREPARE_TARGET: "JaxKdaPrepareV1",
    contract.RECURRENCE_TARGET: "JaxKdaRecurrenceV1",
    contract.RECURRENCE_POOL_TARGET: "JaxKdaRecurrencePoolV1",
    contract.DECODE_TARGET: "JaxKdaDecodeV1",
    contract.PREPARE_FP32_TARGET: "JaxKdaPrepareFp32V1",
    contract.RECURRENCE_FP32_TARGET: "JaxKdaRecurrenceFp32V1",
    contract.RECURRENCE_FP32_POOL_TARGET: "JaxKdaRecurrenceFp32PoolV1",
    contract.DECODE_FP32_TARGET: "JaxKdaDecodeFp32V1",
    contract.STATE_CHAIN_TARGET: "JaxKdaStateChainsV1",
}
_HANDLER_SYMBOLS = {
    target: {stage: name + stage.capitalize() for stage in ("instantiate", "initialize", "execute")}
    for target, name in _HANDLER_NAMES.items()
}
# numerics mode -> (prepare target, recurrence target, workspace record bytes, state dtype)
_PREFILL_CALLS = {
    "flashkda": (contract.PREPARE_TARGET, contract.RECURRENCE_TARGET,
                 contract.record_bytes("flashkda"), jnp.bfloat16),
    "fp32": (contract.PREPARE_FP32_TARGET, contract.RECURRENCE_FP32_TARGET,
             contract.record_bytes("fp32"), jnp.float32),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_library_path: pathlib.Path | None = None
_reason = "not loaded yet"
_registered = False


def _candidate_paths() -> list[pathlib.Path]:
    """The env override, the package's own _lib/, then jax_kda/_lib/ on sys.path (editable installs
    keep built files in site-packages while this file stays in the source tree)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return [pathlib.Path(override)]
    here = pathlib.Path(__file__).resolve().parent / "_lib" / LIBRARY_NAME
    others = [pathlib.Path(p) / "jax_kda" / "_lib" / LIBRARY_NAME for p in sys.path if p]
    return list(dict.fromkeys([here, *others]))


def library_path() -> pathlib.Path | None:
    """Where the library was loaded from (None when it was not)."""
    _ensure_registered()
    return _library_path


def _load() -> None:
    global _library, _library_path, _reason
    candidates = _candidate_paths()
    found = [p for p in candidates if p.is_file()]
    if not found:
        _reason = (
            f"{LIBRARY_NAME} is not installed "
            f"(looked in {', '.join(str(p.parent) for p in candidates[:3])}"
            f"{', ...' if len(candidates) > 3 else ''}); the package was built without kernels "
            "(JAX_KDA_BUILD_KERNELS=0) or from a source tree without a build"
        )
        return
    try:
        library = ctypes.CDLL(str(found[0]))
    except OSError as error:
        _reason = f"cannot load {found[0]}: {error}"
        return
    library.jax_kda_ffi_abi_version.restype = ctypes.c_int
    version = library.jax_kda_ffi_abi_version()
    if version != contract.ABI_VERSION:
        _reason = (f"{found[0]} implements kernel ABI v{version}, this jax_kda expects "
                   f"v{contract.ABI_VERSION}")
        return
    _library, _library_path = library, found[0]


def _register() -> None:
    """Registers both targets for CUDA; repeated calls (and re-imports) do nothing."""
    global _registered, _reason
    for target, stages in _HANDLER_SYMBOLS.items():
        bundle = {stage: jax.ffi.pycapsule(getattr(_library, symbol))
                  for stage, symbol in stages.items()}
        jax.ffi.register_ffi_target(target, bundle, platform="CUDA")
    _registered = True
    _reason = ""


def _ensure_registered() -> None:
    with _lock:
        if _registered or _reason != "not loaded yet":
            return
        _load()
        if _library is not None:
            _register()


def kernels_available() -> bool:
    """True when the FFI library is present, loadable, of this ABI, and its targets registered."""
    _ensure_registered()
    return _registered


def unavailable_reason() -> str:
    """Why kernels_available() is False ("" when it is True)."""
    _ensure_registered()
    return _reason


def built_kernels() -> list[str]:
    """Names of the specialisations inside the library, e.g. jax_kda_recurrence_bv32_sm90a."""
    if not kernels_available():
        return []
    _library.jax_kda_ffi_kernels.restype = ctypes.c_char_p
    names = _library.jax_kda_ffi_kernels().decode()
    return names.split(",") if names else []


def device_supported(device) -> bool:
    """Whether the library has kernels for this JAX device (contract.ARCHS). The 'a'
    architectures are not forward compatible, so e.g. sm_103 or sm_120 are not."""
    return (
        getattr(device, "platform", None) == "gpu"
        and getattr(device, "compute_capability", None)
        in contract.supported_compute_capabilities()
    )


def visible_gpus() -> list:
    """The CUDA devices JAX sees ([] on a CPU-only install)."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def kernel_gpus() -> list:
    """The visible CUDA devices the built kernels run on ([] when the library is unavailable)."""
    if not kernels_available():
        return []
    return [d for d in visible_gpus() if device_supported(d)]


def kernels_usable_for_auto() -> bool:
    """Whether backend="auto" lowers the kernels for the CUDA platform: the library is loaded,
    and the visible GPUs include one it has kernels for (with an A100 alone "auto" runs the
    reference there). With no GPU visible (lowering for CUDA on a CPU host, for export), the
    kernels are kept for the CUDA platform."""
    return kernels_available() and (not visible_gpus() or bool(kernel_gpus()))


def _expect(name, x, dtype, shape) -> None:
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype).name}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")


def _prefill_calls(numerics: str):
    if numerics not in _PREFILL_CALLS:
        raise ValueError(f"numerics: expected one of {contract.NUMERICS}, got {numerics!r}")
    return _PREFILL_CALLS[numerics]


def _checked_cu_seqlens(cu_seqlens):
    """cu_seqlens as int32 [N+1], N >= 1 (checked)."""
    cu_seqlens = jnp.asarray(cu_seqlens).astype(jnp.int32)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected [N+1] with N >= 1, got shape {cu_seqlens.shape}")
    return cu_seqlens


def _value_heads(q, value, axis: int) -> int:
    """H, the head count of `value` (g or v) on `axis`: a positive multiple of q's, Hk (grouped
    value heads: value head h reads query/key head h // (H // Hk); H = Hk: not grouped)."""
    if value.ndim <= axis:
        raise ValueError(f"expected the value heads on axis {axis}, got shape {tuple(value.shape)}")
    qk_heads, heads = q.shape[axis], value.shape[axis]
    if heads < 1 or qk_heads < 1 or heads % qk_heads:
        raise ValueError(f"the {heads} value heads must be a positive multiple of the "
                         f"{qk_heads} heads of q and k")
    return heads


def _check_prepare_operands(q, k, g, beta, A_log, dt_bias, cu_seqlens, inverse, numerics):
    """The prepare step's operands and `inverse` (checked); returns cu_seqlens as int32."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [T_total, Hk, 128], got shape {tuple(q.shape)}")
    if inverse not in contract.INVERSE_IDS:
        raise ValueError(
            f"inverse: expected one of {sorted(contract.INVERSE_IDS)}, got {inverse!r}")
    assert numerics == "flashkda" or inverse == "stable"  # jax_kda.options
    total, qk_heads = q.shape[0], q.shape[1]
    heads = _value_heads(q, g, 1)
    cu_seqlens = _checked_cu_seqlens(cu_seqlens)
    for name, x in (("q", q), ("k", k)):
        _expect(name, x, jnp.bfloat16, (total, qk_heads, HEAD_DIM))
    _expect("g", g, jnp.bfloat16, (total, heads, HEAD_DIM))
    _expect("beta", beta, jnp.bfloat16, (total, heads))
    _expect("A_log", A_log, jnp.float32, (heads,))
    _expect("dt_bias", dt_bias, jnp.float32, (heads, HEAD_DIM))
    return cu_seqlens


def prepare_call(q, k, g, beta, A_log, dt_bias, cu_seqlens, *, scale, lower_bound, inverse,
                 numerics="flashkda"):
    """Custom call 1: per-chunk precomputation into the workspace uint8 [H, S, record bytes]
    (13,824 in the flashkda mode, 23,040 in the fp32 mode). q and k [T_total, Hk, 128], g, beta,
    A_log, dt_bias on H heads, a multiple of Hk (grouped value heads)."""
    target, _, record_bytes, _ = _prefill_calls(numerics)
    cu_seqlens = _check_prepare_operands(q, k, g, beta, A_log, dt_bias, cu_seqlens, inverse,
                                         numerics)
    total, heads = g.shape[0], g.shape[1]
    slots = contract.workspace_slots(total, cu_seqlens.shape[0] - 1)
    workspace = jax.ShapeDtypeStruct((heads, slots, record_bytes), jnp.uint8)
    call = jax.ffi.ffi_call(target, workspace)
    # Attributes must be numpy 32-bit scalars: Python scalars lower as 64-bit and fail to decode.
    return call(q, k, g, beta, A_log, dt_bias, cu_seqlens, scale=np.float32(scale),
                lower_bound=np.float32(lower_bound),
                inverse=np.int32(contract.INVERSE_IDS[inverse]))


def block_v_attribute(launch) -> int:
    """The recurrence custom call's `block_v` attribute for a resolved launch (jax_kda._launch):
    the column split, or contract.BASELINE_BLOCK_V for "baseline" (docs/kernel_abi.md)."""
    if launch == "baseline":
        return contract.BASELINE_BLOCK_V
    if isinstance(launch, bool) or launch not in contract.COLUMN_SPLITS:
        raise ValueError(f"launch: expected 'baseline' or one of {contract.COLUMN_SPLITS}, "
                         f"got {launch!r}")
    return int(launch)


def recurrence_call(v, beta, workspace, cu_seqlens, state0, *, launch, alias_state=True,
                    numerics="flashkda"):
    """Custom call 2: the chunk recurrence. Returns (out bf16 [T_total, H, 128],
    final_state [N, H, 128, 128]: bf16 in the flashkda mode, f32 in the fp32 mode, the dtype
    state0 must have); same bits for every launch. With alias_state the final state is written
    into state0's buffer (XLA copies first unless the caller donated it)."""
    _, target, record_bytes, state_dtype = _prefill_calls(numerics)
    if v.ndim != 3:
        raise ValueError(f"v: expected [T_total, H, 128], got shape {tuple(v.shape)}")
    block_v = block_v_attribute(launch)
    assert numerics == "flashkda" or block_v != contract.BASELINE_BLOCK_V  # jax_kda.options
    total, heads = v.shape[0], v.shape[1]
    cu_seqlens = _checked_cu_seqlens(cu_seqlens)
    num_seqs = cu_seqlens.shape[0] - 1
    _expect("v", v, jnp.bfloat16, (total, heads, HEAD_DIM))
    _expect("beta", beta, jnp.bfloat16, (total, heads))
    _expect("workspace", workspace, jnp.uint8,
            (heads, contract.workspace_slots(total, num_seqs), record_bytes))
    _expect("initial_state", state0, state_dtype, (num_seqs, heads, HEAD_DIM, HEAD_DIM))
    results = (
        jax.ShapeDtypeStruct(v.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(state0.shape, state_dtype),
    )
    call = jax.ffi.ffi_call(target, results,
                            input_output_aliases={4: 1} if alias_state else None)
    return call(v, beta, workspace, cu_seqlens, state0, block_v=np.int32(block_v))


def _check_pool(pool, state_indices, num_seqs: int, heads: int) -> None:
    if pool.dtype not in (jnp.bfloat16, jnp.float32):
        raise TypeError(f"pool: expected dtype bfloat16 or float32, got {pool.dtype}")
    if pool.ndim != 4 or tuple(pool.shape[1:]) != (heads, HEAD_DIM, HEAD_DIM):
        raise ValueError(f"pool: expected [P, {heads}, 128, 128], got shape {tuple(pool.shape)}")
    _expect("state_indices", state_indices, jnp.int32, (num_seqs,))


_POOL_TARGETS = {"flashkda": contract.RECURRENCE_POOL_TARGET,
                 "fp32": contract.RECURRENCE_FP32_POOL_TARGET}


def recurrence_pool_call(v, beta, workspace, cu_seqlens, state_indices, checkpoint_offsets, pool,
                         checkpoints, *, launch, checkpoint_every, numerics="flashkda"):
    """The chunk recurrence on a state pool (docs/kernel_abi.md): sequence n starts from
    pool[state_indices[n]] and writes its final state there (in place: the pool operand is
    aliased to the pool result); padding slots (index < 0 or >= P) are neither read nor
    written and get zero outputs. With checkpoint_every (tokens, a multiple of 16) the states
    after every that many tokens strictly before each sequence's end go to the rows
    checkpoint_offsets[n] + j of `checkpoints` (aliased too: rows nothing writes keep their
    values). numerics="fp32": the fp32 mode's kernel (its 23,040-byte records; the state stays
    f32 between reading and writing the pool). Returns (out bf16 [T_total, H, 128], pool,
    checkpoints)."""
    if v.ndim != 3:
        raise ValueError(f"v: expected [T_total, H, 128], got shape {tuple(v.shape)}")
    block_v = block_v_attribute(launch)
    assert block_v != contract.BASELINE_BLOCK_V  # pools run the column split (jax_kda.options)
    total, heads = v.shape[0], v.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    _expect("v", v, jnp.bfloat16, (total, heads, HEAD_DIM))
    _expect("beta", beta, jnp.bfloat16, (total, heads))
    _expect("workspace", workspace, jnp.uint8,
            (heads, contract.workspace_slots(total, num_seqs), contract.record_bytes(numerics)))
    _expect("cu_seqlens", cu_seqlens, jnp.int32, (num_seqs + 1,))
    _expect("checkpoint_offsets", checkpoint_offsets, jnp.int32, (num_seqs + 1,))
    _check_pool(pool, state_indices, num_seqs, heads)
    if checkpoints.dtype != pool.dtype or tuple(checkpoints.shape[1:]) != tuple(pool.shape[1:]):
        raise ValueError(f"checkpoints: expected [C, {heads}, 128, 128] of the pool's dtype, got "
                         f"{checkpoints.dtype} {tuple(checkpoints.shape)}")
    chunks = 0 if checkpoint_every is None else checkpoint_every // contract.CHUNK
    results = (
        jax.ShapeDtypeStruct(v.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        jax.ShapeDtypeStruct(checkpoints.shape, checkpoints.dtype),
    )
    call = jax.ffi.ffi_call(_POOL_TARGETS[numerics], results, input_output_aliases={6: 1, 7: 2})
    return call(v, beta, workspace, cu_seqlens, state_indices, checkpoint_offsets, pool,
                checkpoints, block_v=np.int32(block_v), checkpoint_chunks=np.int32(chunks))


_DECODE_TARGETS = {"flashkda": contract.DECODE_TARGET, "fp32": contract.DECODE_FP32_TARGET}


def decode_call(q, k, v, g, beta, A_log, dt_bias, state_indices, pool, *, scale, lower_bound,
                inverse, intermediate_states, numerics="flashkda"):
    """The fused decode step (docs/kernel_abi.md): prepare and one chunk for t <= 16 tokens per
    sequence, sequence n's state read from and written back to pool[state_indices[n]] (in
    place: aliased). q and k [N, t, Hk, 128], everything else on H heads, a multiple of Hk
    (grouped value heads). Returns (out bf16 [N, t, H, 128], pool, states [N, t, H, 128, 128] in
    the pool's dtype: the state after each token; an empty [0, t, H, 128, 128] array unless
    intermediate_states). numerics="fp32": the fp32 mode's kernel (inverse "stable" only)."""
    if q.ndim != 4:
        raise ValueError(f"q: expected [N, t, Hk, 128], got shape {tuple(q.shape)}")
    num_seqs, tokens, qk_heads = q.shape[:3]
    heads = _value_heads(q, v, 2)
    if not 1 <= tokens <= contract.MAX_DECODE_TOKENS:
        raise ValueError(f"q: expected 1 <= t <= {contract.MAX_DECODE_TOKENS}, got t = {tokens}")
    for name, x in (("q", q), ("k", k)):
        _expect(name, x, jnp.bfloat16, (num_seqs, tokens, qk_heads, HEAD_DIM))
    for name, x in (("v", v), ("g", g)):
        _expect(name, x, jnp.bfloat16, (num_seqs, tokens, heads, HEAD_DIM))
    _expect("beta", beta, jnp.bfloat16, (num_seqs, tokens, heads))
    _expect("A_log", A_log, jnp.float32, (heads,))
    _expect("dt_bias", dt_bias, jnp.float32, (heads, HEAD_DIM))
    _check_pool(pool, state_indices, num_seqs, heads)
    if inverse not in contract.INVERSE_IDS:
        raise ValueError(
            f"inverse: expected one of {sorted(contract.INVERSE_IDS)}, got {inverse!r}")
    if numerics not in _DECODE_TARGETS:
        raise ValueError(f"numerics: expected one of {sorted(_DECODE_TARGETS)}, got {numerics!r}")
    if numerics == "fp32" and inverse != "stable":
        raise ValueError(f"inverse: numerics='fp32' has the one inverse 'stable', got {inverse!r}")
    states = (num_seqs if intermediate_states else 0, tokens, heads, HEAD_DIM, HEAD_DIM)
    results = (
        jax.ShapeDtypeStruct(v.shape, jnp.bfloat16),
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        jax.ShapeDtypeStruct(states, pool.dtype),
    )
    call = jax.ffi.ffi_call(_DECODE_TARGETS[numerics], results, input_output_aliases={8: 1})
    return call(q, k, v, g, beta, A_log, dt_bias, state_indices, pool, scale=np.float32(scale),
                lower_bound=np.float32(lower_bound),
                inverse=np.int32(contract.INVERSE_IDS[inverse]),
                intermediate=np.int32(bool(intermediate_states)))


class ChainOperands(NamedTuple):
    """One chain's operands of the state-chains call: reset int32 [N, C] (a row of init, or -1),
    init [Ni, H, 128, 128], A [N, H, C, 16, 128], B and Y [N, H, C, R, 128], f32."""

    reset: jax.Array
    init: jax.Array
    A: jax.Array
    B: jax.Array
    Y: jax.Array


def state_chains_call(gamma, forward: ChainOperands, reverse: ChainOperands):
    """The backward pass's two state chains in one launch (docs/kernel_abi.md,
    jax_kda/kernels/state_chain.py): gamma f32 [N, H, C, 128] shared; the forward chain with
    R = contract.FORWARD_CHAIN_ROWS, the reverse one with contract.REVERSE_CHAIN_ROWS. Returns
    (states, z) of each chain: the state entering every chunk f32 [N, H, C, 128, 128] and Z's
    first 16 rows f32 [N, H, C, 16, 128]."""
    num_rows, heads, chunks = gamma.shape[:3]
    _expect("gamma", gamma, jnp.float32, (num_rows, heads, chunks, HEAD_DIM))
    for tag, ops, rows in (("f", forward, contract.FORWARD_CHAIN_ROWS),
                           ("r", reverse, contract.REVERSE_CHAIN_ROWS)):
        _expect(f"reset_{tag}", ops.reset, jnp.int32, (num_rows, chunks))
        _expect(f"init_{tag}", ops.init, jnp.float32,
                (ops.init.shape[0], heads, HEAD_DIM, HEAD_DIM))
        _expect(f"A_{tag}", ops.A, jnp.float32, (num_rows, heads, chunks, contract.CHUNK, HEAD_DIM))
        for name, x in (("B", ops.B), ("Y", ops.Y)):
            _expect(f"{name}_{tag}", x, jnp.float32, (num_rows, heads, chunks, rows, HEAD_DIM))
    states = jax.ShapeDtypeStruct((num_rows, heads, chunks, HEAD_DIM, HEAD_DIM), jnp.float32)
    z = jax.ShapeDtypeStruct((num_rows, heads, chunks, contract.CHUNK, HEAD_DIM), jnp.float32)
    call = jax.ffi.ffi_call(contract.STATE_CHAIN_TARGET, (states, z, states, z))
    states_f, z_f, states_r, z_r = call(
        forward.reset, forward.init, reverse.reset, reverse.init, gamma, forward.A, forward.B,
        forward.Y, reverse.A, reverse.B, reverse.Y)
    return (states_f, z_f), (states_r, z_r)


_ensure_registered()  # register at import; idempotent
