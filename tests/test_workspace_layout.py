"""The prepare workspace record layout (jax_kda/kernels/workspace_layout.py): pure numpy."""

import numpy as np
import pytest

from jax_kda import contract
from jax_kda.kernels import workspace_layout as wl


def _random_fields(rng, lead):
    return {
        "kd": rng.integers(0, 2**16, (*lead, 16, 128), dtype=np.uint16),
        "qd": rng.integers(0, 2**16, (*lead, 16, 128), dtype=np.uint16),
        "kr": rng.integers(0, 2**16, (*lead, 16, 128), dtype=np.uint16),
        "gt": rng.standard_normal((*lead, 128)).astype(np.float32),
        "inv": rng.integers(0, 2**16, (*lead, 16, 16), dtype=np.uint16),
        "mqk": rng.integers(0, 2**16, (*lead, 16, 16), dtype=np.uint16),
    }


def test_offsets_tile_the_record():
    sizes = [
        ("kd", wl.KD_OFFSET, 4096),
        ("qd", wl.QD_OFFSET, 4096),
        ("kr", wl.KR_OFFSET, 4096),
        ("gt", wl.GT_OFFSET, 512),
        ("inv", wl.INV_OFFSET, 512),
        ("mqk", wl.MQK_OFFSET, 512),
    ]
    end = 0
    for _, off, size in sizes:
        assert off == end and off % 16 == 0
        end = off + size
    assert end == wl.RECORD_BYTES == 13824


def test_swizzle_is_a_permutation_within_each_row():
    idx = wl.swizzle_index()
    for r in range(16):
        assert sorted(idx[r] - r * 128) == list(range(128))
    # granules stay whole: 8 consecutive columns map to 8 consecutive elements
    assert np.all(np.diff(idx.reshape(16, 16, 8), axis=-1) == 1)
    # spot values of the formula r*128 + ((c//8) ^ (r%8))*8 + c%8
    assert (
        idx[0, 0] == 0
        and idx[1, 0] == 128 + 8
        and idx[3, 17] == 3 * 128 + (2 ^ 3) * 8 + 1
    )


def test_encode_decode_round_trip_is_exact():
    rng = np.random.default_rng(0)
    fields = _random_fields(rng, (3, 5))
    rec = wl.encode_records(fields)
    assert rec.shape == (3, 5, wl.RECORD_BYTES) and rec.dtype == np.uint8
    back = wl.decode_records(rec)
    for name, arr in fields.items():
        np.testing.assert_array_equal(
            back[name].view(np.uint8), arr.view(np.uint8), err_msg=name
        )
    np.testing.assert_array_equal(wl.encode_records(back), rec)


def test_kd_rows_are_swizzled_in_bytes():
    fields = _random_fields(np.random.default_rng(1), ())
    fields["kd"] = np.arange(16 * 128, dtype=np.uint16).reshape(16, 128)
    rec = wl.encode_records(fields)
    flat = rec[wl.KD_OFFSET : wl.KD_OFFSET + 4096].view(np.uint16)
    r, c = 5, 42
    assert flat[r * 128 + ((c // 8) ^ (r % 8)) * 8 + c % 8] == r * 128 + c
    assert flat[r * 128 + c] != r * 128 + c  # it is not plain row-major


def test_chunk_slots_and_decode_workspace():
    cu = np.array([0, 5, 5, 40, 41], np.int32)  # lengths 5, 0, 35, 1
    slots = wl.chunk_slots(cu)
    assert slots == [(0, 0, 0), (2, 0, 2), (2, 1, 3), (2, 2, 4), (3, 0, 2 + 3)]
    s = contract.workspace_slots(41, 4)
    assert s == 3 + 4 and max(x for *_, x in slots) < s
    assert len({x for *_, x in slots}) == len(slots)
    fields = _random_fields(np.random.default_rng(2), (2, s))
    ws = wl.encode_records(fields)
    dec = wl.decode_workspace(ws, cu)
    assert dec["gt"].shape == (2, 5, 128)
    np.testing.assert_array_equal(dec["seq"], [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(dec["chunk"], [0, 0, 1, 2, 0])
    np.testing.assert_array_equal(dec["kd"][:, 3], fields["kd"][:, 4])


def test_decode_rejects_wrong_record_size():
    with pytest.raises(ValueError):
        wl.decode_records(np.zeros((2, 100), np.uint8))


# ----------------------------------------------------------------------------- fp32 mode record
_FP32_TILES = ("kd_hi", "qd_hi", "qd_lo", "kr_hi", "kr_lo")
_FP32_SMALL = ("inv_hi", "inv_lo", "mqk_hi", "mqk_lo")


def _random_fp32_fields(rng, lead):
    """Random bits in every field (gt too: any f32 bit pattern, NaNs included)."""
    fields = {n: rng.integers(0, 2**16, (*lead, 16, 128), dtype=np.uint16) for n in _FP32_TILES}
    fields.update(
        {n: rng.integers(0, 2**16, (*lead, 16, 16), dtype=np.uint16) for n in _FP32_SMALL}
    )
    fields["gt"] = rng.integers(0, 2**32, (*lead, 128), dtype=np.uint32).view(np.float32)
    return fields


def test_fp32_offsets_tile_the_record():
    sizes = {n: 4096 for n in _FP32_TILES} | {"gt": 512} | {n: 512 for n in _FP32_SMALL}
    end = 0
    for name, off in sorted(contract.FP32_RECORD.items(), key=lambda kv: kv[1]):
        assert off == end and off % 512 == 0, name
        end = off + sizes[name]
    assert end == contract.FP32_RECORD_BYTES == contract.record_bytes("fp32") == 23040
    # the hi tiles keep the bf16 record's offsets
    assert (contract.FP32_RECORD["kd_hi"], contract.FP32_RECORD["qd_hi"],
            contract.FP32_RECORD["kr_hi"]) == (wl.KD_OFFSET, wl.QD_OFFSET, wl.KR_OFFSET)


def test_fp32_encode_decode_round_trip_is_exact():
    rng = np.random.default_rng(3)
    fields = _random_fp32_fields(rng, (2, 3))
    rec = wl.encode_fp32_records(fields)
    assert rec.shape == (2, 3, contract.FP32_RECORD_BYTES) and rec.dtype == np.uint8
    back = wl.decode_fp32_records(rec)
    assert set(back) == set(fields)
    for name, arr in fields.items():
        assert back[name].shape == arr.shape and back[name].dtype == arr.dtype, name
        np.testing.assert_array_equal(back[name].view(np.uint8), arr.view(np.uint8), err_msg=name)
    np.testing.assert_array_equal(wl.encode_fp32_records(back), rec)
    # and bytes -> fields -> bytes on a random record
    raw = rng.integers(0, 256, (4, contract.FP32_RECORD_BYTES), dtype=np.uint8)
    np.testing.assert_array_equal(wl.encode_fp32_records(wl.decode_fp32_records(raw)), raw)


def test_fp32_fields_sit_at_their_offsets_in_their_layouts():
    rng = np.random.default_rng(4)
    fields = _random_fp32_fields(rng, ())
    rec = wl.encode_fp32_records(fields)
    idx = wl.swizzle_index()
    for name in _FP32_TILES:
        off = contract.FP32_RECORD[name]
        flat = rec[off : off + 4096].view(np.uint16)
        np.testing.assert_array_equal(flat[idx], fields[name], err_msg=name)
        r, c = 5, 42  # swizzled rows, not row-major
        assert flat[r * 128 + ((c // 8) ^ (r % 8)) * 8 + c % 8] == fields[name][r, c]
    off = contract.FP32_RECORD["gt"]
    np.testing.assert_array_equal(
        rec[off : off + 512].view(np.uint32), fields["gt"].view(np.uint32)
    )
    for name in _FP32_SMALL:
        off = contract.FP32_RECORD[name]
        np.testing.assert_array_equal(
            rec[off : off + 512].view(np.uint16).reshape(16, 16), fields[name], err_msg=name
        )


def test_fp32_decode_workspace_picks_the_chunk_slots():
    cu = np.array([0, 5, 5, 40, 41], np.int32)  # lengths 5, 0, 35, 1
    s = contract.workspace_slots(41, 4)
    fields = _random_fp32_fields(np.random.default_rng(5), (2, s))
    ws = wl.encode_fp32_records(fields)
    dec = wl.decode_fp32_workspace(ws, cu)
    assert dec["gt"].shape == (2, 5, 128) and dec["qd_lo"].shape == (2, 5, 16, 128)
    np.testing.assert_array_equal(dec["seq"], [0, 2, 2, 2, 3])
    np.testing.assert_array_equal(dec["chunk"], [0, 0, 1, 2, 0])
    for i, (_, _, slot) in enumerate(wl.chunk_slots(cu)):
        for name in _FP32_TILES + _FP32_SMALL:
            np.testing.assert_array_equal(dec[name][:, i], fields[name][:, slot], err_msg=name)


def test_fp32_decode_rejects_wrong_record_size():
    with pytest.raises(ValueError):
        wl.decode_fp32_records(np.zeros((2, wl.RECORD_BYTES), np.uint8))
