"""The demo (python -m jax_kda): it runs on CPU, and it refuses to fall back to the reference
silently when the NVIDIA driver sees a GPU that JAX does not."""

import pytest

from jax_kda import __main__ as demo


def test_demo_refuses_a_gpu_jax_cannot_see(monkeypatch):
    monkeypatch.setattr(demo, "driver_gpus", lambda: ["GPU 0: NVIDIA H200 (UUID: GPU-0)"])
    with pytest.raises(SystemExit, match=r"JAX sees no GPU .*jax-kda\[cuda13\]"):
        demo.main(["--seqlen", "32", "--heads", "1"])


def test_demo_runs_the_reference_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(demo, "driver_gpus", list)
    demo.main(["--seqlen", "64", "--heads", "1", "--check-tokens", "64"])
    printed = capsys.readouterr().out
    assert "pure-JAX reference" in printed and "-> OK" in printed
