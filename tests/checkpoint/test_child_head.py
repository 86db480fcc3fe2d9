"""The child head on disk (`checkpoint.child_head`): a float32 / bfloat16 round trip, and clear errors."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ddtree_jax.checkpoint import CheckpointError, CheckpointNotFoundError
from ddtree_jax.checkpoint.child_head import load_child_head, save_child_head
from ddtree_jax.config import ChildHeadConfig
from ddtree_jax.models import child_head


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_round_trip(tmp_path, dtype):
    config = ChildHeadConfig(hidden_size=16, inner_size=8)
    params = child_head.init_params(config, jax.random.key(0))
    params = {**params, "out_proj": jax.random.normal(jax.random.key(1), params["out_proj"].shape)}
    save_child_head(str(tmp_path), config, params, dtype=dtype)
    loaded_config, loaded = load_child_head(str(tmp_path))
    assert loaded_config == config
    for name in ("in_proj", "out_proj"):
        want = np.asarray(params[name], np.float32).astype(dtype).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(loaded[name]), want)
        assert loaded[name].dtype == jnp.float32


def test_errors_name_the_file_and_the_value(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="config.json does not exist"):
        load_child_head(str(tmp_path))
    config = ChildHeadConfig(hidden_size=16, inner_size=8)
    save_child_head(str(tmp_path), config, child_head.init_params(config, jax.random.key(0)))
    path = os.path.join(tmp_path, "config.json")
    raw = json.load(open(path))
    json.dump({**raw, "inner_size": 4}, open(path, "w"))
    with pytest.raises(
        CheckpointError, match=r"tensor 'in_proj.weight' has shape \(8, 32\), the config says \(4, 32\)"
    ):
        load_child_head(str(tmp_path))
    json.dump({**raw, "architectures": ["Qwen3ForCausalLM"]}, open(path, "w"))
    with pytest.raises(CheckpointError, match="architectures must be"):
        load_child_head(str(tmp_path))
    json.dump({**raw, "inner_size": 0}, open(path, "w"))
    with pytest.raises(CheckpointError, match="inner_size must be an integer >= 1, got 0"):
        load_child_head(str(tmp_path))
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        save_child_head(str(tmp_path), config, child_head.init_params(config, jax.random.key(0)), dtype=np.float16)


def test_damaged_files_and_non_finite_tensors_are_named(tmp_path):
    """A config that is not a JSON object, a truncated safetensors file, a NaN tensor (with check_finite, as the CLI
    loads): CheckpointErrors naming the file (were an AttributeError / SafetensorError traceback, and a NaN head
    that silently made DDTree an AR loop)."""
    config = ChildHeadConfig(hidden_size=16, inner_size=8)
    params = child_head.init_params(config, jax.random.key(0))
    save_child_head(str(tmp_path), config, params)
    config_path, weights_path = (os.path.join(tmp_path, name) for name in ("config.json", "model.safetensors"))
    raw = open(config_path).read()
    for text, message in (("[]", "holds a JSON list, not an object"), ("{bad", "is not valid JSON")):
        open(config_path, "w").write(text)
        with pytest.raises(CheckpointError, match=f"{config_path} {message}"):
            load_child_head(str(tmp_path))
    open(config_path, "w").write(raw)
    whole = open(weights_path, "rb").read()
    open(weights_path, "wb").write(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match=weights_path):
        load_child_head(str(tmp_path))
    save_child_head(str(tmp_path), config, {**params, "out_proj": params["out_proj"].at[1, 2].set(jnp.nan)})
    load_child_head(str(tmp_path))  # unchecked by default, as load_weights
    with pytest.raises(CheckpointError, match=r"tensor 'out_proj.weight' in .* holds 1 non-finite value"):
        load_child_head(str(tmp_path), check_finite=True)
