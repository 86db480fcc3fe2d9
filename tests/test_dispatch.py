"""ddtree_jax.dispatch (every "auto" rule in one table) and DecodeOptions (the engine's one options object)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from ddtree_jax import dispatch
from ddtree_jax.checkpoint.hf_config import parse_config, read_config
from ddtree_jax.options import METHODS, DecodeOptions


def test_every_rule_is_xla_off_gpu():
    for backend in ("cpu", "tpu"):
        assert dispatch.attention_impl("auto", queries=1, backend_name=backend) == "xla"
        assert dispatch.matmul_impl("auto", rows=1, quantized=True, backend_name=backend) == "xla"
        assert dispatch.verify_impl("auto", backend_name=backend) == "xla"
        assert dispatch.moe_impl(8, 384, backend_name=backend) == "gather"
        assert dispatch.moe_impl(1000, 384, backend_name=backend) == "reference"


def test_gpu_rules_and_their_thresholds(monkeypatch):
    gpu = dict(backend_name="gpu")
    most, short, short_keys = (
        dispatch.AUTO_PALLAS_GQA_QUERIES,
        dispatch.AUTO_PALLAS_GQA_SHORT_QUERIES,
        dispatch.AUTO_PALLAS_GQA_SHORT_KEYS,
    )
    assert dispatch.attention_impl("auto", queries=most, keys=1 << 17, **gpu) == "pallas"
    assert dispatch.attention_impl("auto", queries=most + 1, keys=1 << 17, **gpu) == "xla"
    assert dispatch.attention_impl("auto", queries=most + 1, **gpu) == "xla"  # keys unknown: not short
    assert dispatch.attention_impl("auto", queries=short, keys=short_keys, **gpu) == "pallas"
    assert dispatch.attention_impl("auto", queries=short + 1, keys=short_keys, **gpu) == "xla"
    assert dispatch.attention_impl("auto", queries=short, keys=short_keys + 1, **gpu) == "xla"
    mla_keys = max(dispatch.AUTO_PALLAS_MLA_MIN_KEYS, 1)
    assert dispatch.attention_impl("auto", queries=9, keys=mla_keys, mla=True, **gpu) == "pallas"
    assert dispatch.attention_impl("auto", queries=9, keys=mla_keys, mla=True, float32=True, **gpu) == "xla"
    assert dispatch.mla_attention_kernel(bfloat16=True, **gpu) == "mosaic"
    # GQA: the Mosaic kernel from AUTO_MOSAIC_GQA_MIN_KEYS keys (bf16, head dims 64 / 128), the Triton one below
    long_keys = dispatch.AUTO_MOSAIC_GQA_MIN_KEYS
    gqa = dict(queries=17, head_dim=128, value_dim=128, bfloat16=True)
    assert dispatch.gqa_attention_kernel(keys=long_keys, **gqa, **gpu) == "mosaic"
    assert dispatch.gqa_attention_kernel(keys=long_keys - 64, **gqa, **gpu) == "triton"
    assert dispatch.gqa_attention_kernel(keys=long_keys + 1, **gqa, **gpu) == "triton"  # not whole 64-key blocks
    assert dispatch.gqa_attention_kernel(keys=long_keys, **gqa, backend_name="cpu") == "triton"
    assert dispatch.gqa_attention_kernel(keys=long_keys, **{**gqa, "bfloat16": False}, **gpu) == "triton"
    assert dispatch.gqa_attention_kernel(keys=long_keys, **{**gqa, "head_dim": 32, "value_dim": 32}, **gpu) == "triton"
    assert dispatch.gqa_attention_kernel(keys=long_keys, **{**gqa, "queries": None}, **gpu) == "mosaic"  # decode
    prefill_sized = {**gqa, "queries": dispatch.AUTO_PALLAS_GQA_QUERIES + 1}
    assert dispatch.gqa_attention_kernel(keys=long_keys, **prefill_sized, **gpu) == "triton"
    assert dispatch.mla_attention_kernel(bfloat16=False, **gpu) == "triton"
    assert dispatch.mla_attention_kernel(bfloat16=True, backend_name="cpu") == "triton"
    # the Mosaic kernel takes latent 512 / rope 64 only: other MLA shapes keep XLA ("auto") / Triton ("pallas")
    assert dispatch.mla_attention_kernel(bfloat16=True, dims=(512, 64), **gpu) == "mosaic"
    assert dispatch.mla_attention_kernel(bfloat16=True, dims=(16, 4), **gpu) == "triton"
    assert dispatch.attention_impl("auto", queries=9, keys=mla_keys, mla=True, mla_dims=(16, 4), **gpu) == "xla"
    assert dispatch.attention_impl("auto", queries=9, keys=mla_keys, mla=True, mla_dims=(512, 64), **gpu) == "pallas"
    # causal prefill chunks: the Mosaic kernel on GPU for bf16, fitting head dims, whole 64-key blocks
    prefill = dict(queries=2048, keys=8192, key_dim=128, value_dim=128, bfloat16=True)
    assert dispatch.prefill_attention_kernel("auto", **prefill, **gpu) == "mosaic"
    assert dispatch.prefill_attention_kernel("pallas", **prefill, **gpu) == "mosaic"
    assert dispatch.prefill_attention_kernel("blockwise", **prefill, **gpu) == "none"
    assert dispatch.prefill_attention_kernel("auto", **prefill, backend_name="cpu") == "none"
    for change in (
        dict(queries=dispatch.AUTO_PALLAS_MAX_QUERIES),
        dict(keys=8200),
        dict(key_dim=96),
        dict(value_dim=192),
        dict(bfloat16=False),
    ):
        assert dispatch.prefill_attention_kernel("auto", **{**prefill, **change}, **gpu) == "none", change
    # the expanded MLA form's chunks: under "auto" since measured (AUTO_PREFILL_KERNEL_MLA)
    mla_prefill = dict(prefill, key_dim=192, mla=True)
    assert dispatch.prefill_attention_kernel("pallas", **mla_prefill, **gpu) == "mosaic"
    expected = "mosaic" if dispatch.AUTO_PREFILL_KERNEL_MLA else "none"
    assert dispatch.prefill_attention_kernel("auto", **mla_prefill, **gpu) == expected
    # float32 inputs: the kernel only up to AUTO_PALLAS_MAX_F32_ROWS query rows per KV head
    rows = dispatch.AUTO_PALLAS_MAX_F32_ROWS
    assert dispatch.attention_impl("auto", queries=rows // 2, group=2, float32=True, **gpu) == "pallas"
    assert dispatch.attention_impl("auto", queries=rows // 2 + 1, group=2, float32=True, **gpu) == "xla"
    assert dispatch.attention_impl("auto", queries=rows // 2 + 1, group=2, **gpu) == "pallas"  # bf16
    assert dispatch.matmul_impl("auto", rows=dispatch.AUTO_PALLAS_MAX_ROWS, quantized=True, **gpu) == "pallas"
    assert dispatch.matmul_impl("auto", rows=dispatch.AUTO_PALLAS_MAX_ROWS + 1, quantized=True, **gpu) == "xla"
    assert dispatch.matmul_impl("auto", rows=1, quantized=False, **gpu) == "xla"
    # the Mosaic GPU weight-streaming kernel: dense bf16 weights in whole 64-element tiles, <= MAX_ROWS rows, on GPU
    dense = dict(quantized=False, weight_shape=(4096, 4096), bfloat16=True)
    assert dispatch.matmul_impl("mosaic", rows=65, **dense, **gpu) == "mosaic"
    expected = "mosaic" if dispatch.AUTO_MOSAIC_MATMUL else "xla"
    assert dispatch.matmul_impl("auto", rows=65, **dense, **gpu) == expected
    for change in (
        dict(rows=257),
        dict(weight_shape=(4096, 4100)),
        dict(weight_shape=(4100, 4096)),
        dict(weight_shape=(dispatch.MOSAIC_MATMUL_MIN_OUT - 64, 4096)),
        dict(bfloat16=False),
        dict(quantized=True),
        dict(backend_name="cpu"),
    ):
        assert dispatch.matmul_impl("mosaic", **{"rows": 65, **dense, **gpu, **change}) == "xla", change
    assert dispatch.moe_impl(dispatch.GPU_GATHER_MAX_ASSIGNMENTS, 384, **gpu) == "decode"
    assert dispatch.moe_impl(dispatch.GPU_GATHER_MAX_ASSIGNMENTS + 1, 384, **gpu) == "pallas"
    # inside "pallas": the Mosaic GPU grouped INT4 kernel at prefill sizes, on shapes it takes, bf16, GPU only
    chunk = dict(rows=16384, weight_shape=(61, 384, 2048, 7168), x_dtype=jnp.bfloat16)
    assert dispatch.grouped_int4_kernel(**chunk, **gpu) == "mosaic"
    assert dispatch.grouped_int4_kernel(**{**chunk, "weight_shape": (384, 7168, 256)}, **gpu) == "mosaic"
    for change in (
        dict(rows=dispatch.MOSAIC_GROUPED_MIN_ROWS * 384),
        dict(weight_shape=(384, 2000, 7168)),
        dict(weight_shape=(384, 2048, 7200)),
        dict(x_dtype=jnp.float32),
        dict(backend_name="cpu"),
    ):
        assert dispatch.grouped_int4_kernel(**{**chunk, **gpu, **change}) == "triton", change
    # below prefill sizes: the streamed Mosaic kernel where GROUPED_INT4_DECODE says "stream" (default: Triton)
    tree = dict(rows=136, weight_shape=(61, 384, 256, 7168), x_dtype=jnp.bfloat16)
    assert dispatch.grouped_int4_kernel(**tree, **gpu) == "triton"
    monkeypatch.setattr(dispatch, "GROUPED_INT4_DECODE", "stream")
    assert dispatch.grouped_int4_kernel(**tree, **gpu) == "stream"
    assert dispatch.grouped_int4_kernel(**chunk, **gpu) == "mosaic"  # prefill sizes keep the prefill kernel
    for change in (dict(weight_shape=(384, 200, 7168)), dict(x_dtype=jnp.float32), dict(backend_name="cpu")):
        assert dispatch.grouped_int4_kernel(**{**tree, **gpu, **change}) == "triton", change
    monkeypatch.setattr(dispatch, "GROUPED_INT4_DECODE", "fast")
    with pytest.raises(ValueError, match="fast"):
        dispatch.grouped_int4_kernel(**tree, **gpu)
    monkeypatch.setattr(dispatch, "GROUPED_INT4_DECODE", "auto")
    # inside "decode": the Mosaic decode form (when switched on) on GPU for bf16 INT4 shapes it takes, up to its
    # assignment bound; off by default (measured slower than the Triton kernels)
    k26_tp8 = [(61, 384, 256, 7168), (61, 384, 256, 7168), (61, 384, 7168, 256)]
    assert dispatch.decode_moe_kernel(8, k26_tp8, jnp.bfloat16, **gpu) == "triton"
    monkeypatch.setattr(dispatch, "AUTO_MOSAIC_DECODE", True)
    assert dispatch.decode_moe_kernel(8, k26_tp8, jnp.bfloat16, **gpu) == "mosaic"
    for change in (
        dict(assignments=dispatch.MOSAIC_DECODE_MAX_ASSIGNMENTS + 1),
        dict(weight_shapes=[(384, 256, 7168), (384, 256, 7168), (384, 7168, 128)]),  # K not whole 256-steps
        dict(weight_shapes=[(384, 200, 7168), (384, 200, 7168), (384, 7168, 256)]),  # N not whole 128-row CTAs
        dict(x_dtype=jnp.float32),
        dict(backend_name="cpu"),
    ):
        args = {"assignments": 8, "weight_shapes": k26_tp8, "x_dtype": jnp.bfloat16, **gpu, **change}
        assert dispatch.decode_moe_kernel(**args) == "triton", change
    # the Mosaic MLA kernel's schedule: one flag at most, from the module's research knob
    assert dispatch.mla_schedule_options() == dict(split_scores=False, overlap=False, alternate=False)
    assert dispatch.mla_schedule_options("alternate") == dict(split_scores=False, overlap=False, alternate=True)
    monkeypatch.setattr(dispatch, "MLA_SCHEDULE", "split_scores")
    assert dispatch.mla_schedule_options() == dict(split_scores=True, overlap=False, alternate=False)
    with pytest.raises(ValueError, match="unknown MLA kernel schedule 'fast'"):
        dispatch.mla_schedule_options("fast")
    assert dispatch.verify_impl("auto", **gpu) == "pallas"
    # explicit choices pass through on any backend
    assert dispatch.attention_impl("pallas", queries=512, mla=True, backend_name="cpu") == "pallas"


def _mosaic_choices() -> dict:
    """Every choice that can name a Mosaic GPU kernel, at sizes where the H200 takes it, on this process's GPU."""
    int4 = (384, 256, 7168)  # [E, N, K]: the K2.6 TP8 shard's gate
    return {
        "mla": dispatch.mla_attention_kernel(bfloat16=True),
        "mla auto": dispatch.attention_impl("auto", queries=9, keys=1 << 15, mla=True),
        "gqa": dispatch.gqa_attention_kernel(
            queries=17, keys=dispatch.AUTO_MOSAIC_GQA_MIN_KEYS, head_dim=128, value_dim=128, bfloat16=True
        ),
        "prefill": dispatch.prefill_attention_kernel(
            "pallas", queries=2048, keys=8192, key_dim=128, value_dim=128, bfloat16=True
        ),
        "matmul": dispatch.matmul_impl("mosaic", rows=8, quantized=False, weight_shape=(4096, 4096), bfloat16=True),
        "in place": dispatch.matmul_in_place(8, (4096, 4096), quantized=False, bfloat16=True),
        "stacked": dispatch.stacked_in_place(next(iter(dispatch.IN_PLACE_PROJECTIONS)), 8),
        "grouped prefill": dispatch.grouped_int4_kernel(16384, int4, jnp.bfloat16),
        "grouped stream": dispatch.grouped_int4_kernel(136, int4, jnp.bfloat16),
        "decode moe": dispatch.decode_moe_kernel(8, [int4, int4, (384, 7168, 256)], jnp.bfloat16),
    }


@pytest.mark.parametrize(
    "capability, mosaic",
    [((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False), (None, False)],
    ids=["hopper", "a100", "ada", "blackwell", "rocm"],
)
def test_mosaic_kernels_are_chosen_on_hopper_gpus_only(monkeypatch, capability, mosaic):
    """The Mosaic GPU kernels (wgmma: compute capability 9.x only) are never chosen on another GPU: each choice
    falls back to the Triton kernel or XLA, which run there. Simulated: the backend says "gpu" and the device
    reports `capability` (None: no CUDA compute capability, e.g. ROCm)."""
    monkeypatch.setattr(dispatch, "backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "gpu_compute_capability", lambda: capability)
    monkeypatch.setattr(dispatch, "AUTO_MOSAIC_DECODE", True)
    monkeypatch.setattr(dispatch, "GROUPED_INT4_DECODE", "stream")
    dispatch._warn_no_mosaic.cache_clear()
    if mosaic:
        assert dispatch.mosaic_gpu() is True
    else:  # said once a process, with the capability
        with pytest.warns(UserWarning, match=rf"compute capability is {re.escape(str(capability))}, not 9.x"):
            assert dispatch.mosaic_gpu() is False
    fallback = {
        "mla": "triton",
        "mla auto": "xla",
        "gqa": "triton",
        "prefill": "none",
        "matmul": "xla",
        "in place": False,
        "stacked": False,
        "grouped prefill": "triton",
        "grouped stream": "triton",
        "decode moe": "triton",
    }
    chosen = {"mla auto": "pallas", "in place": True, "stacked": True, "grouped stream": "stream", "prefill": "mosaic"}
    want = {name: chosen.get(name, "mosaic") if mosaic else value for name, value in fallback.items()}
    assert _mosaic_choices() == want
    # the Triton kernels still run on any CUDA GPU: quantised matmuls and GQA attention stay "pallas"
    assert dispatch.matmul_impl("auto", rows=1, quantized=True) == "pallas"
    assert dispatch.attention_impl("auto", queries=17, keys=1 << 15) == "pallas"


def test_the_compute_capability_is_read_from_the_device(monkeypatch):
    """`gpu_compute_capability` parses the CUDA device's "major.minor"; a device without one (ROCm's gfx names)
    and a non-GPU backend give None; off a GPU, backend_name "gpu" plans for the H200 (Hopper)."""

    class Device:
        def __init__(self, capability):
            self.compute_capability = capability

    monkeypatch.setattr(dispatch, "backend", lambda: "gpu")
    for reported, parsed in (("9.0", (9, 0)), ("8.6", (8, 6)), ("gfx90a", None)):
        monkeypatch.setattr(jax, "devices", lambda reported=reported: [Device(reported)])
        dispatch._device_capability.cache_clear()
        assert dispatch.gpu_compute_capability() == parsed
    monkeypatch.setattr(jax, "devices", lambda: [object()])  # no attribute at all
    dispatch._device_capability.cache_clear()
    assert dispatch.gpu_compute_capability() is None
    monkeypatch.undo()
    dispatch._device_capability.cache_clear()  # this process's real device from here on
    if jax.default_backend() != "gpu":
        assert dispatch.gpu_compute_capability() is None  # the CPU backend
        assert dispatch.mosaic_gpu("gpu") and not dispatch.mosaic_gpu() and not dispatch.mosaic_gpu("cpu")
    else:  # on the GPU machine: its own card
        assert dispatch.mosaic_gpu() == (dispatch.gpu_compute_capability()[0] == dispatch.MOSAIC_GPU_MAJOR)


def test_the_weights_dtype_is_the_checkpoints_on_gpu_only():
    assert dispatch.weights_dtype("auto", backend_name="gpu") == "checkpoint"
    assert dispatch.weights_dtype("auto", backend_name="cpu") == "float32"
    assert dispatch.weights_dtype("bfloat16", backend_name="cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of .* got 'float16'"):
        dispatch.weights_dtype("float16")


def test_unknown_choices_are_named():
    with pytest.raises(ValueError, match="attention impl must be one of .* got 'flash'"):
        dispatch.attention_impl("flash")
    with pytest.raises(ValueError, match="top-k impl must be one of"):
        dispatch.topk_impl("sort", vocab=100, k=4)
    with pytest.raises(ValueError, match="DecodeOptions.moe_impl must be one of"):
        DecodeOptions(moe_impl="dense")
    with pytest.raises(ValueError, match="DecodeOptions.threshold_acc must be a number in"):
        DecodeOptions(threshold_acc=1.5)
    with pytest.raises(ValueError, match="sample-then-walk verifier has no lossy thresholds"):
        DecodeOptions(verifier="sample_then_walk", threshold_single=0.5)


def test_decode_plan_names_the_gqa_kernel_by_cache_rows():
    from ddtree_jax.presets import preset_pair

    target, _ = preset_pair("qwen3-8b")
    rows = dispatch.AUTO_MOSAIC_GQA_MIN_KEYS

    def attention_detail(keys):
        plan = dispatch.decode_plan(
            DecodeOptions(), target, method="ddtree", budget=16, block_size=16, keys=keys, backend_name="gpu"
        )
        return next(row.why for row in plan if row.stage == "tree-forward attention")

    assert "(the triton kernel)" in attention_detail(rows // 2)  # below the threshold once rounded to whole blocks
    assert "(the mosaic kernel)" in attention_detail(rows)
    assert f"mosaic from {rows} cache rows, else triton" in attention_detail(None)


def test_the_prefilter_pays_on_large_vocabularies_only():
    assert dispatch.topk_impl("auto", vocab=151936, k=64) == "prefilter"
    assert dispatch.topk_impl("auto", vocab=64, k=32) == "xla"
    assert dispatch.prefilter_chunk(151936, 64) & (dispatch.prefilter_chunk(151936, 64) - 1) == 0


def test_tree_topk_chunk_fits_the_candidates_in_one_kernel_row(monkeypatch):
    assert dispatch.tree_topk_chunk(151936, 64) is None  # off in "auto" (measured slower on the H200)
    monkeypatch.setattr(dispatch, "AUTO_TREE_TOPK_CHUNKED", True)
    assert dispatch.tree_topk_chunk(8192, 64) is None  # one program a row
    assert dispatch.tree_topk_chunk(151936, 64) == 8192  # 19 chunks x 64 candidates
    assert dispatch.tree_topk_chunk(151936, 1024) == 16384  # 19 x 1024 would not fit; 10 x 1024 does
    assert dispatch.tree_topk_chunk(163840, 1024) == 16384
    assert dispatch.tree_topk_chunk(1 << 20, 1024) is None  # 64 x 1024 never fits: the XLA prefilter
    for vocab, k in ((151936, 64), (163840, 256), (200000, 512)):
        chunk = dispatch.tree_topk_chunk(vocab, k)
        assert -(-vocab // chunk) * min(k, chunk) <= dispatch.TREE_TOPK_MAX_ROW


def test_options_are_hashable_statics_and_route_target_keywords():
    a, b = DecodeOptions(attn_impl="xla"), DecodeOptions(attn_impl="xla")
    assert a == b and hash(a) == hash(b) and a != DecodeOptions()
    k2 = parse_config(_json("configs/kimi_k2_tiny.json"))
    qwen = parse_config(read_config("checkpoints/embedded/target"))
    assert DecodeOptions(layer_loop="scan").target_impls(k2) == {
        "attn_impl": "auto",
        "matmul_impl": "auto",
        "layer_loop": "scan",
        "moe_impl": "auto",
    }
    assert DecodeOptions().target_impls(qwen) == {"attn_impl": "auto", "matmul_impl": "auto"}
    with pytest.raises(ValueError, match="needs an MoE target"):
        DecodeOptions(moe_impl="ep").target_impls(qwen)
    jitted = jax.jit(lambda x, options: x + len(options.order), static_argnames="options")
    assert int(jitted(1, options=DecodeOptions(order="reverse"))) == 8


def _json(path):
    import json

    with open(path) as f:
        return json.load(f)


def test_decode_plan_answers_what_runs_where():
    k26 = parse_config(_json("configs/kimi_k2_6.json"))
    plan = {
        row.stage: row.choice
        for row in dispatch.decode_plan(
            DecodeOptions(), k26, method="ddtree", budget=32, block_size=16, backend_name="gpu"
        )
    }
    assert plan["tree builder"] == "pallas"  # the tree_build kernels on GPU
    assert plan["tree top-k"] == "pallas after the prefilter"  # V = 163840 > the kernel's 16384-long rows
    assert plan["tree-forward attention"] == "pallas"  # absorbed MLA on the Mosaic GPU kernel (bf16)
    assert plan["tree-forward MoE"] == "pallas"  # 33 rows x 8 experts > 16 assignments
    assert plan["rejection walk"] == "pallas"
    moe_detail = {
        row.stage: row.why
        for row in dispatch.decode_plan(
            DecodeOptions(), k26, method="ddtree", budget=32, block_size=16, backend_name="gpu"
        )
    }["tree-forward MoE"]
    # inside the grouped path: what runs the INT4 experts, their sort, where the gate / up rows come from; the router
    assert moe_detail == (
        "264 assignments over 384 experts; INT4 experts on the triton grouped kernel, sorted by rank, "
        "gate / up rows gathered by xla; the router's top-k by lax"
    )
    ar = {
        row.stage: row.choice
        for row in dispatch.decode_plan(DecodeOptions(), k26, method="ar", budget=1, block_size=16, backend_name="gpu")
    }
    assert ar["tree-forward MoE"] == "decode" and "tree top-k" not in ar
    # an explicit "decode" above the kernels' 32 assignments gathers, and the plan says so
    explicit = {
        row.stage: row.why
        for row in dispatch.decode_plan(
            DecodeOptions(moe_impl="decode"), k26, method="ddtree", budget=32, block_size=16, backend_name="gpu"
        )
    }["tree-forward MoE"]
    assert explicit == (
        "264 assignments over 384 experts; gathered (above the moe_decode kernels' 32 assignments); "
        "the router's top-k by lax"
    )
    cpu = dispatch.decode_plan(DecodeOptions(), k26, method="ddtree", budget=32, block_size=16, backend_name="cpu")
    assert {row.choice for row in cpu if row.stage in ("tree-forward attention", "rejection walk")} == {"xla"}
    cpu_plan = {row.stage: row.choice for row in cpu}
    assert cpu_plan["tree builder"] == "xla" and cpu_plan["tree top-k"] == "prefilter"
    assert dispatch.tree_impl("auto", "gpu") == "pallas" and dispatch.tree_impl("xla", "gpu") == "xla"
    with pytest.raises(ValueError, match="tree impl must be one of"):
        dispatch.tree_impl("triton")
    assert set(METHODS) == {"ddtree", "chain", "ar"}


def test_decode_plan_checks_its_request_and_the_expert_format():
    """The plan named a chain for method "bogus" and "-4 queries per row" for budget -5; and it said "decode" for
    dense experts, which the MoE layer runs on "gather" (the decode kernels take INT4 experts only)."""
    k26 = parse_config(_json("configs/kimi_k2_6.json"))
    plan = functools.partial(dispatch.decode_plan, DecodeOptions(), k26, backend_name="gpu")
    for kwargs, message in (
        (dict(method="bogus", budget=8, block_size=8), "method must be one of"),
        (dict(method="ddtree", budget=-5, block_size=8), r"budget must be in \[1, 1024\], got -5"),
        (dict(method="ddtree", budget=2000, block_size=8), r"budget must be in \[1, 1024\], got 2000"),
        (dict(method="chain", budget=1, block_size=0), "block_size must be an int >= 2, got 0"),
        (dict(method="ar", budget=1, block_size=8, batch=0), "batch must be >= 1"),
        (dict(method="ar", budget=1, block_size=8, keys=-100), "keys -100"),
    ):
        with pytest.raises(ValueError, match=message):
            plan(**kwargs)
    dense = dataclasses.replace(k26, expert_format="dense")
    ar = {row.stage: row.choice for row in plan(method="ar", budget=1, block_size=16)}
    ar_dense = {
        row.stage: row.choice
        for row in dispatch.decode_plan(
            DecodeOptions(), dense, method="ar", budget=1, block_size=16, backend_name="gpu"
        )
    }
    assert ar["tree-forward MoE"] == "decode" and ar_dense["tree-forward MoE"] == "gather"


def test_decode_plan_follows_the_weights_dtype():
    """The embedded pair's target (4 query heads over 2 KV heads) at DDTree 16 (17 queries): float32 caches
    take XLA's attention (2 x 17 rows per KV head), bf16 the kernel."""
    embedded = parse_config(_json("checkpoints/embedded/target/config.json"))

    def attention(float32):
        plan = dispatch.decode_plan(
            DecodeOptions(), embedded, method="ddtree", budget=16, block_size=16, float32=float32, backend_name="gpu"
        )
        return {row.stage: row for row in plan}["tree-forward attention"]

    assert attention(True).choice == "xla" and "float32" in attention(True).why
    assert attention(False).choice == "pallas"


def test_the_generation_loop_is_one_cuda_graph_unless_xla_flags_say_otherwise():
    options = dispatch.loop_compiler_options(xla_flags="")
    captured = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUSTOM_CALL"} <= set(captured)
    assert dispatch.loop_compiler_options(xla_flags="--xla_gpu_enable_command_buffer=") == {}
    assert dispatch.loop_compiler_options(xla_flags="--xla_dump_to=/tmp/x") == options
    # small targets compile without split-K (measured on the embedded pair), larger ones keep XLA's choice;
    # an XLA_FLAGS setting of the option wins
    small = dispatch.loop_compiler_options(xla_flags="", hidden_size=256)
    assert small == {**options, "xla_gpu_experimental_force_split_k": 1}
    assert dispatch.loop_compiler_options(xla_flags="", hidden_size=4096) == options
    assert dispatch.gemm_compiler_options("", 256) == {"xla_gpu_experimental_force_split_k": 1}
    assert dispatch.gemm_compiler_options("", 4096) == {} and dispatch.gemm_compiler_options("") == {}
    flagged = "--xla_gpu_experimental_force_split_k=4"
    assert "xla_gpu_experimental_force_split_k" not in dispatch.loop_compiler_options(flagged, hidden_size=256)
    k26 = parse_config(_json("configs/kimi_k2_6.json"))
    gpu = {
        row.stage: row
        for row in dispatch.decode_plan(
            DecodeOptions(steps_per_iteration=2), k26, method="ar", budget=1, block_size=16, backend_name="gpu"
        )
    }
    assert gpu["generation loop"].choice in ("one CUDA graph", "XLA_FLAGS' command buffers")
    assert gpu["generation loop"].why.startswith("2 step(s) per iteration")


def test_prefill_chunking_rule():
    assert dispatch.prefill_chunk(0, dispatch.PREFILL_CHUNK) is None
    assert dispatch.prefill_chunk(0, dispatch.PREFILL_CHUNK + 1) == dispatch.PREFILL_CHUNK
    assert dispatch.prefill_chunk(100, 100) is None and dispatch.prefill_chunk(100, 101) == 100
    # targets with routed experts: ~8,192 tokens a chunk over the batch (each chunk streams every expert once),
    # never below PREFILL_CHUNK; an explicit chunk wins
    assert [dispatch.moe_prefill_chunk(b) for b in (1, 2, 3, 4, 64)] == [8192, 4096, 2048, 2048, 2048]
    assert dispatch.prefill_chunk(0, dispatch.PREFILL_CHUNK + 1, moe=True) is None
    assert dispatch.prefill_chunk(0, 8193, moe=True) == 8192
    assert dispatch.prefill_chunk(0, 8193, moe=True, batch=2) == 4096
    assert dispatch.prefill_chunk(100, 101, moe=True) == 100
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="prefill_chunk must be an int >= 0"):
            DecodeOptions(prefill_chunk=bad)


def test_the_plan_takes_the_short_cache_rule_only_when_told_the_context():
    from ddtree_jax import presets

    qwen = presets.qwen3_8b()

    def attention(keys):
        plan = dispatch.decode_plan(
            DecodeOptions(), qwen, method="ddtree", budget=128, block_size=16, keys=keys, backend_name="gpu"
        )
        return next(row for row in plan if row.stage == "tree-forward attention")

    assert attention(None).choice == "xla"
    # 500 committed tokens + 129 slots = 629 rows, in whole 128-row blocks: 640
    assert attention(500).choice == "pallas" and "against 640 cache rows" in attention(500).why
    short, slots = dispatch.AUTO_PALLAS_GQA_SHORT_KEYS, 129
    assert attention(short - slots).choice == "pallas"  # exactly 2,048 rows
    assert attention(short - slots + 1).choice == "xla"  # 2,049 rows -> 2,176
