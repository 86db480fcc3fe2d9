"""Fixtures of the kernel tests."""

import types

import pytest


@pytest.fixture
def hopper(monkeypatch):
    """Lower Triton (pl.pallas_call) kernels for an H100 / H200 (compute capability 9.0) on a machine without
    a GPU: the Triton lowering asks the GPU for its capability, which is answered here."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    if not hasattr(registration, "gpu_info_lib"):
        pytest.skip("jax moved the GPU query of the Triton lowering")
    info = types.SimpleNamespace(compute_capability=90)
    monkeypatch.setattr(registration, "gpu_info_lib", types.SimpleNamespace(get_gpu_info=lambda: info))
