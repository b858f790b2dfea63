import numpy as np, jax, jax.numpy as jnp
import jax_kda
from jax_kda import reference_fp32
from jax_kda.bench import regimes
cpu = jax.devices("cpu")[0]
def rel(x, y):
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64); y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    return float(np.sqrt(np.mean((x - y) ** 2) / np.mean(y ** 2))), float(np.mean(x == y))
rng = np.random.default_rng(1)
for regime in ("slow", "keep32", "fla"):
    for T in (64, 2048):
        a = regimes.make_inputs(rng, T, 2, regime, "normal")
        k = jax.jit(lambda a: jax_kda.kda_prefill(**a, backend="kernel", numerics="fp32", output_final_state=True))(a)
        ac = jax.device_put(a, cpu)
        run = lambda: jax.jit(lambda a: reference_fp32.kda_prefill_reference_fp32(**a, scale=128**-0.5, lower_bound=-5.0))(ac)
        r = run()
        with reference_fp32._product_terms(P=("hh",)):
            rh = jax.jit(lambda a: reference_fp32.kda_prefill_reference_fp32(**a, scale=128**-0.5, lower_bound=-5.0))(ac)
        print(regime, T, "vs ref out/state", rel(k[0], r[0]), rel(k[1], r[1]), "| vs ref P=hh", rel(k[0], rh[0]), rel(k[1], rh[1]), flush=True)
