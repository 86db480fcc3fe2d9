"""What every kernel of this package plans with: how many programs fill the GPU, the shared memory a
program may use, the precision of its dots, and whether it runs compiled or interpreted.

Precision contract (every kernel here, and its `*_reference` twin): float32 inputs are computed at
float32 (IEEE dots: `dot_precision(jnp.float32)` is `Precision.HIGHEST`, which Triton lowers to its IEEE
input precision, and XLA to full float32 instead of TF32); bfloat16 inputs use the tensor cores' bf16
path with float32 accumulation, the fast path. Softmax statistics and sums are float32 in both.

Shared memory: `pipelined_bytes` is the planning estimate of one program's shared memory, every
pipelined tile counted once per stage plus the tiles held for the whole loop. It is an upper bound of
what Triton asked the H200 for in the cases measured (Triton keeps fewer stage buffers than
`num_stages` on some loops); tilings are chosen so that it fits `SMEM_LIMIT_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

TARGET_PROGRAMS = 264  # programs per launch worth filling: two per SM of an H200 (132 SMs)
SMEM_LIMIT_BYTES = 232_448  # shared memory one block may opt into on Hopper (227 KiB; the H200 reports it)

Tile = tuple[Sequence[int], object]  # (shape, dtype)


def default_interpret(interpret: bool | None) -> bool:
    """Interpret mode unless compiled for a GPU: the CPU backend runs every kernel interpreted."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def dot_precision(dtype) -> lax.Precision:
    """The dot precision of the contract: HIGHEST (IEEE float32) for float32 inputs, DEFAULT otherwise."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def tile_bytes(shape: Sequence[int], dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def pipelined_bytes(stage_tiles: Iterable[Tile], num_stages: int, resident_tiles: Iterable[Tile] = ()) -> int:
    """Planned shared memory of one program: `num_stages` copies of each tile loaded per loop step, plus
    the tiles held for the whole loop (e.g. a query tile)."""
    per_stage = sum(tile_bytes(shape, dtype) for shape, dtype in stage_tiles)
    return num_stages * per_stage + sum(tile_bytes(shape, dtype) for shape, dtype in resident_tiles)


def fits(nbytes: int, limit: int = SMEM_LIMIT_BYTES) -> bool:
    return nbytes <= limit
