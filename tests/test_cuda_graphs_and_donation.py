"""CUDA graphs (XLA command buffers), forward and backward, and donating the initial state buffer
for the final state.

The recurrence custom call declares final_state as an alias of initial_state (operand 4 -> result
1), so a caller that donates the initial state (jax.jit(..., donate_argnames="initial_state")) gets
the final state written in place: a state pool needs no second buffer. Without donation XLA copies
first, so results never depend on it.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kda_testing import assert_bits, make_inputs, random_states

import jax_kda
from jax_kda import api

B, T, H = 1, 20, 2


def make_args(seed=0, b=B, t=T, h=H, state_dtype=jnp.bfloat16):
    """(kda_prefill's positional arrays, an initial state)."""
    rng = np.random.default_rng(seed)
    args = tuple(make_inputs(rng, b, t, h).values())
    return args, random_states(rng, b, h, state_dtype, scale=1.0)


def prefill(backend, donate):
    fn = partial(jax_kda.kda_prefill, output_final_state=True, backend=backend)
    return jax.jit(fn, donate_argnames="initial_state" if donate else ())


# ------------------------------------------------------------------------------------ CPU


def test_recurrence_custom_call_aliases_state(monkeypatch):
    monkeypatch.setattr(api, "_require_kernels", lambda: None)  # lowering needs no GPU
    args, state = make_args()
    text = prefill("kernel", donate=True).trace(*args, initial_state=state).lower(
        lowering_platforms=("cuda",)).as_text()
    call = next(line for line in text.splitlines() if "custom_call @jax_kda_recurrence_v1" in line)
    assert re.search(r"output_operand_alias<output_tuple_indices = \[1\], operand_index = 4,", call)
    # The donated argument may be written by the function's second result (the final state).
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(r"%arg7: tensor<1x2x128x128xbf16> \{tf.aliasing_output = 1 : i32\}", main)


@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float32])
def test_donation_on_cpu_reference_path(state_dtype):
    args, state = make_args(seed=1, state_dtype=state_dtype)
    want = prefill("reference", donate=False)(*args, initial_state=state)
    donated = jnp.array(state, copy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" would be a warning
        got = prefill("reference", donate=True)(*args, initial_state=donated)
    assert donated.is_deleted()
    assert got[1].dtype == state_dtype
    assert_bits(got, want)


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_donated_state_becomes_final_state(state_dtype, kernel_gpus):
    gpu = kernel_gpus[0]
    args, state = jax.device_put(make_args(seed=2, b=2, t=300, h=6, state_dtype=state_dtype), gpu)
    want = prefill("kernel", donate=False)(*args, initial_state=state)
    donated = jnp.array(state, copy=True)
    pointer = donated.unsafe_buffer_pointer()
    fn = prefill("kernel", donate=True)
    assert "input_output_alias" in fn.lower(*args, initial_state=donated).compile().as_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fn(*args, initial_state=donated)
    assert donated.is_deleted()
    assert_bits(got, want)
    if state_dtype == jnp.bfloat16:  # written in place: the state pool needs no second buffer
        assert got[1].unsafe_buffer_pointer() == pointer


# Runs in a fresh process (XLA flags are read once): kernel-path prefill and the gradient of a loss
# through it on two input sets, each three times (a command buffer is recorded, then replayed,
# then updated for new buffers).
_GRAPH_SCRIPT = textwrap.dedent("""
    import json, re, sys
    from functools import partial
    import jax, jax.numpy as jnp, numpy as np
    import jax_kda

    def inputs(seed):
        rng = np.random.default_rng(seed)
        bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        return dict(q=bf(2, 300, 6, 128), k=bf(2, 300, 6, 128), v=bf(2, 300, 6, 128),
                    g=bf(2, 300, 6, 128), beta=bf(2, 300, 6),
                    A_log=jnp.asarray(rng.uniform(-1.5, 1.0, 6), jnp.float32),
                    dt_bias=jnp.asarray(rng.standard_normal((6, 128)), jnp.float32),
                    initial_state=jnp.asarray(rng.standard_normal((2, 6, 128, 128)), jnp.float32))

    fn = jax.jit(partial(jax_kda.kda_prefill, output_final_state=True, backend="kernel"))
    rng = np.random.default_rng(2)
    w_out = jnp.asarray(rng.standard_normal((2, 300, 6, 128)), jnp.float32)
    w_state = jnp.asarray(rng.standard_normal((2, 6, 128, 128)), jnp.float32)

    def loss(x):  # the backward's kernels (the chain kernel) and XLA's ops around them
        out, state = fn(**x)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(state * w_state)

    grad = jax.jit(jax.grad(loss))
    results = {}
    for seed in (0, 1):
        x = inputs(seed)
        for rep in range(3):
            out, state = fn(**x)
            results[f"out_{seed}_{rep}"] = np.asarray(out.astype(jnp.float32))
            results[f"state_{seed}_{rep}"] = np.asarray(state)
            for name, d in grad(x).items():
                results[f"d{name}_{seed}_{rep}"] = np.asarray(d.astype(jnp.float32))
    np.savez(sys.argv[1], **results)
    hlo = fn.lower(**inputs(0)).compile().as_text()
    blocks = re.findall(r"%command_buffer[^{]*\\{(.*?)\\n\\}", hlo, re.S)
    print(json.dumps({"command_buffer_with_kda": any("jax_kda_" in b for b in blocks),
                      "command_buffers": len(blocks)}))
""")


def test_graph_script_compiles():
    compile(_GRAPH_SCRIPT, "graph_script", "exec")  # a typo would otherwise show only on the GPU


def run_graph_script(tmp_path, name, xla_flags):
    env = dict(os.environ, XLA_FLAGS=xla_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    path = tmp_path / f"{name}.npz"
    run = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(path)], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return dict(np.load(path)), json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_command_buffers_with_custom_calls_give_identical_results(tmp_path, kernel_gpus):
    plain, _ = run_graph_script(tmp_path, "plain", "--xla_gpu_enable_command_buffer=")
    graphs, info = run_graph_script(
        tmp_path, "graphs",
        "--xla_gpu_enable_command_buffer=+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
    )
    assert plain.keys() == graphs.keys()
    for key in plain:
        np.testing.assert_array_equal(graphs[key], plain[key], err_msg=key)
    for key in graphs:  # replays equal the first run, bit for bit: every result
        name, seed, rep = key.rsplit("_", 2)
        np.testing.assert_array_equal(graphs[key], graphs[f"{name}_{seed}_0"], err_msg=key)
    assert np.any(plain["dg_0_0"] != 0) and not np.array_equal(plain["dq_0_0"], plain["dq_1_0"])
    if not info["command_buffer_with_kda"]:
        # Newer XLA builds command buffers from thunks after HLO scheduling, which the HLO text
        # does not show; then only the identical results above are checked.
        warnings.warn(f"no HLO command_buffer computation holds a jax_kda custom call: {info}")
