"""Byte layout of one prepare-workspace record (docs/kernel_abi.md), in numpy.

Pure numpy (no cutlass import): the kernels import the offsets from here, and
tests / GPU checks use encode/decode to read a workspace produced on the GPU
and compare it with the reference's prepare output.

Record (13,824 bytes, one per (head, slot)):
  0     kd   bf16 [16, 128] swizzled rows
  4096  qd   bf16 [16, 128] swizzled rows
  8192  kr   bf16 [16, 128] swizzled rows
  12288 gt   f32  [128]
  12800 INV  bf16 [16, 16] row-major
  13312 Mqk  bf16 [16, 16] row-major
Swizzled rows: element (r, c) at element offset r*128 + ((c//8) ^ (r%8))*8 + c%8.
bf16 arrays are handled as their uint16 bit patterns (numpy has no bfloat16).

The fp32 numerics mode's record (23,040 bytes, docs/fp32_mode.md section 3, offsets in
contract.FP32_RECORD): kd_hi, qd_hi, kr_hi, qd_lo, kr_lo as swizzled bf16 [16, 128] tiles, gt f32
[128], inv_hi, inv_lo, mqk_hi, mqk_lo bf16 [16, 16] row-major; `decode_fp32_records`,
`encode_fp32_records` and `decode_fp32_workspace` read and write it.
"""

from __future__ import annotations

import numpy as np

from ..contract import (
    CHUNK,
    FP32_RECORD,
    FP32_RECORD_BYTES,
    GT_OFFSET,
    INV_OFFSET,
    KD_OFFSET,
    KR_OFFSET,
    MQK_OFFSET,
    QD_OFFSET,
    RECORD_BYTES,
)
from ..contract import HEAD_DIM as D

_TILES = {"kd": KD_OFFSET, "qd": QD_OFFSET, "kr": KR_OFFSET}
_SMALL = {"inv": INV_OFFSET, "mqk": MQK_OFFSET}
_FP32_TILES = {n: FP32_RECORD[n] for n in ("kd_hi", "qd_hi", "qd_lo", "kr_hi", "kr_lo")}
_FP32_SMALL = {n: FP32_RECORD[n] for n in ("inv_hi", "inv_lo", "mqk_hi", "mqk_lo")}


def swizzle_index() -> np.ndarray:
    """int [16, 128]: element offset of logical (r, c) inside a swizzled tile."""
    r = np.arange(CHUNK)[:, None]
    c = np.arange(D)[None, :]
    return r * D + (((c // 8) ^ (r % 8)) * 8) + c % 8


class _Layout:
    """Where a record's fields sit: swizzled [16, 128] bf16 tiles, the f32 gt [128], row-major
    [16, 16] bf16 blocks (byte offsets), and the record size."""

    def __init__(self, tiles: dict, gt: int, small: dict, record_bytes: int):
        self.tiles, self.gt, self.small, self.record_bytes = tiles, gt, small, record_bytes


_FLASHKDA = _Layout(_TILES, GT_OFFSET, _SMALL, RECORD_BYTES)
_FP32 = _Layout(_FP32_TILES, FP32_RECORD["gt"], _FP32_SMALL, FP32_RECORD_BYTES)


def _decode(records: np.ndarray, layout: _Layout) -> dict[str, np.ndarray]:
    records = np.ascontiguousarray(records, dtype=np.uint8)
    if records.shape[-1] != layout.record_bytes:
        raise ValueError(f"last dim must be {layout.record_bytes} bytes, got {records.shape}")
    lead = records.shape[:-1]
    out: dict[str, np.ndarray] = {}
    idx = swizzle_index()
    for name, off in layout.tiles.items():
        flat = records[..., off : off + CHUNK * D * 2].view(np.uint16)
        out[name] = np.ascontiguousarray(flat[..., idx])
    gt = records[..., layout.gt : layout.gt + D * 4].view(np.float32)
    out["gt"] = np.ascontiguousarray(gt).reshape(*lead, D)
    for name, off in layout.small.items():
        blk = records[..., off : off + CHUNK * CHUNK * 2].view(np.uint16)
        out[name] = np.ascontiguousarray(blk).reshape(*lead, CHUNK, CHUNK)
    return out


def _encode(fields: dict[str, np.ndarray], layout: _Layout) -> np.ndarray:
    lead = np.asarray(fields["gt"]).shape[:-1]
    rec = np.zeros((*lead, layout.record_bytes), np.uint8)
    idx = swizzle_index()
    for name, off in layout.tiles.items():
        tile = np.asarray(fields[name], np.uint16).reshape(*lead, CHUNK, D)
        flat = np.zeros((*lead, CHUNK * D), np.uint16)
        flat[..., idx] = tile
        rec[..., off : off + CHUNK * D * 2] = flat.view(np.uint8)
    rec[..., layout.gt : layout.gt + D * 4] = (
        np.asarray(fields["gt"], np.float32).reshape(*lead, D).view(np.uint8)
    )
    for name, off in layout.small.items():
        blk = np.asarray(fields[name], np.uint16).reshape(*lead, CHUNK * CHUNK)
        rec[..., off : off + CHUNK * CHUNK * 2] = blk.view(np.uint8)
    return rec


def _decode_workspace(ws, cu_seqlens, decode) -> dict[str, np.ndarray]:
    slots = chunk_slots(cu_seqlens)
    idx = np.array([s for _, _, s in slots], np.int64)
    out = decode(np.asarray(ws)[:, idx])
    out["seq"] = np.array([n for n, _, _ in slots], np.int64)
    out["chunk"] = np.array([j for _, j, _ in slots], np.int64)
    return out


def decode_records(records: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [..., 13824] -> dict of arrays with the leading dims kept.

    kd, qd, kr: uint16 bf16 bits [..., 16, 128] (logical order, unswizzled);
    gt: float32 [..., 128]; inv, mqk: uint16 bf16 bits [..., 16, 16].
    """
    return _decode(records, _FLASHKDA)


def encode_records(fields: dict[str, np.ndarray]) -> np.ndarray:
    """Inverse of decode_records (bytes not covered by a field stay zero: there are none)."""
    return _encode(fields, _FLASHKDA)


def chunk_slots(cu_seqlens: np.ndarray) -> list[tuple[int, int, int]]:
    """(sequence, chunk, slot) for every chunk: slot = cu[n] // 16 + n + j."""
    cu = np.asarray(cu_seqlens, np.int64)
    out = []
    for n in range(len(cu) - 1):
        length = max(int(cu[n + 1] - cu[n]), 0)
        for j in range((length + CHUNK - 1) // CHUNK):
            out.append((n, j, int(cu[n]) // CHUNK + n + j))
    return out


def decode_workspace(ws: np.ndarray, cu_seqlens: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [H, S, 13824] -> per-chunk arrays [H, num_chunks, ...] in (sequence, chunk) order.

    Also returns "seq" and "chunk" (int [num_chunks]) naming each chunk.
    """
    return _decode_workspace(ws, cu_seqlens, decode_records)


# ----------------------------------------------------------------------------- fp32 mode record
def decode_fp32_records(records: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [..., 23040] (fp32 mode) -> dict of arrays with the leading dims kept.

    kd_hi, qd_hi, qd_lo, kr_hi, kr_lo: uint16 bf16 bits [..., 16, 128] (logical order,
    unswizzled); gt: float32 [..., 128]; inv_hi, inv_lo, mqk_hi, mqk_lo: uint16 bf16 bits
    [..., 16, 16].
    """
    return _decode(records, _FP32)


def encode_fp32_records(fields: dict[str, np.ndarray]) -> np.ndarray:
    """Inverse of decode_fp32_records (the fields cover every byte of the record)."""
    return _encode(fields, _FP32)


def decode_fp32_workspace(ws: np.ndarray, cu_seqlens: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [H, S, 23040] (fp32 mode) -> per-chunk arrays [H, num_chunks, ...] in (sequence,
    chunk) order, plus "seq" and "chunk" (int [num_chunks]) naming each chunk."""
    return _decode_workspace(ws, cu_seqlens, decode_fp32_records)
