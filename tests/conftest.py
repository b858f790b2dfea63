"""Shared fixtures."""

import collections
import pathlib
import sys

import pytest

# Test modules import the helpers beside them (kernel_sim.py) also under --import-mode=importlib,
# which the GPU round trip uses and which does not put this folder on sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax

from jax_kda import _ffi


@pytest.fixture(autouse=True)
def _fresh_traces_around_monkeypatching(request):
    """jax_kda compiles each call configuration once (an eager call too), so a program traced
    before a test monkeypatches the package would be reused unchanged: tests that patch start
    and end with empty jit caches."""
    if "monkeypatch" not in request.fixturenames:
        yield
        return
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.fixture
def kernel_gpus():
    """The CUDA devices the built kernels run on; skips the test where there are none."""
    gpus = _ffi.kernel_gpus()
    if not gpus:
        pytest.skip(f"needs a CUDA GPU with the built kernels ({_ffi.unavailable_reason() or 'no such GPU'})")
    return gpus


def pytest_terminal_summary(terminalreporter):
    """One line naming why tests skipped (pytest -q shows only a count)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter()
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    parts = [f"{count} x {reason}" for reason, count in reasons.most_common()]
    terminalreporter.write_line(f"skipped {len(skipped)}: " + "; ".join(parts))
