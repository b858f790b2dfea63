"""Shared fixtures and collection hooks."""

import collections
import os
import pathlib
import sys

import numpy as np
import pytest

# Test modules import the helpers beside them (kda_testing.py, kernel_sim.py) also under
# --import-mode=importlib, which the GPU round trip uses and which does not put this folder on
# sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax

from jax_kda import _ffi

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several worker processes share a GPU: each allocates as it goes instead of taking 75 % of
    # the GPU's memory up front (read when jax creates its GPU client, after this).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_collection_modifyitems(items):
    """Tests marked slow run first: under pytest-xdist (make test) no worker is then left running
    one of them after the others have finished."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


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
        reason = _ffi.unavailable_reason() or "no such GPU"
        pytest.skip(f"needs a CUDA GPU with the built kernels ({reason})")
    return gpus


@pytest.fixture
def rng():
    """A generator with a fresh seed, printed (pytest -s, or shown with a failure);
    JAX_KDA_TEST_SEED=<seed> repeats a run."""
    seed = int(os.environ.get("JAX_KDA_TEST_SEED") or np.random.SeedSequence().entropy % 2**63)
    print(f"\n  seed {seed} (JAX_KDA_TEST_SEED={seed} repeats it)")
    return np.random.default_rng(seed)


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
