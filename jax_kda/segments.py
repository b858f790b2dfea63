"""Packed documents given as segment ids: kda_prefill(..., segment_ids=ids), the convention of
JAX attention kernels (MaxText, splash attention, tokamax). Here a segment is a document, not a
piece of jax_kda's sequence parallelism.

segment_ids is an integer array [B, T], one id per token. Within a row a run of equal ids is one
document; a change of id starts the next, and every row starts a new one (a row that ends and the
next that begins with the same id hold two documents). Documents are numbered in row-major order:
document 0 is the first of row 0, then the rest of row 0, then row 1, ... Nothing else about the
values matters, and there is no padding id: a padding run is one more document, computed like
any other (its outputs are what the math gives them; mask its loss).

kda_prefill runs the documents as packed sequences, converted on device: the token arrays
[B, T, ...] become [1, B*T, ...] (a free reshape), `cu_seqlens_from_segment_ids` gives the
documents' boundaries as a cu_seqlens of static length max_segments + 1 (entries past the last
document equal B*T: empty documents at the end), and the outputs are reshaped back to
[B, T, ...]. Every backend, the custom VJP (jax.grad) and the vmap
folding therefore see an ordinary packed call.

max_segments (static, required by kda_prefill) bounds the number of documents and fixes the
shapes; B*T always holds them (and is cu_seqlens_from_segment_ids' default). If the ids hold
more documents, the boundaries cover only the first max_segments (the last of those absorbs the
rest); kda_prefill raises when the ids are concrete
(an eager call with max_segments < B*T reads them on the host once to count, as it checks a
concrete cu_seqlens) and under jit, where nothing is read on the host, returns NaN outputs and
final states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import options


def document_starts(segment_ids):
    """bool [B, T]: True where a document starts (each row's first token and every change of
    id). numpy in, numpy out; anything else gives a JAX array."""
    xp = np if isinstance(segment_ids, np.ndarray) else jnp
    ids = xp.asarray(segment_ids)
    row_starts = xp.ones(ids.shape[:1] + (1,), bool)
    return xp.concatenate([row_starts, ids[:, 1:] != ids[:, :-1]], axis=1)


def cu_seqlens_from_segment_ids(segment_ids, max_segments=None):
    """The documents of `segment_ids` (integer [B, T]) as kda_prefill's packed sequences.

    Returns (cu_seqlens, num_documents): cu_seqlens int32 [max_segments + 1], the documents'
    first tokens in the flattened [B*T] order followed by B*T (the entries past the last document
    are B*T too: empty documents), and num_documents, an int32 scalar. max_segments: a static int
    >= 1, default B*T. If num_documents > max_segments, cu_seqlens holds the first max_segments
    documents and the last of them runs to B*T. Works under jit and vmap (no host read).
    """
    fn = "cu_seqlens_from_segment_ids"
    check_segment_ids(fn, segment_ids)
    if max_segments is None:
        max_segments = int(np.prod(segment_ids.shape))
    return packed_boundaries(segment_ids, options.check_max_segments(fn, max_segments))


def packed_boundaries(segment_ids, max_segments: int):
    """cu_seqlens_from_segment_ids on checked arguments."""
    starts = jnp.asarray(document_starts(segment_ids)).reshape(-1)
    total = starts.shape[0]
    (first_tokens,) = jnp.nonzero(starts, size=max_segments, fill_value=total)
    cu_seqlens = jnp.concatenate([first_tokens.astype(jnp.int32),
                                  jnp.full((1,), total, jnp.int32)])
    return cu_seqlens, jnp.sum(starts, dtype=jnp.int32)


def check_segment_ids(fn: str, segment_ids, shape: tuple[int, int] | None = None) -> None:
    """An integer array of rank 2 (of `shape`, q's [B, T], when given)."""
    if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
        raise TypeError(f"{fn}: segment_ids must be an array, got {type(segment_ids).__name__}")
    if not np.issubdtype(np.dtype(segment_ids.dtype), np.integer):
        raise TypeError(f"{fn}: segment_ids must have an integer dtype (one document id per "
                        f"token, e.g. int32), got {np.dtype(segment_ids.dtype).name}")
    got = tuple(segment_ids.shape)
    if shape is not None and got != tuple(shape):
        raise ValueError(f"{fn}: segment_ids must have shape [B, T] = {tuple(shape)} (q's first "
                         f"two axes), got {got}")
    if len(got) != 2 or min(got) < 1:
        raise ValueError(f"{fn}: segment_ids must have shape [B, T] with B, T >= 1, got {got}")


def check_document_count(fn: str, segment_ids, max_segments: int) -> None:
    """Raises when the ids are concrete (outside jit) and hold more than max_segments documents;
    under jit that cannot be known (kda_prefill's outputs are then NaN)."""
    if isinstance(segment_ids, jax.core.Tracer) or max_segments >= np.prod(segment_ids.shape):
        return
    count = int(np.count_nonzero(document_starts(np.asarray(segment_ids))))
    if count > max_segments:
        raise ValueError(
            f"{fn}: segment_ids hold {count} documents, more than max_segments = {max_segments} "
            "(under jit this cannot be checked, and the outputs and final states are NaN)")


def pack(x):
    """[B, T, ...] -> [1, B*T, ...]: the rows of a call one after the other."""
    return x.reshape((1, x.shape[0] * x.shape[1]) + x.shape[2:])


def unpack(out, final_state, num_documents, *, batch: int, seqlen: int, max_segments: int):
    """The packed call's out [1, B*T, H, 128] as [B, T, H, 128], and its final states; both NaN
    when the ids held more than max_segments documents (possible only below B*T)."""
    out = out.reshape((batch, seqlen) + out.shape[2:])
    if max_segments >= batch * seqlen:
        return out, final_state
    overflow = num_documents > max_segments
    poisoned = lambda x: jnp.where(overflow, jnp.asarray(jnp.nan, x.dtype), x)
    return poisoned(out), poisoned(final_state)
