"""Bit patterns of a build's kernel results on fixed inputs, to tell whether two builds (say, before
and after a kernel change meant to keep the bits) agree.

  python scripts/build_outputs.py dump OUT.npz [--small]   (the build under test on PYTHONPATH)
  python scripts/build_outputs.py compare A.npz B.npz

dump: for fixed seeds, the prepare workspace (both inverses, both numerics modes), kda_prefill's
output and final state (both modes, batched and packed with empty sequences, 8 x 1024 tokens at
24 heads, which "auto" runs on the baseline kernel, and 96 heads at T = 8192 unless --small, which
leaves out its GB-sized arrays for a quick check) and kda_decode's (t = 1 and 16, bf16 and f32
pools, intermediate states).
compare: every array bitwise; prints one line per array and exits 1 on any difference."""

import functools
import sys

import numpy as np


def _inputs(rng, lead, H):
    import jax.numpy as jnp

    def bf16(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)

    return {"q": bf16(*lead, H, 128), "k": bf16(*lead, H, 128), "v": bf16(*lead, H, 128),
            "g": bf16(*lead, H, 128), "beta": bf16(*lead, H),
            "A_log": jnp.asarray(rng.uniform(-2, 1, H), jnp.float32),
            "dt_bias": jnp.asarray(rng.standard_normal((H, 128)), jnp.float32)}


def _prepare(x, cu, *, inverse, numerics):
    from jax_kda import _ffi

    return _ffi.prepare_call(x["q"][0], x["k"][0], x["g"][0], x["beta"][0], x["A_log"],
                             x["dt_bias"], cu, scale=128**-0.5, lower_bound=-5.0, inverse=inverse,
                             numerics=numerics)


def _prefill(x, extra, *, numerics):
    import jax_kda

    return jax_kda.kda_prefill(**x, **extra, output_final_state=True, backend="kernel",
                               numerics=numerics)


def dump(path, *, small=False):
    import jax
    import jax.numpy as jnp

    import jax_kda

    out = {}
    rng = np.random.default_rng(1234)
    prefill_cases = [("B2_T100_H3", (2, 100), 3, None),
                     ("packed_H5", (1, 445), 5, [0, 37, 37, 38, 168, 184, 189, 445]),
                     ("B8_T1024_H24", (8, 1024), 24, None)]
    if not small:
        prefill_cases.insert(0, ("T8192_H96", (1, 8192), 96, None))
    for name, lead, H, cu in prefill_cases:
        x = _inputs(rng, lead, H)
        cu_arr = jnp.asarray(cu if cu else [0, lead[1]], jnp.int32)
        for numerics in ("flashkda", "fp32"):
            inverses = ("stable", "neumann") if numerics == "flashkda" else ("stable",)
            for inverse in inverses:
                ws = jax.jit(functools.partial(_prepare, inverse=inverse, numerics=numerics))(
                    x, cu_arr)
                out[f"{name}/{numerics}/{inverse}/workspace"] = np.asarray(ws)
            extra = {"cu_seqlens": cu_arr} if cu else {}
            o, s = jax.jit(functools.partial(_prefill, numerics=numerics))(x, extra)
            out[f"{name}/{numerics}/out"] = np.asarray(o)
            out[f"{name}/{numerics}/state"] = np.asarray(s)
    H = 3
    for dtype in (jnp.bfloat16, jnp.float32):
        for t in (1, 16):
            x = _inputs(rng, (4, t), H)
            pool = jnp.asarray(rng.standard_normal((6, H, 128, 128), dtype=np.float32) * 0.1, dtype)
            idx = jnp.asarray([4, -1, 2, 1], jnp.int32)
            o, p, st = jax.jit(lambda x, pool, idx: jax_kda.kda_decode(
                **x, state=pool, state_indices=idx, output_intermediate_states=True,
                backend="kernel"))(x, pool, idx)
            tag = f"decode/{jnp.dtype(dtype).name}/t{t}"
            for name, x in (("out", o), ("pool", p), ("states", st)):
                out[f"{tag}/{name}"] = np.asarray(x)
    np.savez(path, **{k: v.view(np.uint8) for k, v in out.items()})
    print(f"dumped {len(out)} arrays to {path}")


def compare(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    bad = sorted(set(a.files) ^ set(b.files))
    for name in sorted(set(a.files) & set(b.files)):
        same = a[name].shape == b[name].shape and np.array_equal(a[name], b[name])
        print(f"{'same' if same else 'DIFF'} {name} ({a[name].size} bytes)")
        bad += [] if same else [name]
    print("bitwise equal" if not bad else f"{len(bad)} differ or are missing: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"] and len(sys.argv) in (3, 4) and sys.argv[3:] in ([], ["--small"]):
        dump(sys.argv[2], small=sys.argv[3:] == ["--small"])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
