"""Other KDA implementations timed in the same process through torch: fla and FlashKDA.

Both receive the same numbers as jax_kda (the case's numpy inputs): bf16 q/k/v/g/beta, f32 A_log
and dt_bias, lower_bound -5, scale 128**-0.5, a bf16 initial state (f32 for fla, which keeps its
state in f32), the final state requested, and cu_seqlens for varlen cases. "fla-train" times fla's
forward + backward of the training loss (bench/training.py) through torch autograd.

On a decode case, "fla" is fla's decode kernel, fused_recurrent_kda_fwd, on the case's pool (bf16
or f32, the same rows and the same state_indices as jax_kda's), updated in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from .cases import Case, DecodeCase
from .jax_variants import VariantUnavailable

# fla-train, jla-train: a peer's forward + backward of bench/training.py's loss; jla, jla-train: a
# JAX peer (jla_compare.py)
COMPARE_CHOICES = ("fla", "fla-train", "flashkda", "jla", "jla-train")


def torch_status() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as err:
        return False, f"torch is not importable ({err})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, ""


def versions() -> dict:
    found = {}
    for module in ("torch", "triton", "fla", "flash_kda"):
        try:
            found[module] = getattr(__import__(module), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - a broken optional import is reported as absent
            found[module] = None
    return found


def _tensors(case: Case, x: dict):
    import torch

    dev = torch.device("cuda")

    def t(name, dtype):
        return torch.from_numpy(x[name]).to(device=dev, dtype=dtype).contiguous()

    bf16, f32 = torch.bfloat16, torch.float32
    cu = torch.tensor(case.cu_seqlens(), dtype=torch.long, device=dev)
    return {
        "q": t("q", bf16), "k": t("k", bf16), "v": t("v", bf16), "g": t("g", bf16),
        "beta": t("beta", bf16), "A_log": t("A_log", f32), "dt_bias": t("dt_bias", f32),
        "state": t("state", bf16), "cu_seqlens": cu if case.layout == "varlen" else None,
    }


def build_fla(case: Case | DecodeCase, x: dict) -> tuple[Callable, dict]:
    if case.kind == "decode":
        return build_fla_decode(case, x)
    chunk_kda, d, kwargs, notes = _fla_prefill(case, x)

    def run():
        return chunk_kda(q=d["q"], k=d["k"], v=d["v"], g=d["g"], **kwargs)

    return run, notes


def build_fla_train(case: Case | DecodeCase, x: dict) -> tuple[Callable, dict]:
    """fla's forward + backward of bench/training.py's loss, sum(out * w) + sum(final * w'), by
    torch autograd w.r.t. q, k, v, g, beta, A_log, dt_bias (flat [H * 128]: fla's backward
    returns the bias gradient flat) and the f32 initial state; the gradients are reset before
    each call, so every call allocates and writes them."""
    if case.kind == "decode":
        raise VariantUnavailable("fla-train times a prefill's forward + backward")
    chunk_kda, d, kwargs, notes = _fla_prefill(case, x)
    if "beta" in notes or "dropped_kwargs" in notes:
        raise VariantUnavailable("this fla's chunk_kda lacks in-kernel options the training loss "
                                 f"differentiates through ({notes})")
    import torch

    from .training import loss_weight_arrays

    leaves = {name: d[name].clone().requires_grad_() for name in ("q", "k", "v", "g")}
    leaves |= {"beta": kwargs["beta"].clone().requires_grad_(),
               "A_log": kwargs["A_log"].clone().requires_grad_(),
               "dt_bias": kwargs["dt_bias"].reshape(-1).clone().requires_grad_(),
               "initial_state": kwargs["initial_state"].clone().requires_grad_()}
    rest = {key: value for key, value in kwargs.items() if key not in leaves}
    w_out, w_state = (torch.from_numpy(w).cuda() for w in loss_weight_arrays(case))

    def run():
        for leaf in leaves.values():
            leaf.grad = None
        out, final = chunk_kda(**leaves, **rest)
        loss = (out.float() * w_out).sum() + (final * w_state).sum()
        loss.backward()
        return loss

    return run, notes


def _fla_prefill(case: Case, x: dict):
    """(chunk_kda, tensors, keyword arguments but q / k / v / g, notes) of fla's prefill on the
    case's inputs; beta is among the keyword arguments."""
    ok, why = torch_status()
    if not ok:
        raise VariantUnavailable(why)
    try:
        from fla.ops.kda import chunk_kda
    except Exception as err:
        raise VariantUnavailable(f"fla.ops.kda.chunk_kda is not importable ({err})") from err
    import torch

    d = _tensors(case, x)
    params = inspect.signature(chunk_kda).parameters
    notes = {}
    kwargs = {
        "scale": 128**-0.5, "initial_state": d["state"].float(), "output_final_state": True,
        "use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True, "A_log": d["A_log"],
        "dt_bias": d["dt_bias"], "lower_bound": -5.0, "transpose_state_layout": True,
        "use_beta_sigmoid_in_kernel": True,
    }
    if d["cu_seqlens"] is not None:
        kwargs["cu_seqlens"] = d["cu_seqlens"]
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    dropped = [k for k in kwargs if k not in params and not accepts_any]
    for key in dropped:
        kwargs.pop(key)
    kwargs["beta"] = d["beta"]
    if "use_beta_sigmoid_in_kernel" in dropped:
        kwargs["beta"] = torch.sigmoid(d["beta"].float()).to(torch.bfloat16)  # post-sigmoid beta
        notes["beta"] = "sigmoid applied outside the timed call (this fla has no in-kernel sigmoid)"
    for required in ("use_gate_in_kernel", "A_log", "lower_bound"):
        if required in dropped:
            raise VariantUnavailable(
                f"this fla's chunk_kda has no {required}= (too old for KDA gates)")
    if dropped:
        notes["dropped_kwargs"] = dropped
    return chunk_kda, d, kwargs, notes


def build_fla_decode(case: DecodeCase, x: dict) -> tuple[Callable, dict]:
    """fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd on the case's pool, in place: the N
    sequences packed ([1, N*t, H, 128], cu_seqlens = t * arange(N + 1)), the pool [P, H, V, K]
    (state_v_first: jax_kda's layout) in the case's dtype, ssm_state_indices the case's rows.

    fla writes the state after every token to ssm_state_indices[n, i] (for t > 1 an [N, t]
    array, each row the sequence's pool row t times): it moves t state writes per step."""
    ok, why = torch_status()
    if not ok:
        raise VariantUnavailable(why)
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as err:
        raise VariantUnavailable("fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd is not "
                                 f"importable ({err})") from err
    import torch

    dev = torch.device("cuda")
    N, t = case.num_seqs, case.tokens_per_seq

    def packed(name):
        a = torch.from_numpy(x[name]).to(device=dev, dtype=torch.bfloat16)
        return a.reshape((1, N * t) + a.shape[2:]).contiguous()

    q, k, v, g, beta = (packed(name) for name in ("q", "k", "v", "g", "beta"))
    state_dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[case.state_dtype]
    pool = torch.from_numpy(x["pool"]).to(device=dev, dtype=state_dtype).contiguous()
    rows = torch.from_numpy(x["state_indices"]).to(device=dev, dtype=torch.int32)
    indices = rows if t == 1 else rows[:, None].expand(N, t).contiguous()
    kwargs = {
        "A_log": torch.from_numpy(x["A_log"]).to(dev),
        "dt_bias": torch.from_numpy(x["dt_bias"]).to(dev),
        "initial_state": pool, "scale": 128**-0.5, "output_final_state": True,
        "inplace_final_state": True, "state_v_first": True,
        "cu_seqlens": torch.arange(N + 1, dtype=torch.long, device=dev) * t,
        "ssm_state_indices": indices, "use_qk_l2norm_in_kernel": True,
        "use_gate_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "lower_bound": -5.0,
    }
    params = inspect.signature(fused_recurrent_kda_fwd).parameters
    missing = [key for key in ("inplace_final_state", "state_v_first", "ssm_state_indices",
                               "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "lower_bound")
               if key not in params]
    if missing:
        raise VariantUnavailable(f"this fla's fused_recurrent_kda_fwd has no {', '.join(missing)}")
    if "out" in params:  # written in place too, so the timed calls allocate nothing
        kwargs["out"] = torch.empty_like(v)
    notes = {"state": f"{case.state_dtype} pool updated in place"}
    if t > 1:
        notes["state_writes"] = f"fla writes the state after each of the {t} tokens"

    def run():
        return fused_recurrent_kda_fwd(q, k, v, g, beta, **kwargs)

    return run, notes


def build_flashkda(case: Case | DecodeCase, x: dict) -> tuple[Callable, dict]:
    if case.kind == "decode":
        raise VariantUnavailable("FlashKDA reads no state pool (no state indices); on decode "
                                 "cases the torch peer is fla's fused_recurrent_kda_fwd")
    ok, why = torch_status()
    if not ok:
        raise VariantUnavailable(why)
    try:
        import flash_kda
    except Exception as err:
        raise VariantUnavailable(f"flash_kda is not importable ({err})") from err
    import torch

    d = _tensors(case, x)
    out = torch.empty_like(d["v"])
    final_state = torch.empty_like(d["state"])
    extra = {"cu_seqlens": d["cu_seqlens"]} if d["cu_seqlens"] is not None else {}

    def run():
        flash_kda.fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], 128**-0.5, out,
                      A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=-5.0,
                      initial_state=d["state"], final_state=final_state, **extra)
        return out

    return run, {}


BUILDERS = {"fla": build_fla, "fla-train": build_fla_train, "flashkda": build_flashkda}
