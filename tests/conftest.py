"""Test session setup: CPU JAX with 8 virtual devices (for the sharding tests), quiet Pallas warnings."""

import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\._src\.pallas.*")
