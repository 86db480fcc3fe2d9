"""Skinny (few-token) weight-streaming matmul as a Mosaic GPU (Hopper: TMA + wgmma) Pallas kernel.

  y = x @ W^T,  x bf16 [M, K] (M = 1 .. 256 token rows),  W bf16 [N, K] ("out, in", the HF layout),  y bf16 [M, N]
  (float32 accumulation).

Why: at M <= 128 the product is a stream of W through HBM (intensity ~M FLOP/byte, under the H200's ~206 ridge);
XLA's GEMMs at M = 17 .. 128 stream it at about half the copy bandwidth, this kernel aims at the copy bandwidth.

Kernel (`plgpu.kernel`, grid (N / block_n, splits), "swap A/B"):
  operands    the weight is the wgmma A operand: its rows (output features) are wgmma's M dimension, a
              [64 g, block_k] tile of W is K-major as W is stored; the activation is the B operand: the x tile
              [M_pad, block_k] (K-major) read transposed, so wgmma's N dimension is the token rows, padded to
              M_pad = a multiple of 8 (<= 256) by the wrapper (zeros). Each compute warpgroup accumulates
              y^T [64 g, M_pad] in float32 registers (g = 1 or 2 wgmma M groups: M_pad g / 2 registers a
              thread).
  CTA         one stripe of block_n weight rows (`wgs` compute warpgroups of block_n / wgs rows each) and one
              K range (K / splits); a memory warpgroup TMA-loads each step's W tiles (one per compute WG) and
              the x tile into a ring of `stages` shared-memory slots (128-byte swizzle) and reloads a slot once
              every compute WG's wgmma on it completed (`consumed` barriers). W is read exactly once over the
              grid; x (M_pad x K, L2-resident) is re-read by every stripe.
  split-K     when the N / block_n stripes leave SMs idle, `splits` CTAs may share a stripe's K: each writes
              float32 partials [splits, M, N] and the wrapper sums them (one small XLA op, 2 x 4 x splits x
              M x N bytes against W's 2 N K); splits = 1 writes bf16 y directly, no op after the kernel.
  transpose   in the kernel: the accumulator (y^T tile, WGMMA layout) is relaid out to WGMMA_TRANSPOSED (a
              register shuffle) and stored through a transposed view of an [M_pad, rows] shared-memory tile
              (a `plgpu.RefUnion` with the ring, free once every product of the CTA is done), which a TMA
              store copies to y[:, stripe] (only the M real rows: no slice after the call).
Defaults per shape: `plan`, the fastest tiling under a cost model (`estimate_seconds`) fitted to an H200 sweep.

Measured on the H200 (benchmarks/bench_skinny_mgpu.py: device time of a call under the profiler, fresh W and
x each call; the first plan, before the sweep retuned it): correct on every Qwen3-8B shape (max error
<= 3.6e-3 of max |y|); the LM head at 4.2-4.5 TB/s (0.92-1.05 of the 4.3 TB/s copy roofline, XLA alike);
gate/up 27-32 us (3.3-3.7 TB/s, 1.04-1.17x XLA); down at M = 65 1.25x XLA; q/o at M = 65 15.1 us with the
sweep's best tiling, today's default (XLA 16.3: both ~2.2 TB/s, far from the 7.8 us roofline); k/v (8 MB)
slower than XLA (7.4 against 3.9 us at M = 1). What limits the 33 MB weights: a CTA streams ~(W bytes in
flight) / 2.2 us (35-58 GB/s an SM), so a grid of 64 stripes streams ~2.2-3.7 TB/s, and the split-K sum that
would fill the other SMs costs 5-11 us as a separate op. Next steps: the split-K sum inside the kernel
(cluster DSMEM or a last-CTA reduction), a deferred slot release (wgmma_wait(1): M = 128 is wgmma-bound at
64 CTAs), and fusing small weights (q/k/v) into one product.

Constraints (ValueError otherwise): x [M, K] and w [N, K] bf16, 1 <= M <= 256; N % block_n == 0 and
K % (block_k * splits) == 0 (W is never copied or padded); block_n in (64, 128, 256) (256 needs M_pad <= 128:
the accumulator's registers), block_k in (64, 128, 256), stages >= 1. Qwen3-8B divides everywhere (the LM head's
N = 151936 = 128 x 1187).

Interpret mode (CPU; `interpret=None` picks it there): the same kernel. It runs a CTA's warpgroups as threads
blocked inside host callbacks: start the process with NPROC=64 (`mosaic_common.INTERPRET_NPROC`), or a waiting
warpgroup can starve the others (a hang).

`skinny_matmul_reference` is the twin (plain XLA `jnp.dot`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ddtree_kernels.mosaic_common import INTERPRET_PARAMS, feed_ring, layer_index
from ddtree_kernels.tiling import SMEM_LIMIT_BYTES, default_interpret

NUM_SMS = 132  # H200
MAX_ROWS = 256  # wgmma's N dimension (the padded token rows) is at most 256
ROW_ALIGN = 8  # wgmma N granularity: the token rows are padded to a multiple of 8
BLOCK_NS = (64, 128, 256)
BLOCK_KS = (64, 128, 256)  # multiples of the 64-element (128-byte) swizzle span
MAX_STAGES = 8
SMEM_BUDGET = 200 * 1024  # the pipeline ring, which the output tile reuses (the H200 allows 227 KiB a block)
MAX_ACC_ELEMENTS = 128 * 128  # per compute warpgroup: 128 float32 accumulator registers a thread
_TILED = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def padded_rows(m: int) -> int:
    return -(-m // ROW_ALIGN) * ROW_ALIGN


def compute_wgs(block_n: int) -> int:
    """Compute warpgroups of a CTA: one per 64 rows up to two (block_n 256: two of 128 rows, 2 wgmma M groups)."""
    return 1 if block_n == 64 else 2


def acc_fits(m: int, block_n: int) -> bool:
    """A compute warpgroup's float32 accumulator [block_n / wgs, M_pad] fits MAX_ACC_ELEMENTS."""
    return (block_n // compute_wgs(block_n)) * padded_rows(m) <= MAX_ACC_ELEMENTS


def stage_bytes(m: int, block_n: int, block_k: int) -> int:
    """One pipeline slot: the W tile [block_n, block_k] and the x tile [M_pad, block_k], bf16."""
    return (block_n + padded_rows(m)) * block_k * 2


def smem_bytes(m: int, block_n: int, block_k: int, stages: int, splits: int) -> int:
    """Shared memory of a CTA: the ring of `stages` slots, which the output tile [M_pad, block_n] (float32
    partials when splits > 1, else bf16) reuses once the last product is done (a `plgpu.RefUnion`); barriers
    not counted."""
    out = padded_rows(m) * block_n * (4 if splits > 1 else 2)
    return max(stages * stage_bytes(m, block_n, block_k), out)


def fit_stages(m: int, block_n: int, block_k: int, splits: int, k: int) -> int:
    """The most pipeline slots that fit SMEM_BUDGET (<= MAX_STAGES, <= the K steps of a split, >= 1)."""
    room = SMEM_BUDGET // stage_bytes(m, block_n, block_k)
    return max(1, min(MAX_STAGES, k // (block_k * splits), room))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The cost model of `plan`, fitted to this kernel's first H200 sweep (benchmarks/bench_skinny_mgpu.py --sweep:
# q/o at M = 65 and 128, gate/up at M = 65, 24 tilings each, device time under the profiler; it ranks them as
# measured, e.g. q/o M = 65: 64 x 1 split 15.1 us (model 14.1), 128 x 2 16.1 (15.9), 128 x 4 17.0 (16.7)).
HBM_LATENCY_S = 2.2e-6  # W bytes in flight per SM / its stream rate (q/o: 80 KiB -> 35 GB/s, 128 KiB -> 58 GB/s)
HBM_BYTES_PER_S = 4.5e12  # all SMs streaming (the LM head: 4.5 TB/s); a CTA gets at most its share
WG_FLOPS = 3.2e12  # wgmma rate of one compute warpgroup as this kernel issues it (q/o, M = 128, 64 CTAs: 22 us)
SPLIT_SUM_S = 5e-6  # the split-K sum: one more XLA op (launch gap included) ...
SPLIT_SUM_BYTES_PER_S = 1e12  # ... plus its float32 partials [splits, M, N] written and read back


def estimate_seconds(m: int, n: int, k: int, block_n: int, block_k: int, stages: int, splits: int) -> float:
    """The modelled device time of one call (see `plan`): waves of CTAs, each streaming its W stripe at
    min(W bytes in flight / HBM_LATENCY_S, its share of HBM_BYTES_PER_S) or issuing its wgmmas at WG_FLOPS a
    compute warpgroup, whichever is slower, plus the split-K sum."""
    stripes, steps = n // block_n, k // (block_k * splits)
    ctas = stripes * splits
    active = min(ctas, NUM_SMS)
    in_flight = min(stages, steps) * block_n * block_k * 2
    rate = min(in_flight / HBM_LATENCY_S, HBM_BYTES_PER_S / active)
    stream = block_n * (k // splits) * 2 / rate
    mma = 2 * block_n * padded_rows(m) * (k // splits) / (compute_wgs(block_n) * WG_FLOPS)
    seconds = -(-ctas // NUM_SMS) * max(stream, mma)
    if splits > 1:
        seconds += SPLIT_SUM_S + splits * m * n * 4 / SPLIT_SUM_BYTES_PER_S
    return seconds


def plan(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, stages, splits) for an [M, K] x [N, K]^T product: of block_n 128 / 64 and every
    split count that divides the K steps (>= 2 steps a split), the tiling `estimate_seconds` finds fastest
    (a later candidate must win by >= 3%: wider stripes re-read x less, fewer splits launch less).

    What the H200 sweep showed, which the model encodes: a CTA streams W at about (W bytes in flight) / 2.2 us,
    so the ring fills SMEM_BUDGET (`fit_stages`) and wider W tiles stream faster (block_n 128: 58 GB/s an SM
    against 35 at 64, at M = 65); but the split-K sum costs 5-11 us (an XLA op and the float32 partials), more
    than filling idle SMs saves at q/o's 32 MB: q/o takes 64 stripes of 64 rows and no split at M <= 65 (15.1
    us against 16.7 for 32 x 4 splits of 128), 2 splits at M = 128 (its 64 CTAs are then wgmma-bound: 22 ->
    14 us); gate/up and the LM head stream 96 and 1187 stripes of 128 (64 would make 1.45 waves of 192);
    down (3x q/o's K) 64 x 2 splits; k/v (8 MB) 4-8 splits. block_k 128: as fast as or faster than 64
    at equal stages x bytes in every measured pair (fewer barrier round trips); 256 leaves 2 stages at M = 65."""
    block_k = 128 if k % 128 == 0 else 64
    best = None
    for block_n in (128, 64):
        if n % block_n or not acc_fits(m, block_n):
            continue
        k_steps = k // block_k
        for splits in _divisors(k_steps):
            if k_steps // splits < 2 and splits > 1:
                break
            stages = fit_stages(m, block_n, block_k, splits, k)
            seconds = estimate_seconds(m, n, k, block_n, block_k, stages, splits)
            if best is None or seconds < 0.97 * best[0]:
                best = (seconds, (block_n, block_k, stages, splits))
    if best is None:  # M > 256: no accumulator fits (`skinny_matmul` refuses it)
        return 64, block_k, 1, 1
    return best[1]


def _kernel(
    layer_ref,
    x_ref,
    w_ref,
    o_ref,
    *,
    smem,
    loaded,
    consumed,
    done,
    rows: int,
    wgs: int,
    block_k: int,
    k_steps: int,
    stages: int,
    num_layers: int,
):
    # GMEM: layer_ref i32 [1] the layer read (clamped here, `layer_index`); x_ref bf16 [M_pad, K] (zero rows past
    #   M); w_ref bf16 [L, N, K] every layer's weights (L = 1 for one weight), read in place; o_ref [splits, M, N]
    #   (float32 partials when splits > 1, else bf16 y).
    # SMEM (`smem`, a union of the ring and the output tile):
    #   ring: w_smem bf16 [stages, wgs, rows, block_k] each slot's W tile, one [rows, block_k] per compute WG;
    #     x_smem bf16 [stages, M_pad, block_k] each slot's x tile (both 128-byte swizzled);
    #   o_smem [wgs, M_pad, rows] each compute WG's output tile (y, not y^T), written after every product;
    #   loaded[stages] (wgs + 1 TMA arrivals: the W tiles and the x tile); consumed[stages] (wgs arrivals:
    #   each compute WG's wgmma on the slot completed); done (wgs arrivals: every product of the CTA is
    #   done, the ring may be overwritten by the output tiles).
    (w_smem, x_smem), o_smem = smem
    stripe, split, wg = lax.axis_index("n"), lax.axis_index("split"), lax.axis_index("wg")
    n0 = stripe * (wgs * rows)
    k0 = split * (k_steps * block_k)

    @pl.when(wg == wgs)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        layer = layer_index(layer_ref[0], num_layers)  # here, not as an XLA fusion beside every call

        def load(i, slot):
            cols = pl.ds(k0 + i * block_k, block_k)
            for w in range(wgs):
                rows_w = pl.ds(n0 + w * rows, rows)
                plgpu.copy_gmem_to_smem(w_ref.at[layer, rows_w, cols], w_smem.at[slot, w], loaded.at[slot])
            plgpu.copy_gmem_to_smem(x_ref.at[:, cols], x_smem.at[slot], loaded.at[slot])

        feed_ring(load, k_steps, stages, consumed)

    @pl.when(wg < wgs)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        def product(acc_ref):  # acc_ref f32 [rows, M_pad]: y^T of this warpgroup's rows
            @pl.loop(0, k_steps)
            def _step(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.wgmma(acc_ref, w_smem.at[slot, wg], x_smem.at[slot].transpose((1, 0)))
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(consumed.at[slot])

            return acc_ref[...]

        acc = pl.run_scoped(product, plgpu.ACC((rows, x_smem.shape[1]), jnp.float32))
        if wgs > 1:  # the output tiles overlay the ring: wait until no warpgroup reads it
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
        out = o_smem.at[wg]  # [M_pad, rows]
        # y^T [rows, M_pad] in registers -> the transposed layout (a register shuffle), whose 2-element vectors
        # run along the rows: contiguous in y's [M_pad, rows] tile
        out.transpose((1, 0))[...] = plgpu.layout_cast(acc.astype(out.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        m = o_ref.shape[1]
        plgpu.copy_smem_to_gmem(out.at[:m], o_ref.at[split, :, pl.ds(n0 + wg * rows, rows)])
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "stages", "splits", "interpret"))
def _skinny_matmul(x, w, layer, *, block_n, block_k, stages, splits, interpret):
    # w [L, N, K] every layer's weights; layer int32 [1] the one read
    m, k = x.shape
    n = w.shape[1]
    m_pad = padded_rows(m)
    if m_pad != m:  # TMA tiles the rows by 8 and wgmma's N is a multiple of 8: zero rows (cheap, M_pad x K)
        x = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    wgs = compute_wgs(block_n)
    rows = block_n // wgs
    k_steps = k // (block_k * splits)
    out_dtype = jnp.float32 if splits > 1 else x.dtype
    kernel = functools.partial(
        _kernel, rows=rows, wgs=wgs, block_k=block_k, k_steps=k_steps, stages=stages, num_layers=w.shape[0]
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, m, n), out_dtype),
        scratch_types=dict(
            smem=plgpu.RefUnion(
                (
                    plgpu.SMEM((stages, wgs, rows, block_k), w.dtype, **_TILED),
                    plgpu.SMEM((stages, m_pad, block_k), x.dtype, **_TILED),
                ),
                plgpu.SMEM((wgs, m_pad, rows), out_dtype),
            ),
            loaded=plgpu.Barrier(num_arrivals=wgs + 1, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            done=plgpu.Barrier(num_arrivals=wgs),
        ),
        grid=(n // block_n, splits),
        grid_names=("n", "split"),
        num_threads=wgs + 1,
        thread_name="wg",
        interpret=INTERPRET_PARAMS if interpret else None,
    )(layer, x, w)
    if splits == 1:
        return out.reshape(m, n)
    return out.sum(axis=0).astype(x.dtype)


def _check(x, w, layer, block_n, block_k, stages, splits) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {x.shape}")
    if layer is None and w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K] (stacked [L, N, K] weights take layer=), got shape {w.shape}")
    if layer is not None:
        if w.ndim != 3:
            raise ValueError(f"with layer= w must be every layer's weights [L, N, K], got shape {w.shape}")
        if jnp.ndim(layer) != 0:
            raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
        if not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
            raise ValueError(f"layer must be an integer, got {jnp.result_type(layer)}")
    for name, a in (("x", x), ("w", w)):
        if a.dtype != jnp.bfloat16:
            raise ValueError(f"{name} must be bfloat16, got {a.dtype}")
    m, k = x.shape
    n, k_w = w.shape[-2:]
    if k != k_w:
        raise ValueError(f"x has K = {k} but w [N, K] has K = {k_w}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"M (x rows) must be in 1 .. {MAX_ROWS}, got {m}")
    if block_n not in BLOCK_NS:
        raise ValueError(f"block_n must be one of {BLOCK_NS}, got {block_n}")
    if block_k not in BLOCK_KS:
        raise ValueError(f"block_k must be one of {BLOCK_KS}, got {block_k}")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if n % block_n:
        raise ValueError(f"N = {n} must be a multiple of block_n = {block_n} (W is never padded)")
    if k % (block_k * splits):
        raise ValueError(f"K = {k} must be a multiple of block_k x splits = {block_k} x {splits} (W is never padded)")
    rows = block_n // compute_wgs(block_n)
    if rows * padded_rows(m) > MAX_ACC_ELEMENTS:
        raise ValueError(
            f"block_n = {block_n} at M = {m} needs {rows} x {padded_rows(m)} accumulators a warpgroup; use block_n <= 128"
        )
    nbytes = smem_bytes(m, block_n, block_k, stages, splits)
    if nbytes > SMEM_LIMIT_BYTES - 4 * 1024:
        raise ValueError(
            f"stages = {stages} of block_n = {block_n}, block_k = {block_k} at M = {m} take {nbytes} bytes of shared "
            f"memory, over {SMEM_LIMIT_BYTES - 4 * 1024}"
        )


def skinny_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    layer: jax.Array | int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
    splits: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """y = x @ w.T on the Mosaic GPU backend (Hopper), streaming w through TMA.

    Args:
      x: bf16 [M, K], 1 <= M <= 256 token rows.
      w: bf16 [N, K] ("out, in"); N % block_n == 0 and K % (block_k * splits) == 0 (never padded). With
        layer=, every layer's weights stacked, [L, N, K].
      layer: the layer of a stacked w to use (int32 scalar, may be traced: a layer scan's counter), read in
        place by the kernel's TMA. Slicing it out first (as a scan over stacked weights does) copies the
        layer's whole weight on every call (a kernel takes each operand as one buffer). Read as
        `lax.dynamic_index_in_dim` reads it (`mosaic_common.layer_index`: negative from the end, then clamped).
      block_n, block_k, stages, splits: the tiling (module docstring); None takes `plan(M, N, K)`'s value
        (stages: as many as fit (`fit_stages`) when the rest of the tiling is given and differs from the plan).
      interpret: Mosaic GPU interpret mode (None: on the CPU backend).
    Returns:
      bf16 [M, N] (float32 accumulation).
    """
    if x.ndim == 2 and w.ndim in (2, 3) and None in (block_n, block_k, stages, splits):
        m, n, k = x.shape[0], w.shape[-2], x.shape[1]
        tiling = plan(m, n, k)
        block_n = tiling[0] if block_n is None else block_n
        block_k = tiling[1] if block_k is None else block_k
        splits = tiling[3] if splits is None else splits
        if stages is None:  # the plan's, or as many as fit a tiling given in part
            same = (block_n, block_k, splits) == (tiling[0], tiling[1], tiling[3])
            valid = block_k in BLOCK_KS and splits >= 1
            stages = tiling[2] if same or not valid else fit_stages(m, block_n, block_k, splits, k)
    _check(x, w, layer, block_n, block_k, stages, splits)
    if layer is None:
        stack, index = w[None], jnp.zeros((1,), jnp.int32)
    else:
        stack = w
        index = jnp.asarray(layer, jnp.int32).reshape(1)  # clamped inside the kernel
    return _skinny_matmul(
        x,
        stack,
        index,
        block_n=block_n,
        block_k=block_k,
        stages=stages,
        splits=splits,
        interpret=default_interpret(interpret),
    )


def skinny_matmul_reference(x: jax.Array, w: jax.Array, *, layer: jax.Array | int | None = None) -> jax.Array:
    """The twin in plain XLA: x @ w.T (w[layer].T with layer=) with float32 accumulation, in x's dtype."""
    if layer is not None:
        w = lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
