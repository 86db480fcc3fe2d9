"""Builds tiny random Qwen3 models with HF transformers (the reference implementation, no download),
saves them in HF format with float32 logits for fixed inputs: the fixtures of
tests/checkpoint/test_hf_parity.py.

Needs torch and transformers (not project dependencies): run it on the GPU machine, or in any
environment that has them:  python scripts/make_parity_fixture.py tests/fixtures
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

def deepseek_v3_tiny() -> DeepseekV3ForCausalLM:
    """MLA with q/kv LoRA, YaRN (mscale), 1 dense + 2 MoE layers, 8 experts in 2 groups, top-2, a shared
    expert, and a non-zero e_score_correction_bias."""
    config = DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            if "e_score_correction_bias" in buffer_name:
                buffer.copy_(0.3 * torch.randn_like(buffer))
    return model


def qwen3_tiny(tie_word_embeddings: bool) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=128,
        attention_bias=False, tie_word_embeddings=tie_word_embeddings,
    ))


CASES = {
    "qwen3_tiny": lambda: qwen3_tiny(False),
    "qwen3_tiny_tied": lambda: qwen3_tiny(True),
    "deepseek_v3_tiny": deepseek_v3_tiny,
}


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
        model.save_pretrained(path, safe_serialization=True)
        input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model(input_ids).logits.float().numpy()
        np.savez(os.path.join(path, "reference.npz"), input_ids=input_ids.numpy().astype(np.int32), logits=logits)
        with open(os.path.join(path, "provenance.json"), "w") as f:
            json.dump({"script": "scripts/make_parity_fixture.py", "torch": torch.__version__,
                       "transformers": transformers.__version__, "dtype": "float32"}, f, indent=2)
        print(f"wrote {path}: logits {logits.shape}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures")
