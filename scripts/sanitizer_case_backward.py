"""Small gradients through kda_prefill for compute-sanitizer (memcheck/racecheck), so the
backward's chain kernel (jax_kda/kernels/state_chain.py) runs on: packed sequences with an empty
one, a length-1 one and partial last chunks (spare slots between them, tokens in no sequence at
the end), with and without an initial state; a malformed cu_seqlens (a sequence ending before it
starts, then overlapping ones: every index must stay in bounds); batched rows; both numerics
modes. `--backend auto` runs the same calls where no kernel GPU is (the chains as XLA scans).
compute-sanitizer 2025.3.1 itself crashes (SIGSEGV) on this script (on a batched case, while
XLA compiled the gradient program); scripts/sanitizer_case_chain.py runs the chain kernel alone,
without XLA's GEMMs (benchmarks/results/h200-20261204-sanitizer-backward.log)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

BACKEND = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "kernel"
rng = np.random.default_rng(0)
H = 2


def bf16(*shape):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)


def inputs(B, T):
    return dict(q=bf16(B, T, H, 128), k=bf16(B, T, H, 128), v=bf16(B, T, H, 128),
                g=bf16(B, T, H, 128), beta=bf16(B, T, H), A_log=jnp.zeros((H,), jnp.float32),
                dt_bias=jnp.asarray(rng.standard_normal((H, 128)), jnp.float32))


def gradients(x, numerics, cu_seqlens=None):
    """Every input's gradient (and the initial state's, if given) of sum(out) + sum(final);
    cu_seqlens traced (under jit its values are not checked: the kernels must stay in bounds)."""
    def loss(x, cu):
        out, final = jax_kda.kda_prefill(**x, cu_seqlens=cu, output_final_state=True,
                                         backend=BACKEND, numerics=numerics)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final.astype(jnp.float32))

    return jax.block_until_ready(jax.jit(jax.grad(loss))(x, cu_seqlens))


for cu in ([0, 5, 5, 6, 37, 70, 70], [0, 40, 20, 70, 50, 75]):  # well-formed; malformed
    T = 80  # tokens 70.. (75..) in no sequence
    x = inputs(1, T)
    N = len(cu) - 1
    for numerics in ("flashkda", "fp32"):
        gradients(x, numerics, jnp.asarray(cu, jnp.int32))
        state = jnp.asarray(rng.standard_normal((N, H, 128, 128), dtype=np.float32))
        with_state = gradients(x | {"initial_state": state}, numerics,
                               jnp.asarray(cu, jnp.int32))
    print("packed gradients ran", cu, with_state["initial_state"].shape)
for numerics in ("flashkda", "fp32"):
    x = inputs(3, 37)
    state = jnp.asarray(rng.standard_normal((3, H, 128, 128), dtype=np.float32))
    grads = gradients(x | {"initial_state": state}, numerics)
print("batched gradients ran", grads["q"].shape)
