"""The path-conditioned child head on disk (`models.child_head`): DIR/config.json + DIR/model.safetensors.

config.json: {"architectures": ["DDTreeChildHead"], "hidden_size", "inner_size", "torch_dtype"}; tensors
"in_proj.weight" [inner, 2 hidden] and "out_proj.weight" [hidden, inner] ([out, in], as the models' weights).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree_jax.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from ddtree_jax.checkpoint.hf_config import read_config
from ddtree_jax.checkpoint.hf_weights import check_finite_array, read_safetensors_header
from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.models import child_head

ARCHITECTURE = "DDTreeChildHead"
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16"}


def save_child_head(directory: str, config: ChildHeadConfig, params: dict, dtype=np.float32) -> None:
    """Writes the head (its tensors cast to `dtype`, float32 or bfloat16)."""
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    os.makedirs(directory, exist_ok=True)
    tensors = {f"{name}.weight": np.asarray(params[name], np.float32).astype(dtype) for name in ("in_proj", "out_proj")}
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": [ARCHITECTURE],
                "hidden_size": config.hidden_size,
                "inner_size": config.inner_size,
                "torch_dtype": _DTYPE_NAMES[dtype],
            },
            f,
            indent=2,
        )


def load_child_head(directory: str, dtype=jnp.float32, *, check_finite: bool = False) -> tuple[ChildHeadConfig, dict]:
    """(config, params in `dtype`) of a head written by `save_child_head`; CheckpointError naming the file and
    the key or tensor that is wrong (a config that is not a JSON object, a damaged safetensors file, a missing or
    mis-shaped tensor; with check_finite, a tensor holding NaN / inf, as `load_weights`)."""
    config_path = os.path.join(directory, "config.json")
    weights_path = os.path.join(directory, "model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise CheckpointNotFoundError(
                f"{path} does not exist (a child head directory holds config.json and model.safetensors)"
            )
    raw = read_config(config_path)  # CheckpointError naming the file unless a JSON object
    read_safetensors_header(weights_path)  # ... and for a truncated file or a damaged header
    if raw.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(
            f"{config_path}: architectures must be [{ARCHITECTURE!r}], got {raw.get('architectures')!r}"
        )
    try:
        config = ChildHeadConfig(hidden_size=raw["hidden_size"], inner_size=raw["inner_size"])
    except (KeyError, ValueError, TypeError) as err:
        raise CheckpointError(f"{config_path}: {err}") from err
    shapes = {name: shape for name, (shape, _) in child_head.param_shapes(config).items()}
    params = {}
    with safe_open(weights_path, framework="numpy") as f:
        for name, shape in shapes.items():
            key = f"{name}.weight"
            if key not in f.keys():
                raise CheckpointError(f"{weights_path}: tensor {key!r} is missing")
            value = f.get_tensor(key)
            if value.shape != shape:
                raise CheckpointError(
                    f"{weights_path}: tensor {key!r} has shape {value.shape}, the config says {shape}"
                )
            if check_finite:
                check_finite_array(value, key, weights_path)
            params[name] = jnp.asarray(value.astype(np.float32), dtype)
    return config, params
