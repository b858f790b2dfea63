"""What the tests share: random kda inputs in named gate regimes, random initial states, segment
ids of given document lengths, and bitwise comparisons.

Gate regimes (A_log [H], dt_bias [H, 128], raw gate g [B, T, H, 128]):
* "mixed" (the default): A_log ~ U(-2, 1), dt_bias ~ N(0, 1), g ~ N(0, 1); per channel, decays
  anywhere between none and the lower bound;
* the regimes of docs/fp32_mode.md section 4 (jax_kda.bench.regimes, shared with the accuracy
  benchmark): "strong" (strongly decaying), "fla" (fla's test protocol), "keep32" (fla with 32
  never-forgetting key channels per head), "slow" (every channel decays slowly), "collinear" (no
  decay, one key per head: (I + L) near singular);
* a pair (law of g, law of dt_bias) from GATE_LAWS x BIAS_LAWS, with A_log ~ U(-2, 1): the contract
  sweep's constants at and beyond the sigmoid's saturation and its wide distributions ("mixed" is
  ("N(0,1)", "N(0,1)")).
Laws of q, k, v (jax_kda.bench.regimes.LAWS): "normal" N(0, 1) or "uniform" U(0, 1) (FlashKDA's
test inputs, correlated keys); beta logits ~ N(0, 1).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from jax_kda.bench import regimes

D = 128

GATE_LAWS = {  # raw gate g
    "-8": lambda rng, shape: np.full(shape, -8.0),
    "-4": lambda rng, shape: np.full(shape, -4.0),
    "0": lambda rng, shape: np.zeros(shape),
    "8": lambda rng, shape: np.full(shape, 8.0),
    "N(0,1)": lambda rng, shape: rng.standard_normal(shape),
    "U(-8,8)": lambda rng, shape: rng.uniform(-8, 8, shape),
    "N(0,8)": lambda rng, shape: rng.normal(0, 8, shape),
}
BIAS_LAWS = {  # dt_bias
    "0": lambda rng, shape: np.zeros(shape),
    "+-4": lambda rng, shape: np.where(rng.random(shape) < 0.5, -4.0, 4.0),
    "+-8": lambda rng, shape: np.where(rng.random(shape) < 0.5, -8.0, 8.0),
    "N(0,1)": lambda rng, shape: rng.standard_normal(shape),
    "U(-8,8)": lambda rng, shape: rng.uniform(-8, 8, shape),
    "N(0,8)": lambda rng, shape: rng.normal(0, 8, shape),
}
NAMED = {"mixed": ("N(0,1)", "N(0,1)")}
REGIMES = (*NAMED, *regimes.REGIMES)


def make_inputs(rng, B: int, T: int, H: int, *, regime="mixed", law: str = "normal") -> dict:
    """kda_prefill's arrays: bf16 q, k, v, g [B, T, H, 128] and beta [B, T, H]; f32 A_log [H] and
    dt_bias [H, 128]. `regime`: a name of REGIMES or a pair (GATE_LAWS key, BIAS_LAWS key)."""
    if isinstance(regime, str) and regime in regimes.REGIMES:
        return regimes.make_inputs(rng, T, H, regime, law, B=B)
    laws = NAMED.get(regime) if isinstance(regime, str) else tuple(regime)
    if laws is None or len(laws) != 2 or laws[0] not in GATE_LAWS or laws[1] not in BIAS_LAWS:
        raise ValueError(f"regime must be one of {REGIMES} or a pair of laws "
                         f"({tuple(GATE_LAWS)}, {tuple(BIAS_LAWS)}), got {regime!r}")
    g_law, bias_law = laws
    if law not in regimes.LAWS:
        raise ValueError(f"law must be one of {regimes.LAWS}, got {law!r}")
    # drawn in the order of jax_kda.bench.regimes.make_inputs
    a_log, dt = rng.uniform(-2, 1, H), BIAS_LAWS[bias_law](rng, (H, D))
    g = GATE_LAWS[g_law](rng, (B, T, H, D))
    draw = rng.standard_normal if law == "normal" else rng.random
    k, beta = draw((B, T, H, D)), rng.standard_normal((B, T, H))
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    return {"q": bf16(draw((B, T, H, D))), "k": bf16(k), "v": bf16(draw((B, T, H, D))),
            "g": bf16(g), "beta": bf16(beta),
            "A_log": jnp.asarray(a_log, jnp.float32), "dt_bias": jnp.asarray(dt, jnp.float32)}


def grouped_inputs(rng, B: int, T: int, Hk: int, G: int, *, regime="keep32") -> dict:
    """make_inputs with q and k on Hk heads and the rest on Hk * G (grouped value heads)."""
    args = make_inputs(rng, B, T, Hk * G, regime=regime)
    qk = make_inputs(rng, B, T, Hk, regime=regime)
    args["q"], args["k"] = qk["q"], qk["k"]
    return args


def repeated_qk(args: dict, G: int) -> dict:
    """The same arrays with q and k repeated to the value heads (head j = query/key head j // G)."""
    return dict(args, q=jnp.repeat(args["q"], G, axis=2), k=jnp.repeat(args["k"], G, axis=2))


def random_states(rng, rows: int, H: int, dtype=jnp.float32, scale: float = 0.1):
    """[rows, H, 128, 128] of N(0, scale^2) values in `dtype`. f32 values are not bf16 numbers, so
    a rounding of a state that must pass through unchanged shows."""
    states = rng.standard_normal((rows, H, D, D), dtype=np.float32) * np.float32(scale)
    if np.dtype(dtype) == np.float32 and states.size:
        assert np.mean(states != states.astype(jnp.bfloat16).astype(np.float32)) > 0.99
    return jnp.asarray(states, dtype)


def numpy_documents(ids):
    """Segment ids [B, T] -> (cu_seqlens of their documents over the flattened tokens, document
    count), one token at a time: what jax_kda.segments computes on device."""
    starts = []
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            if t == 0 or ids[b, t] != ids[b, t - 1]:
                starts.append(b * ids.shape[1] + t)
    return np.asarray(starts + [ids.size], np.int32), len(starts)


def random_ids(rng, rows):
    """int32 segment ids [len(rows), sum(rows[0])]: row b holds documents of lengths rows[b], with
    random ids (no two neighbouring runs equal); each row starts with the id the previous row
    ended with (still a new document)."""
    ids, last = [], int(rng.integers(-4, 4))
    for lengths in rows:
        row, value = [], last
        for i, n in enumerate(lengths):
            if i:
                value = int(rng.choice([x for x in range(-4, 4) if x != value]))
            row += [value] * n
        ids.append(row)
        last = value
    return jnp.asarray(ids, jnp.int32)


def bits(x) -> np.ndarray:
    """x's bit patterns as unsigned integers of its element size (equal bits, equal values: NaNs,
    signed zeros and subnormals included)."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def assert_bits(got, want, what: str = "") -> None:
    """got and want have the same dtype, shape and bits; tuples and lists element by element."""
    if isinstance(got, (tuple, list)):
        assert isinstance(want, (tuple, list)) and len(got) == len(want), (what, len(got), want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bits(g, w, f"{what}[{i}]")
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    differ = bits(got) != bits(want)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.size} elements differ"


def assert_zero(x, what: str = "") -> None:
    x = np.asarray(jnp.asarray(x).astype(jnp.float32))
    assert (x == 0).all(), f"{what}: {int((x != 0).sum())} of {x.size} elements are not zero"


def run_on_virtual_cpu_devices(test_file, flag, deselect, min_passed, devices=8, timeout=1800):
    """Re-runs `test_file`'s CPU tests in a subprocess with `devices` virtual CPU devices (XLA's
    device count is fixed when jax initialises) and the environment variable `flag` = "1" (the
    tests that need the devices run only there); `deselect` is the -k expression that leaves the
    calling test out. Asserts that at least `min_passed` passed and none was skipped."""
    env = dict(os.environ, **{flag: "1"}, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + f" --xla_force_host_platform_device_count={devices}").strip()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-m",
         "not gpu", "-k", deselect],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= min_passed, report
    assert "skipped" not in run.stdout.splitlines()[-1], report
