"""CPU checks of the overlapped prefill's two kernels (KdaPrepareOverlap, KdaRecurrenceOverlap):
they compile for both architectures, export the wrappers the FFI handler calls in its order, hold
the cross-grid protocol's instructions (prepare: a trigger for its dependents, a gpu-scope release
add per record; recurrence: relaxed polls of the counters, then one acquire load, and the final
wait for the prepare grid), and the recurrence's poll warp takes part in exactly as many CTA
barriers as the compute warps. Needs nvidia-cutlass-dsl (build time only)."""

from __future__ import annotations

import re

import pytest
from c_export import wrapper_arguments

pytest.importorskip("cutlass")

from jax_kda import contract
from jax_kda.kernels import prepare, recurrence


def _ptx(compiled) -> str:
    return compiled.__ptx__


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    out = {}
    for arch in contract.ARCHS:
        dump = str(tmp_path_factory.mktemp(f"overlap_{arch}"))
        out[("prepare", arch)] = _ptx(prepare.compile_kernel("stable", arch, overlap=True,
                                                             dump_dir=dump))
        out[("plain_prepare", arch)] = _ptx(prepare.compile_kernel("stable", arch, dump_dir=dump))
        for bv in (16, 64):
            out[(bv, arch)] = _ptx(recurrence.compile_kernel(bv, arch, overlap=True,
                                                             dump_dir=dump))
    return out


@pytest.mark.parametrize("arch", tuple(contract.ARCHS))
def test_prepare_publishes_each_record_and_triggers_its_dependents(builds, arch):
    ptx = builds[("prepare", arch)]
    assert f".target {arch}" in ptx
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert "griddepcontrol.wait" not in ptx  # prepare never waits: the recurrence's waits end
    # one release add per record (after the CTA barrier), no acquire fence: on sm_90 its acquire
    # half invalidates the SM's L1 after every record
    assert ptx.count("red.release.gpu.global.add.u32") == 1
    assert "fence.acq_rel" not in ptx
    # the plain prepare kernel is untouched by all of this
    plain = builds[("plain_prepare", arch)]
    for instr in ("griddepcontrol", "red.release.gpu"):
        assert instr not in plain


@pytest.mark.parametrize("block_v", (16, 64))
@pytest.mark.parametrize("arch", tuple(contract.ARCHS))
def test_recurrence_polls_relaxed_acquires_once_and_waits_for_prepare_at_the_end(builds, arch,
                                                                                block_v):
    ptx = builds[(block_v, arch)]
    warps, _ = recurrence.warp_split(block_v)
    assert re.search(rf"\.reqntid {32 * (warps + 1)}, 1, 1", ptx), "compute warps + poll warp"
    # before the loop and per chunk: the spin reads are relaxed (an acquire load invalidates the
    # SM's L1 on sm_90, which at every poll would take it from the prepare CTAs beside it), then
    # one acquire load of the complete count
    assert ptx.count("ld.relaxed.gpu.global.u32") == 2
    assert ptx.count("ld.acquire.gpu.global.u32") == 2
    for spin in re.findall(r"ld\.relaxed\.gpu\.global\.u32.*?bra", ptx, re.DOTALL):
        assert "ld.acquire" not in spin
    assert ptx.count("griddepcontrol.wait") == 1
    assert "griddepcontrol.launch_dependents" not in ptx
    # three CTA barriers on each side: before the first copies, the prologue's, the chunk's; the
    # unaligned form, as the poll warp meets them at its own instructions (compute-sanitizer's
    # synccheck reports the aligned bar.sync there)
    assert ptx.count("barrier.sync 0;") == 6
    assert "bar.sync" not in ptx


def test_exported_wrappers_take_the_handler_s_arguments(tmp_path):
    prep = prepare.compile_kernel("stable", "sm_90a", overlap=True)
    assert wrapper_arguments(prep, tmp_path, "kda_prepare_overlap_test") == [
        "module", "mQ", "mK", "mG", "mBeta", "mALog", "mDtBias", "mCuSeqlens", "mWorkspace",
        "mReady", "scale", "lower_bound", "num_ctas", "stream"]
    rec = recurrence.compile_kernel(16, "sm_90a", overlap=True)
    assert wrapper_arguments(rec, tmp_path, "kda_recurrence_overlap_test") == [
        "module", "mV", "mBeta", "mWorkspace", "mCuSeqlens", "mState0", "mOut", "mStateT",
        "mReady", "use_pdl", "stream"]


def test_ready_counter_layout():
    assert contract.ready_blocks(1) == 1
    assert contract.ready_blocks(contract.READY_BLOCK_SLOTS) == 1
    assert contract.ready_blocks(contract.READY_BLOCK_SLOTS + 1) == 2
    assert contract.ready_words(3, 40) == 3 * 3
