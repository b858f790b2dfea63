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
