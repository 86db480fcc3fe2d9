"""Shared fixtures of the sharding tests: the tiny K2 target's parameters (INT4 experts) and a 2 x 4 mesh
of the 8 fake CPU devices (tests/conftest.py)."""

import jax
import numpy as np
import pytest

from ddtree_jax.models import deepseek_v3
from ddtree_jax.sharding.mesh import make_mesh
from ddtree_kernels.quant import quantize_int4
from tests.sharding.tiny_k2 import CONFIG


@pytest.fixture(scope="module")
def params():
    p = deepseek_v3.init_params(CONFIG, jax.random.key(0), norm_jitter=0.1)
    for name in ("expert_gate", "expert_up", "expert_down"):
        p["moe_layers"][name] = quantize_int4(np.asarray(p["moe_layers"][name]))
    return p


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(model=4, data=2)
