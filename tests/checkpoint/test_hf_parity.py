"""Parity with HF transformers, the reference implementation of Qwen3.

The fixtures in tests/fixtures/qwen3_tiny* were written by scripts/make_parity_fixture.py with
transformers (float32, random weights, norms perturbed away from 1): the HF directory plus the
logits of transformers' forward for fixed input ids.
"""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax.checkpoint import load_hf
from ddtree_jax.config import DeepSeekV3Config
from ddtree_jax.models import deepseek_v3, qwen3
from ddtree_kernels.quant import Fp8BlockWeight, Int4Weight

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize(
    "name", ["qwen3_tiny", "qwen3_tiny_tied", "deepseek_v3_tiny", "deepseek_v3_tiny_int4", "deepseek_v3_tiny_fp8"]
)
def test_forward_logits_match_transformers(name):
    """deepseek_v3_tiny: MLA with q/kv LoRA, YaRN with mscale, dense + MoE layers, grouped routing with a
    non-zero correction bias, a shared expert. deepseek_v3_tiny_int4: the same with compressed-tensors
    pack-quantized INT4 routed experts; deepseek_v3_tiny_fp8: block-FP8 (e4m3, 128 x 128) projections and
    experts. Quantised variants: golden logits from HF running the dequantised weights
    (scripts/make_parity_fixture.py)."""
    path = FIXTURES / name
    config, params = load_hf(str(path), dtype=jnp.float32)
    assert config.tie_word_embeddings == ("tied" in name)
    ref = np.load(path / "reference.npz")
    model = deepseek_v3 if isinstance(config, DeepSeekV3Config) else qwen3
    if name.endswith("int4"):
        assert config.expert_format == "int4"
        assert isinstance(params["moe_layers"]["expert_down"], Int4Weight)  # kept packed in memory
        assert params["moe_layers"]["expert_down"].packed.dtype == jnp.int32
    if name.endswith("fp8"):
        for stack in ("dense_layers", "moe_layers"):
            assert isinstance(params[stack]["o_proj"], Fp8BlockWeight)  # kept in FP8 with its block scales
        assert params["moe_layers"]["expert_gate"].weight.dtype == jnp.float8_e4m3fn
    logits = np.asarray(model.forward_logits(config, params, jnp.asarray(ref["input_ids"])))
    err = np.max(np.abs(logits - ref["logits"])) / np.max(np.abs(ref["logits"]))
    provenance = json.loads((path / "provenance.json").read_text())
    assert err <= 1e-4, f"max |ours - ref| / max |ref| = {err:.2e} vs transformers {provenance['transformers']}"


@pytest.mark.parametrize("name", ["deepseek_v3_tiny", "deepseek_v3_tiny_int4", "deepseek_v3_tiny_fp8"])
def test_absorbed_latent_cache_path_matches_transformers(name):
    """The absorbed MLA path (latent cache, prefill in two chunks) against the same HF logits."""
    path = FIXTURES / name
    config, params = load_hf(str(path), dtype=jnp.float32)
    ref = np.load(path / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    cache = deepseek_v3.create_cache(config, 2, 16, jnp.float32)
    first, _, cache = deepseek_v3.prefill(config, params, cache, ids[:, :7], jnp.array([7, 7], jnp.int32))
    second, _, _ = deepseek_v3.prefill(config, params, cache, ids[:, 7:], jnp.array([5, 5], jnp.int32))
    logits = np.concatenate([np.asarray(first), np.asarray(second)], axis=1)
    err = np.max(np.abs(logits - ref["logits"])) / np.max(np.abs(ref["logits"]))
    assert err <= 1e-4, f"{err:.2e}"
