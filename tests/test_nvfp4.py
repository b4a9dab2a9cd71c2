"""NVFP4 outputs without a GPU: options, the shape rules and their messages, the plans (the packed
kernels' NVFP4 epilogue, its swizzle arguments), torch's fakes and JAX's integration through the
NumPy stand-in of the kernels (values against the float64 merge quantised by the reference)."""

from __future__ import annotations

import numpy as np
import pytest
from views import arguments, bound_args, family, plan_checked, template, view

try:  # the CPU stand-in of the kernels for torch's ops (the compile and export tests below)
    from test_torch_ops import _cpu_library, cpu_kernels  # noqa: F401 - fixtures
except (ImportError, pytest.skip.Exception):

    @pytest.fixture
    def cpu_kernels():
        pytest.skip("torch is not installed")

from cupy_merge import _catalogue as cat
from cupy_merge import _options, _quantised
from cupy_merge._operands import ManyStateOperands, ManyStateOptions, TwoStateOptions
from cupy_merge._ops import MERGE_ATTN_STATES, MERGE_STATES, MERGE_STATES_VARLEN

NVFP4 = "float4_e2m1fn_x2"
TOKENS, HEADS, HEAD_SIZE = 6, 4, 128


def _two_way(in_dtype="bfloat16", head_size=HEAD_SIZE, tokens=TOKENS, swizzled=True, **changes):
    blocks = HEADS * head_size // 16
    views = {
        "output": view((tokens, HEADS, head_size // 2), NVFP4, ptr=1 << 32),
        "output_lse": view((HEADS, tokens), "float32", ptr=2 << 32),
        "prefix_output": view((tokens, HEADS, head_size), in_dtype, ptr=3 << 32),
        "prefix_lse": view((HEADS, tokens), "float32", ptr=4 << 32),
        "suffix_output": view((tokens, HEADS, head_size), in_dtype, ptr=5 << 32),
        "suffix_lse": view((HEADS, tokens), "float32", ptr=6 << 32),
        "mask": None,
        "output_scale": view((1,), "float32", ptr=7 << 32),
        "output_block_scale": view(_quantised.nvfp4_scale_shape(tokens, blocks, swizzled), "uint8", ptr=8 << 32),
    }
    views.update(changes)
    names = MERGE_ATTN_STATES.names
    return type(names)(**{field: views[name] for field, name in zip(names._fields, names) if name in views})


def _planned(arrays, swizzled=True, **options):
    return plan_checked(MERGE_ATTN_STATES, TwoStateOptions(swizzled_scales=swizzled, **options), arrays)


def _only(planned):
    assert len(planned.plan) == 1, planned.plan
    return planned.plan[0]


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["nvfp4", NVFP4])
def test_nvfp4_is_an_output_dtype(dtype):
    assert _options.optional_value_dtype(dtype) == NVFP4


def test_row_major_scales_need_block_scales_and_a_bool():
    with pytest.raises(ValueError, match="^is_sf_swizzled_layout: False is the layout of NVFP4 block scales"):
        _options.two_state_options(is_sf_swizzled_layout=False)
    with pytest.raises(TypeError, match="^is_sf_swizzled_layout: expected True or False"):
        _options.many_state_options(is_sf_swizzled_layout=1, output_block_scale=True)
    assert not _options.two_state_options(is_sf_swizzled_layout=False, output_block_scale=True).swizzled_scales


def test_the_swizzled_shape_pads_rows_to_128_and_blocks_to_4():
    assert _quantised.nvfp4_scale_shape(1, 3, True) == (128, 4)
    assert _quantised.nvfp4_scale_shape(130, 32, True) == (256, 32)
    assert _quantised.nvfp4_scale_shape(130, 3, False) == (130, 3)


# -- plans ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "in_dtype, head_size, offset, vec",
    [("bfloat16", 128, 0, 16), ("float16", 64, 0, 16), ("float32", 128, 0, 16), ("bfloat16", 16, 0, 16),
     ("bfloat16", 128, 8, 4), ("float32", 64, 8, 2)],
)  # fmt: skip
def test_the_two_way_merge_plans_the_nvfp4_epilogue_with_swizzled_scales(in_dtype, head_size, offset, vec):
    """A thread a whole block of 16 values where the inputs' alignment allows it, else lanes that
    exchange their maxima."""
    state = view((130, HEADS, head_size), in_dtype, ptr=(3 << 32) + offset)
    arrays = _two_way(in_dtype, head_size, tokens=130, prefix_output=state)
    launch = _only(_planned(arrays))
    kernel, args = template(launch), arguments(launch)
    assert family(launch) is cat.TWO_PACKED
    assert kernel["TOut"] == "cupy_merge::nvfp4x2_t" and kernel["GROUPED"] == "true" and int(kernel["VEC"]) == vec
    assert args["packs_per_group"] == 16 // vec and launch.block[0] % args["packs_per_group"] == 0
    assert launch.block[0] % 32 == 0  # whole warps: a block's lanes exchange their maxima by shuffles
    assert args["out_stride_token"] == HEADS * head_size // vec  # the output's packs are vec / 2 bytes
    blocks = HEADS * head_size // 16
    assert args["block_scale_col_tiles"] == -(-blocks // 4)
    assert (args["block_scale_rows"], args["block_scale_padded_rows"]) == (130, 256)
    assert args["block_scale_stride_token"] == args["block_scale_stride_group"] == 0
    bound = bound_args(launch, arrays)
    assert bound["output_scale"] == 7 << 32 and bound["output_block_scale"] == 8 << 32


def test_row_major_scales_take_their_strides():
    scales = view((TOKENS, HEADS * HEAD_SIZE // 16), "uint8", ptr=8 << 32, strides=(1, TOKENS))
    args = arguments(_only(_planned(_two_way(output_block_scale=scales), swizzled=False)))
    assert (args["block_scale_stride_token"], args["block_scale_stride_group"]) == (1, TOKENS)
    assert args["block_scale_col_tiles"] == 0 and args["block_scale_padded_rows"] == TOKENS


@pytest.mark.parametrize("scale_dtype", ["uint8", "float8_e4m3fn"])
def test_uint8_values_beside_one_byte_block_scales_are_nvfp4_as_vllm_gives_them(scale_dtype):
    blocks = HEADS * HEAD_SIZE // 16
    arrays = _two_way(
        output=view((TOKENS, HEADS, HEAD_SIZE // 2), "uint8", ptr=1 << 32),
        output_block_scale=view(_quantised.nvfp4_scale_shape(TOKENS, blocks, True), scale_dtype, ptr=8 << 32),
    )
    assert template(_only(_planned(arrays)))["TOut"] == "cupy_merge::nvfp4x2_t"


@pytest.mark.parametrize("ragged", [False, True])
def test_n_way_and_ragged_merges_plan_the_nvfp4_epilogue(ragged):
    states, tokens = 16, 5
    if ragged:
        v = view((40, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32)
        s = view((HEADS, 40), "float32", ptr=4 << 32)
        indptr = view((tokens + 1,), "int32", ptr=9 << 32)
    else:
        v = view((states, tokens, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32)
        s = view((states, HEADS, tokens), "float32", ptr=4 << 32)
        indptr = None
    out = view((tokens, HEADS, HEAD_SIZE // 2), NVFP4, ptr=1 << 32)
    scales = view(_quantised.nvfp4_scale_shape(tokens, HEADS * HEAD_SIZE // 16, True), "uint8", ptr=8 << 32)
    operands = ManyStateOperands(out, None, v, s, indptr, None, view((1,), "float32", ptr=7 << 32), scales)
    operation = MERGE_STATES_VARLEN if ragged else MERGE_STATES
    launch = _only(plan_checked(operation, ManyStateOptions(), operands))
    kernel, args = template(launch), arguments(launch)
    assert family(launch) is cat.MANY_PACKED and kernel["TOut"] == "cupy_merge::nvfp4x2_t"
    assert kernel["GROUPED"] == "true" and kernel["RAGGED"] == str(ragged).lower()
    assert args["packs_per_group"] == 2 and args["block_scale_padded_rows"] == 128
    assert launch.shared_bytes >= 4 * (launch.block[0] // 2)


def test_every_nvfp4_module_holds_only_grouped_packed_kernels_of_whole_bytes():
    for module in cat.all_modules() + cat.all_modules(sinks=True):
        if module.out_dtype != NVFP4:
            continue
        names = cat.module_instances(module)
        assert names and all("_packed<" in name and "nvfp4x2_t" in name for name in names)
        assert all(", 1, " not in name.split("nvfp4x2_t")[1][:4] for name in names)  # no pack of one value


# -- the shape rules and their messages -------------------------------------------------------------


def _bad_cases():
    blocks = HEADS * HEAD_SIZE // 16
    swizzled = _quantised.nvfp4_scale_shape(TOKENS, blocks, True)
    return [
        ({"output_scale": None}, {}, TypeError, "^output_scale: an NVFP4 output \\(output\\) needs output_scale"),
        ({"output_block_scale": None}, {}, TypeError, "^output_block_scale: an NVFP4 output \\(output\\) needs"),
        ({"output_scale": view((2,), "float32", ptr=7 << 32)}, {}, TypeError, "^output_scale: expected a float32 array of one"),
        ({"output_block_scale": view(swizzled, "float32", ptr=8 << 32)}, {}, TypeError,
         "^output_block_scale: expected NVFP4 block scales of dtype float8_e4m3fn"),
        ({"output_block_scale": view((TOKENS, blocks), "uint8", ptr=8 << 32)}, {}, ValueError,
         "^output_block_scale: expected shape \\(128, 32\\) \\(\\[ceil\\(num_tokens / 128\\)"),
        ({"output_block_scale": view(swizzled, "uint8", ptr=8 << 32)}, {"swizzled": False}, ValueError,
         "^output_block_scale: expected shape \\(6, 32\\) \\(\\[num_tokens, num_heads \\* head_size // 16\\]"),
        ({"output_block_scale": view(swizzled, "uint8", ptr=8 << 32, strides=(1, 128))}, {}, ValueError,
         "^output_block_scale: swizzled block scales are C-contiguous tiles"),
        ({"output_block_scale": view(swizzled, "uint8", ptr=2 << 32)}, {}, ValueError, "^output_block_scale: overlaps output_lse"),
        ({"output_block_scale": view(swizzled, "uint8", ptr=(8 << 32) + 2)}, {}, ValueError,
         "^output_block_scale: expected swizzled block scales at a 4-byte aligned address"),
        ({"output": view((TOKENS, HEADS, HEAD_SIZE), NVFP4, ptr=1 << 32)}, {}, ValueError,
         "^output: expected shape \\(6, 4, 64\\) \\(\\[num_tokens, num_heads, head_size // 2\\] of prefix_output: two values a byte\\)"),
        ({}, {"group_size": 32}, ValueError, "^quant_group_size: NVFP4 has a scale per 16 values, got 32"),
        ({}, {"scale_ue8m0": 1}, ValueError, "^scale_ue8m0: NVFP4 block scales are float8_e4m3fn"),
        ({"prefix_output": view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=3 << 32, strides=(HEADS * 256, 256, 1))},
         {}, ValueError, "^output_block_scale: group scales need every value array's heads back to back"),
        ({"prefix_output": view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=(3 << 32) + 2)}, {}, ValueError,
         "^prefix_output: an NVFP4 output needs its values in pairs .* aligned to 4 bytes"),
        ({"suffix_output": view((TOKENS, HEADS, HEAD_SIZE), "bfloat16", ptr=5 << 32, strides=(HEADS * 129, 129, 1))},
         {}, ValueError, "^suffix_output: an NVFP4 output needs its values in pairs"),
        ({"prefix_output": view((TOKENS, HEADS, HEAD_SIZE), NVFP4, ptr=3 << 32)}, {}, TypeError,
         "^prefix_output: expected dtype float32, float16 or bfloat16, got float4_e2m1fn_x2"),
    ]  # fmt: skip


@pytest.mark.parametrize("changes, options, error, words", _bad_cases())
def test_bad_nvfp4_calls_raise_naming_the_argument(changes, options, error, words):
    with pytest.raises(error, match=words):
        _planned(_two_way(**changes), **options)


def test_a_head_size_not_a_multiple_of_16_is_refused_naming_the_output():
    arrays = _two_way(head_size=40)._replace(out=view((TOKENS, HEADS, 20), NVFP4, ptr=1 << 32))
    with pytest.raises(ValueError, match="^output: an NVFP4 output needs a head_size that is a positive multiple of 16"):
        _planned(arrays)


def test_fp8_group_scales_are_not_nvfp4_block_scales():
    arrays = _two_way(
        output=view((TOKENS, HEADS, HEAD_SIZE), "float8_e4m3fn", ptr=1 << 32),
        output_scale=None,
        output_block_scale=view((TOKENS, HEADS), "float8_e4m3fn", ptr=8 << 32),
    )
    with pytest.raises(TypeError, match="^output_block_scale: one-byte block scales \\(float8_e4m3fn\\) are NVFP4's"):
        _planned(arrays, group_size=128)


# -- torch's fakes ----------------------------------------------------------------------------------


def test_the_registered_ops_take_nvfp4_outputs_under_fake_tensors():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupy_merge import torch_ops

    ops = torch_ops.ops()
    cuda = {"device": "cuda"}
    with FakeTensorMode():
        v = torch.empty(TOKENS, HEADS, HEAD_SIZE, dtype=torch.bfloat16, **cuda)
        s = torch.empty(HEADS, TOKENS, **cuda)
        out = torch.empty(TOKENS, HEADS, HEAD_SIZE // 2, dtype=torch.float4_e2m1fn_x2, **cuda)
        scales = torch.empty(128, HEADS * HEAD_SIZE // 16, dtype=torch.float8_e4m3fn, **cuda)
        scale = torch.empty(1, **cuda)
        assert ops.merge_attn_states(out, v, s, v, s, None, None, scale, scales) is None
        assert ops.merge_state_out(out, s, v, s, v, s, output_scale=scale, output_block_scale=scales) is None
        rows = torch.empty(TOKENS, HEADS * HEAD_SIZE // 16, dtype=torch.uint8, **cuda)
        stack = torch.empty(3, TOKENS, HEADS, HEAD_SIZE, dtype=torch.bfloat16, **cuda)
        lse = torch.empty(3, HEADS, TOKENS, **cuda)
        ops.merge_states_out(out, s, stack, lse, output_scale=scale, output_block_scale=rows,
                             is_sf_swizzled_layout=False)  # fmt: skip
        with pytest.raises(Exception, match="output_block_scale: expected shape \\(128, 32\\)"):
            ops.merge_attn_states(out, v, s, v, s, None, None, scale, rows)


# -- JAX, through the kernels' NumPy stand-in --------------------------------------------------------


@pytest.fixture
def jax_stand_in(monkeypatch):
    jax = pytest.importorskip("jax")
    import test_jax

    monkeypatch.setattr(test_jax._jax_launch, "_devices_to_prepare", lambda: ())
    monkeypatch.setattr(test_jax._jax_launch, "_on_host", test_jax._numpy_merge)
    test_jax.cmj._clear_caches()
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax
    test_jax.cmj._clear_caches()


def _jax_states(jax, rng, batch=(), tokens=TOKENS, head_size=64):
    v_a, v_b = (rng.standard_normal((*batch, tokens, HEADS, head_size)).astype(np.float32) for _ in range(2))
    s_a, s_b = (rng.standard_normal((*batch, HEADS, tokens)).astype(np.float32) for _ in range(2))
    return tuple(jax.numpy.asarray(x) for x in (v_a, s_a, v_b, s_b))


def _expect_reference_nvfp4(got, got_scales, states, global_scale, swizzled=True):
    from cupy_merge import reference

    want, _ = reference.merge_state(*(np.asarray(x, np.float64) for x in states))
    packed, scales = reference.quantize_nvfp4(want.reshape(len(want), -1), global_scale, is_sf_swizzled_layout=swizzled)
    assert np.asarray(got).dtype == np.uint8 and np.array_equal(np.asarray(got).reshape(packed.shape), packed)
    assert np.array_equal(np.asarray(got_scales).view(np.uint8), scales.view(np.uint8))


@pytest.mark.parametrize("swizzled", [True, False])
def test_jax_returns_nvfp4_bytes_and_block_scales_eagerly_and_under_jit(jax_stand_in, rng, swizzled):
    import cupy_merge.jax as cmj

    jax = jax_stand_in
    states = _jax_states(jax, rng)
    merge = lambda *x: cmj.merge_state(*x, out_dtype="nvfp4", output_scale=300.0, is_sf_swizzled_layout=swizzled)
    for call in (merge, jax.jit(merge)):
        v, s, scales = call(*states)
        assert v.shape == (TOKENS, HEADS, 32) and s.shape == (HEADS, TOKENS)
        _expect_reference_nvfp4(v, scales, states, 300.0, swizzled)


def test_jax_vmap_of_an_nvfp4_merge_maps_each_element_with_its_own_scales(jax_stand_in, rng):
    import cupy_merge.jax as cmj

    jax = jax_stand_in
    states = _jax_states(jax, rng, batch=(3,), tokens=5)
    v, _, scales = jax.vmap(lambda *x: cmj.merge_attn_states(*x, out_dtype="nvfp4", output_scale=50.0))(*states)
    assert v.shape == (3, 5, HEADS, 32) and scales.shape == (3, 128, 16)
    for element in range(3):
        _expect_reference_nvfp4(v[element], scales[element], [x[element] for x in states], 50.0)


def test_jax_refuses_gradients_of_an_nvfp4_merge(jax_stand_in, rng):
    import cupy_merge.jax as cmj

    jax = jax_stand_in
    states = _jax_states(jax, rng)
    loss = lambda v_a: cmj.merge_state(v_a, *states[1:], out_dtype="nvfp4", output_scale=1.0)[1].sum()
    with pytest.raises(TypeError, match="an NVFP4 \\(float4_e2m1fn_x2\\) output is not differentiable"):
        jax.grad(loss)(states[0])


def test_the_kernels_e2m1_rounding_identity_holds_near_every_midpoint_and_breakpoint():
    """cuda_src/fp4.cuh rounds m in [0, 6] to its e2m1 index as the least of three lines (2m, m + 2,
    m / 2 + 4), each one multiply-add onto 1.5 * 2^23. Mirrored here in float32 (the products are
    exact, so one float32 addition is the FMA's one rounding) against the reference's rounding,
    on every float32 within 4,096 units in the last place of each midpoint, breakpoint and end
    (session 27 checked all 1,086,324,737 float32 values in [0, 6])."""
    from cupy_merge._reference_formats import _e2m1_codes

    magic = np.float32(1.5 * 2**23)

    def index(m):
        low = m * np.float32(2) + magic
        middle = m + np.float32(magic + 2)
        high = m * np.float32(0.5) + np.float32(magic + 4)
        return np.minimum(np.minimum(low, middle), high).view(np.uint32) - magic.view(np.uint32)

    points = np.array([0.0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6], np.float32)
    bits = (points.view(np.int32)[:, None] + np.arange(-4096, 4097, dtype=np.int32)).ravel()
    m = bits.view(np.float32)
    m = m[(m >= 0) & (m <= 6)]
    assert np.array_equal(index(m), (_e2m1_codes(m) & 7).astype(np.uint32))


# -- torch.compile and torch.export with values, through the CPU stand-in of the kernels --------------


def _torch_nvfp4_case(rng, swizzled=True, tokens=TOKENS, head_size=64):
    torch = pytest.importorskip("torch")
    v_a, v_b = (torch.from_numpy(rng.standard_normal((tokens, HEADS, head_size)).astype(np.float32)) for _ in range(2))
    s_a, s_b = (torch.from_numpy((rng.standard_normal((HEADS, tokens)) * 3).astype(np.float32)) for _ in range(2))
    out = torch.full((tokens, HEADS, head_size // 2), 0xAB, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    shape = _quantised.nvfp4_scale_shape(tokens, HEADS * head_size // 16, swizzled)
    scales = torch.full(shape, 0xAB, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return (v_a, s_a, v_b, s_b), out, scales, torch.tensor([40.0])


def _expect_torch_nvfp4(out, scales, states, global_scale, swizzled=True):
    from cupy_merge import reference

    want, _ = reference.merge_state(*(x.numpy().astype(np.float64) for x in states))
    packed, want_scales = reference.quantize_nvfp4(want.reshape(len(want), -1), global_scale, is_sf_swizzled_layout=swizzled)
    import torch

    assert np.array_equal(out.view(torch.uint8).numpy().reshape(packed.shape), packed)
    assert np.array_equal(scales.view(torch.uint8).numpy(), want_scales.view(np.uint8))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("swizzled", [True, False])
def test_torch_compile_writes_nvfp4_through_the_registered_op(cpu_kernels, rng, backend, swizzled):
    import torch

    import cupy_merge as cm

    states, out, scales, scale = _torch_nvfp4_case(rng, swizzled)

    def merge(out, scales, v_a, s_a, v_b, s_b, scale):
        cm.merge_attn_states(out, v_a, s_a, v_b, s_b, output_scale=scale, output_block_scale=scales,
                             is_sf_swizzled_layout=swizzled)  # fmt: skip
        return cm.merge_state(v_a, s_a, v_b, s_b)[1]

    torch._dynamo.reset()
    torch.compile(merge, backend=backend, fullgraph=True)(out, scales, *states, scale)
    _expect_torch_nvfp4(out, scales, states, 40.0, swizzled)


def test_torch_export_keeps_an_nvfp4_merge_and_runs_it(cpu_kernels, rng):
    import torch

    import cupy_merge as cm

    states, _, scales, scale = _torch_nvfp4_case(rng)

    class Tail(torch.nn.Module):
        def forward(self, v_a, s_a, v_b, s_b, scale, scales):
            v, _ = cm.merge_state(v_a, s_a, v_b, s_b, out_dtype="nvfp4", output_scale=scale,
                                  output_block_scale=scales)  # fmt: skip
            return v

    program = torch.export.export(Tail(), (*states, scale, scales))
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert any(target.startswith("cupy_merge.merge_state_out") for target in targets), targets
    v = program.module()(*states, scale, scales)
    assert v.dtype == torch.float4_e2m1fn_x2
    _expect_torch_nvfp4(v, scales, states, 40.0)
