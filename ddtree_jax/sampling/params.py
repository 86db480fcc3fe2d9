"""Per-row sampling parameters: temperature, top-k, top-p, min-p (a batch may mix greedy and sampled rows)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_kernels.sampling_reference import valid_params


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Arrays of shape [B]; row b samples from `processed_probs` with these settings.

    Attributes:
      temperature: float32 [B], >= 0; 0 means greedy (one-hot on the argmax, ties to the lowest id).
      top_k: int32 [B], >= 0; 0 (or >= V) means off.
      top_p: float32 [B], in (0, 1]; 1 means off.
      min_p: float32 [B], in [0, 1); 0 means off.

    Construction validates (ValueError naming the row and value) whenever all four fields are concrete
    arrays (numpy or jax, not traced) of one shape [B]; jax rebuilds this pytree with tracers and with arbitrary leaves
    (shape structs, shardings, ...), which are not checked. There is no unvalidated path.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    def __post_init__(self):
        leaves = (self.temperature, self.top_k, self.top_p, self.min_p)
        if any(isinstance(x, (list, tuple)) for x in leaves):  # never a pytree leaf: a direct call with sequences
            raise ValueError(
                "SamplingParams fields must be arrays [B]; build from scalars or sequences with SamplingParams.create("
                f"batch, ...), got {tuple(type(x).__name__ for x in leaves)}"
            )
        if all(_is_concrete_array(x) for x in leaves) and len({x.shape for x in leaves}) == 1 and leaves[0].ndim == 1:
            self.validate()

    @classmethod
    def create(cls, batch: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
        """Broadcasts scalars or [B] sequences to [B] arrays, then validates (eagerly, at construction)."""

        def as_row(name, value, dtype):
            if np.asarray(value).dtype == bool:
                raise ValueError(f"{name} must be numbers, got a boolean {value!r}")
            arr = np.asarray(value, dtype=np.float64)
            if arr.ndim == 0:
                arr = np.full((batch,), arr)
            if arr.shape != (batch,):
                raise ValueError(f"{name} must be a scalar or have shape [B] = ({batch},), got shape {arr.shape}")
            if dtype == np.int32 and not np.array_equal(arr, np.round(arr)):
                raise ValueError(f"top_k must be integers, got {arr.tolist()}")
            if dtype == np.int32 and (np.abs(arr) > np.iinfo(np.int32).max).any():
                row = int(np.argmax(np.abs(arr) > np.iinfo(np.int32).max))
                raise ValueError(f"top_k[{row}] = {int(arr[row])} does not fit int32 (0 or any k >= V turns top-k off)")
            out = arr.astype(dtype)
            underflow = (arr != 0) & (out == 0)
            if underflow.any():  # e.g. temperature 1e-46 would become 0: greedy, silently
                row = int(np.argmax(underflow))
                raise ValueError(
                    f"{name}[{row}] = {float(arr[row])!r} rounds to 0 in {np.dtype(dtype).name}; give 0 or a larger value"
                )
            return out

        return cls(
            temperature=jnp.asarray(as_row("temperature", temperature, np.float32)),
            top_k=jnp.asarray(as_row("top_k", top_k, np.int32)),
            top_p=jnp.asarray(as_row("top_p", top_p, np.float32)),
            min_p=jnp.asarray(as_row("min_p", min_p, np.float32)),
        )

    def as_rows(self) -> jax.Array:
        """f32 [B, 4]: (temperature, top_k, top_p, min_p) per row, the layout the fused kernels take."""
        return jnp.stack([self.temperature, self.top_k.astype(jnp.float32), self.top_p, self.min_p], axis=-1)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    def in_range(self) -> jax.Array:
        """bool [B]: the rows `validate` accepts, traceable (`ddtree_kernels.sampling_reference.valid_params`):
        under jit the samplers and verifiers mark the other rows invalid instead of raising."""
        return valid_params(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def is_greedy(self) -> jax.Array:
        """bool [B]: rows decoded greedily (temperature 0)."""
        return self.temperature == 0

    def validate(self) -> SamplingParams:
        """Raises ValueError naming the first bad row and value; returns self."""
        t, k, p, m = (np.asarray(x) for x in (self.temperature, self.top_k, self.top_p, self.min_p))
        checks = [
            ("temperature", t, ~np.isfinite(t) | (t < 0), "must be finite and >= 0 (0 = greedy)"),
            ("top_k", k, k < 0, "must be >= 0 (0 = off)"),
            ("top_p", p, ~np.isfinite(p) | (p <= 0) | (p > 1), "must be in (0, 1] (1 = off)"),
            ("min_p", m, ~np.isfinite(m) | (m < 0) | (m >= 1), "must be in [0, 1) (0 = off)"),
        ]
        if not np.issubdtype(k.dtype, np.integer):  # a float top_k would fail as a gather index, not name itself
            raise ValueError(f"top_k must hold integers, got dtype {k.dtype}")
        shapes = {a.shape for a in (t, k, p, m)}
        if len(shapes) != 1 or len(shapes.pop()) != 1:
            raise ValueError(f"all sampling params must have one shape [B], got {[a.shape for a in (t, k, p, m)]}")
        for name, values, bad, rule in checks:
            if bad.any():
                row = int(np.argmax(bad))
                raise ValueError(f"{name}[{row}] = {values[row].item()!r} {rule}")
        return self


def _is_concrete_array(x) -> bool:
    """A numpy array, or a jax array that is not traced and can be read on this host, of a numeric dtype."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
            return False
    elif not isinstance(x, np.ndarray):
        return False
    return np.issubdtype(x.dtype, np.number) or x.dtype == jnp.bfloat16


jax.tree_util.register_dataclass(SamplingParams, data_fields=["temperature", "top_k", "top_p", "min_p"], meta_fields=[])
