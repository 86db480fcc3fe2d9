"""Builds tiny random Qwen3 models with HF transformers (the reference implementation, no download),
saves them in HF format with float32 logits for fixed inputs: the fixtures of
tests/checkpoint/test_hf_parity.py.

Needs torch and transformers (not project dependencies): run it on the GPU machine, or in any
environment that has them:  python scripts/make_parity_fixture.py tests/fixtures
"""

import json
import os
import re
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM


def deepseek_v3_tiny(moe_intermediate_size: int = 16) -> DeepseekV3ForCausalLM:
    """MLA with q/kv LoRA, YaRN (mscale), 1 dense + 2 MoE layers, 8 experts in 2 groups, top-2, a shared
    expert, and a non-zero e_score_correction_bias."""
    config = DeepseekV3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if "e_score_correction_bias" in buffer_name:
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


def qwen3_tiny(tie_word_embeddings: bool) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            rope_theta=10_000.0,
            max_position_embeddings=128,
            attention_bias=False,
            tie_word_embeddings=tie_word_embeddings,
        )
    )


CASES = {
    "qwen3_tiny": lambda: qwen3_tiny(False),
    "qwen3_tiny_tied": lambda: qwen3_tiny(True),
    "deepseek_v3_tiny": deepseek_v3_tiny,
    "deepseek_v3_tiny_int4": lambda: deepseek_v3_tiny(moe_intermediate_size=32),  # INT4 needs in % 32 == 0
    "deepseek_v3_tiny_fp8": deepseek_v3_tiny,
}


def pack_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """compressed-tensors pack-quantized, written from the format's description: symmetric group-32
    scales (max |w| / 7), q = clip(round(w / s), -8, 7), code q + 8, element k of each int32 in bits
    4k..4k+3. Returns (weight_packed int32 [out, in/8], weight_scale [out, in/32], dequantised float32)."""
    out, inner = w.shape
    groups = w.reshape(out, inner // 32, 32)
    scale = np.abs(groups).max(-1) / 7.0
    scale[scale == 0] = 1.0
    q = np.clip(np.round(groups / scale[..., None]), -8, 7).reshape(out, inner).astype(np.int64)
    codes = (q + 8).reshape(out, inner // 8, 8)
    words = sum(codes[..., k] << (4 * k) for k in range(8))
    dequantised = (q.reshape(out, inner // 32, 32) * scale[..., None]).reshape(out, inner).astype(np.float32)
    return words.astype(np.uint32).view(np.int32), scale.astype(np.float32), dequantised


def _golden_model(dequantised: dict, config: dict) -> DeepseekV3ForCausalLM:
    """HF's model with the dequantised weights: the source of a quantised fixture's golden logits."""
    with tempfile.TemporaryDirectory() as tmp:
        save_file(dequantised, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        json.dump(config, open(os.path.join(tmp, "config.json"), "w"))
        return DeepseekV3ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()


def write_int4_variant(dense_dir: str, out_dir: str) -> DeepseekV3ForCausalLM:
    """Re-saves a DeepSeek-V3 checkpoint with INT4 routed experts; returns HF's model loaded with the
    dequantised expert weights (golden logits check unpacking, not quantisation error)."""
    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    packed, dequantised = {}, dict(tensors)
    for name, w in tensors.items():
        if re.search(r"mlp\.experts\.\d+\..*\.weight$", name):
            words, scale, deq = pack_int4(w.astype(np.float32))
            base = name.removesuffix(".weight")
            packed.update(
                {
                    f"{base}.weight_packed": words,
                    f"{base}.weight_scale": scale,
                    f"{base}.weight_shape": np.array(w.shape, np.int64),
                }
            )
            dequantised[name] = deq
        else:
            packed[name] = w
    config = json.load(open(os.path.join(dense_dir, "config.json")))
    model = _golden_model(dequantised, config)
    os.makedirs(out_dir, exist_ok=True)
    save_file(packed, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "group_size": 32, "symmetric": True, "type": "int"},
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    return model


def write_fp8_variant(dense_dir: str, out_dir: str) -> DeepseekV3ForCausalLM:
    """Re-saves a DeepSeek-V3 checkpoint with block-FP8 (e4m3, 128 x 128 blocks, weight_scale_inv =
    block amax / 448) decoder-layer projections; golden logits from HF with the dequantised weights."""
    tensors = load_file(os.path.join(dense_dir, "model.safetensors"))
    stored, dequantised = {}, {}
    pattern = re.compile(
        r"model\.layers\.\d+\.(self_attn\.(q_a|q_b|kv_a_proj_with_mqa|kv_b|o)(_proj)?|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight$"
    )
    for name, w in tensors.items():
        if not pattern.match(name):
            stored[name] = torch.from_numpy(w)
            dequantised[name] = w
            continue
        t = torch.from_numpy(w.astype(np.float32))
        out, inner = t.shape
        rows, cols = -(-out // 128), -(-inner // 128)
        padded = torch.zeros(rows * 128, cols * 128)
        padded[:out, :inner] = t
        blocks = padded.view(rows, 128, cols, 128)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).view(rows * 128, cols * 128)[:out, :inner].to(torch.float8_e4m3fn)
        deq = q.float().view(out, inner) * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inner]
        stored[name], stored[name + "_scale_inv"] = q, scale.float()
        dequantised[name] = deq.numpy()
    config = json.load(open(os.path.join(dense_dir, "config.json")))
    model = _golden_model(dequantised, config)
    os.makedirs(out_dir, exist_ok=True)
    from safetensors.torch import save_file as save_torch

    save_torch(stored, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    return model


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    for name, build in CASES.items():
        model = build().eval().to(torch.float32)
        config = model.config
        with torch.no_grad():  # norms away from 1 so that the test sees them
            for module_name, param in model.named_parameters():
                if "norm" in module_name:
                    param.add_(0.2 * torch.randn_like(param))
        path = os.path.join(out_dir, name)
        if name.endswith(("_int4", "_fp8")):
            with tempfile.TemporaryDirectory() as dense_dir:
                model.save_pretrained(dense_dir, safe_serialization=True)
                write = write_int4_variant if name.endswith("_int4") else write_fp8_variant
                model = write(dense_dir, path)
        else:
            model.save_pretrained(path, safe_serialization=True)
        input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(input_ids).logits.float().numpy()
        np.savez(os.path.join(path, "reference.npz"), input_ids=input_ids.numpy().astype(np.int32), logits=logits)
        with open(os.path.join(path, "provenance.json"), "w") as f:
            json.dump(
                {
                    "script": "scripts/make_parity_fixture.py",
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "dtype": "float32",
                },
                f,
                indent=2,
            )
        print(f"wrote {path}: logits {logits.shape}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures")
