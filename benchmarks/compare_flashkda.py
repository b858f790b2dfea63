"""Bit-compatibility check against FlashKDA run on a GPU machine where FlashKDA is built.

Compares jax_kda's kernels, bit for bit, with
  - FlashKDA v1 (MoonshotAI/FlashKDA 1ce47ea) built on the machine: the neumann inverse;
  - the bit-exact PyTorch mirror of the stable inverse (vLLM's FlashKDA fork, tests/torch_ref.py at
    3b225bf) and FlashKDA v1's own torch_ref.py (neumann), where their paths are given.
Their code is not part of this repository: pass the built package on PYTHONPATH and the two
torch_ref files as --stable-ref / --neumann-ref (benchmarks/flashkda_parity.sh does the set-up).

Prints, per case and per comparison, the fraction of bit-equal elements and the largest distance in
bf16 ulps for out and the final state; writes the same as JSON. Exit status 1 if any comparison
that ran is not bitwise equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

import jax_kda

SCALE = 128**-0.5
LOWER_BOUND = -5.0

# (name, layout, lengths, heads, state dtype): batched lengths are B equal lengths.
CASES = (
    ("batched B=2 T=100 H=3, bf16 state", "batched", (100, 100), 3, "bfloat16"),
    ("varlen [37,0,16,97,1] H=2, f32 state", "varlen", (37, 0, 16, 97, 1), 2, "float32"),
    ("batched B=1 T=1000 H=2, no initial state", "batched", (1000,), 2, None),
)


def draw_inputs(rng, layout, lengths, heads):
    T = lengths[0] if layout == "batched" else sum(lengths)
    B = len(lengths) if layout == "batched" else 1
    n = len(lengths)

    def normal(*shape, s=1.0):
        return (s * rng.standard_normal(shape)).astype(np.float32)

    return {
        "q": normal(B, T, heads, 128), "k": normal(B, T, heads, 128), "v": normal(B, T, heads, 128),
        "g": normal(B, T, heads, 128), "beta": normal(B, T, heads),
        "A_log": rng.uniform(0, 1, heads).astype(np.float32),
        "dt_bias": rng.uniform(0, 1, (heads, 128)).astype(np.float32),
        "state": normal(n, heads, 128, 128, s=0.05),
        "cu_seqlens": (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
                       if layout == "varlen" else None),
    }


def run_jax(x, state_dtype, inverse):
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)
    init = (None if state_dtype is None
            else jnp.asarray(x["state"]).astype(jnp.bfloat16).astype(state_dtype))
    cu = None if x["cu_seqlens"] is None else jnp.asarray(x["cu_seqlens"], jnp.int32)
    out, final = jax_kda.kda_prefill(
        bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["g"]), bf(x["beta"]), jnp.asarray(x["A_log"]),
        jnp.asarray(x["dt_bias"]), scale=SCALE, lower_bound=LOWER_BOUND, initial_state=init,
        output_final_state=True, cu_seqlens=cu, inverse=inverse, backend="kernel")
    return np.asarray(out.astype(jnp.float32)), np.asarray(final.astype(jnp.float32)), final.dtype


def torch_inputs(x, state_dtype):
    import torch

    dev = "cuda"
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev).to(dt).contiguous()
    bf16 = torch.bfloat16
    d = {name: t(x[name], bf16) for name in ("q", "k", "v", "g", "beta")}
    d["A_log"], d["dt_bias"] = t(x["A_log"], torch.float32), t(x["dt_bias"], torch.float32)
    state_torch_dtype = {None: bf16, "bfloat16": bf16, "float32": torch.float32}[state_dtype]
    # Same initial state as jax_kda sees: rounded to bf16 first, then held in the state dtype.
    d["initial_state"] = None if state_dtype is None else t(x["state"], bf16).to(state_torch_dtype)
    d["final_state"] = torch.full((len(x["state"]),) + x["state"].shape[1:], float("nan"),
                                  dtype=state_torch_dtype, device=dev)
    d["out"] = torch.full_like(d["v"], float("nan"))
    d["cu_seqlens"] = None if x["cu_seqlens"] is None else torch.from_numpy(x["cu_seqlens"]).to(dev)
    return d


def run_torch_impl(fn, x, state_dtype):
    import torch

    d = torch_inputs(x, state_dtype)
    fn(d["q"], d["k"], d["v"], d["g"], d["beta"], SCALE, d["out"], d["A_log"], d["dt_bias"],
       LOWER_BOUND, initial_state=d["initial_state"], final_state=d["final_state"],
       cu_seqlens=d["cu_seqlens"])
    torch.cuda.synchronize()
    return d["out"].float().cpu().numpy(), d["final_state"].float().cpu().numpy()


def bf16_bits(x):
    """The bf16 bit patterns of x (values already bf16-representable: outputs, states)."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16).view(jnp.uint16)).astype(np.int32)


def ulp_order(bits):
    """bf16 bit patterns -> integers ordered like the values (-0 and +0 map together), so that
    a difference is a distance in ulps. NaN patterns are compared as patterns."""
    return np.where(bits & 0x8000, 0x8000 - bits, bits)


def compare(a, b):
    bits_a, bits_b = bf16_bits(a), bf16_bits(b)
    equal = float(np.mean(bits_a == bits_b)) if bits_a.size else 1.0
    max_ulp = int(np.max(np.abs(ulp_order(bits_a) - ulp_order(bits_b)))) if bits_a.size else 0
    return {"bit_equal_fraction": equal, "max_ulp": max_ulp,
            "nonfinite_a": int(np.sum(~np.isfinite(a))),
            "nonfinite_b": int(np.sum(~np.isfinite(b)))}


def load_ref(path):
    spec = importlib.util.spec_from_file_location(f"torch_ref_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.torch_ref


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stable-ref", help="vLLM FlashKDA fork tests/torch_ref.py at 3b225bf")
    parser.add_argument("--neumann-ref", help="FlashKDA tests/torch_ref.py at 1ce47ea")
    parser.add_argument("--json", default="flashkda_parity.json")
    parser.add_argument("--seed", type=int, default=None, help="default: fresh entropy")
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    print(f"jax {jax.__version__}, devices {jax.devices()}, seed {seed}")

    others = {}
    try:
        import flash_kda
        others["flashkda_v1"] = ("neumann", flash_kda.fwd)
    except Exception as err:  # noqa: BLE001 - report and go on with what is there
        print(f"FlashKDA not importable: {err}")
    for label, path, inverse in (("torch_ref_stable_3b225bf", args.stable_ref, "stable"),
                                 ("torch_ref_neumann_1ce47ea", args.neumann_ref, "neumann")):
        if path:
            try:
                others[label] = (inverse, load_ref(path))
            except Exception as err:  # noqa: BLE001
                print(f"{label} not loadable: {err}")

    results, all_equal = [], True
    for name, layout, lengths, heads, state_dtype in CASES:
        x = draw_inputs(rng, layout, lengths, heads)
        mine = {inv: run_jax(x, state_dtype, inv) for inv in ("stable", "neumann")}
        for label, (inverse, fn) in others.items():
            try:
                out, final = run_torch_impl(fn, x, state_dtype)
            except Exception as err:  # noqa: BLE001
                print(f"{name} | {label}: failed to run: {err}")
                results.append({"case": name, "against": label, "error": str(err)})
                continue
            row = {"case": name, "against": label, "inverse": inverse,
                   "out": compare(mine[inverse][0], out),
                   "final_state": compare(mine[inverse][1], final)}
            ok = (row["out"]["bit_equal_fraction"] == 1.0
                  and row["final_state"]["bit_equal_fraction"] == 1.0)
            all_equal &= ok
            results.append(row)
            print(f"{name} | jax_kda[{inverse}] vs {label}: "
                  f"out bit-equal {row['out']['bit_equal_fraction']:.6f}"
                  f" (max {row['out']['max_ulp']} ulp), "
                  f"final state {row['final_state']['bit_equal_fraction']:.6f}"
                  f" (max {row['final_state']['max_ulp']} ulp){'' if ok else '  <-- DIFFERS'}")
    with open(args.json, "w") as f:
        json.dump({"seed": seed, "results": results}, f, indent=1)
    if not others:
        print("nothing to compare against")
        return 2
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
