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
from transformers import Qwen3Config, Qwen3ForCausalLM

CASES = {
    "qwen3_tiny": dict(tie_word_embeddings=False),
    "qwen3_tiny_tied": dict(tie_word_embeddings=True),
}


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    for name, extra in CASES.items():
        config = Qwen3Config(
            vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10_000.0, max_position_embeddings=128,
            attention_bias=False, **extra,
        )
        model = Qwen3ForCausalLM(config).eval().to(torch.float32)
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
