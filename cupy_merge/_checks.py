"""The array rules; each error names the argument and what was expected.

Options (LSE base, output dtype, the prefill cut, flags) are normalised before
anything else happens (``_options``), so a bad option never reaches a cache key
or a launch. Array rules come in two kinds:

* *shape rules* (dimensions, dtypes, shapes, strides, devices, alignment
  classes): pure functions of :class:`ArraySpec`, so they run at trace time
  on fake tensors and JAX abstract values, and are tested without a GPU;
* *address rules* (outputs that overlap inputs or each other): functions of
  :class:`ArrayView`, run where addresses exist (eager calls, ``bind``), in
  ``_addresses``.

``check_two`` / ``check_many`` apply every shape rule of one call, inputs
first, then outputs; the rules of single arrays they apply live in
``_array_rules``, those of quantised outputs (FP8, NVFP4) in ``_quantised``,
the address rules in ``_addresses``. The cross-rank merge uses the same rules
(``check_rank``).
"""

from __future__ import annotations

from ._array_rules import (
    LSE_LAYOUT,
    VALUES_LAYOUT,
    expect_aligned,
    expect_device,
    expect_float32,
    expect_index_array,
    expect_lse_shape,
    expect_ndim,
    expect_no_self_overlap,
    expect_output_dtype,
    expect_same_dtype,
    expect_shape,
    expect_sinks,
    expect_state_count,
    expect_token_mask,
    expect_unit_last_stride,
    expect_value_dtype,
)
from ._arrays import ArraySpec
from ._catalogue import (
    NVFP4,
    NVFP4_BLOCK,
)
from ._operands import (
    BackwardOperands,
    BackwardOptions,
    ManyStateOperands,
    ManyStateOptions,
    RankOperands,
    StateShape,
    TwoStateOperands,
    TwoStateOptions,
)
from ._quantised import check_quantisation

# -- whole calls --------------------------------------------------------------------------------


def check_outputs(
    out: ArraySpec, out_lse: ArraySpec | None, state: StateShape, out_name: str, out_lse_name: str, like: str
) -> None:
    """``out`` [tokens, heads, head_size] of any value dtype; ``out_lse`` float32 [heads, tokens]."""
    shape, layout = (state.num_tokens, state.num_heads, state.head_size), f"{VALUES_LAYOUT} of {like}"
    expect_ndim(out, 3, out_name, VALUES_LAYOUT)
    expect_output_dtype(out, out_name)
    if out.dtype == NVFP4:
        if state.head_size % NVFP4_BLOCK or not state.head_size:
            raise ValueError(
                f"{out_name}: an NVFP4 output needs a head_size that is a positive multiple of {NVFP4_BLOCK} (a block "
                f"scale per {NVFP4_BLOCK} values), got head_size {state.head_size}"
            )
        shape = (state.num_tokens, state.num_heads, state.head_size // 2)
        layout = f"[num_tokens, num_heads, head_size // 2] of {like}: two values a byte"
    expect_shape(out, shape, out_name, layout)
    expect_unit_last_stride(out, out_name)
    expect_device(out, state.device, out_name, like)
    expect_aligned(out, out_name)
    expect_no_self_overlap(out, out_name)
    if out_lse is not None:
        expect_ndim(out_lse, 2, out_lse_name, LSE_LAYOUT)
        expect_float32(out_lse, out_lse_name)
        expect_lse_shape(out_lse, (state.num_heads, state.num_tokens), out_lse_name, like)
        expect_device(out_lse, state.device, out_lse_name, like)
        expect_aligned(out_lse, out_lse_name)
        expect_no_self_overlap(out_lse, out_lse_name)


def check_two_inputs(specs: TwoStateOperands, names: TwoStateOperands) -> StateShape:
    """The two input states against each other; their common shape."""
    v_a, s_a, v_b, s_b = specs.v_a, specs.s_a, specs.v_b, specs.s_b
    expect_ndim(v_a, 3, names.v_a, VALUES_LAYOUT)
    expect_ndim(v_b, 3, names.v_b, VALUES_LAYOUT)
    expect_ndim(s_a, 2, names.s_a, LSE_LAYOUT)
    expect_ndim(s_b, 2, names.s_b, LSE_LAYOUT)
    expect_value_dtype(v_a, names.v_a)
    expect_same_dtype(v_b, v_a, names.v_b, names.v_a)
    expect_float32(s_a, names.s_a)
    expect_float32(s_b, names.s_b)
    expect_shape(v_b, v_a.shape, names.v_b, f"the shape of {names.v_a}")
    num_tokens, num_heads, head_size = v_a.shape
    lse_shape = (num_heads, num_tokens)
    expect_lse_shape(s_a, lse_shape, names.s_a, names.v_a)
    expect_lse_shape(s_b, lse_shape, names.s_b, names.v_a)
    expect_unit_last_stride(v_a, names.v_a)
    expect_unit_last_stride(v_b, names.v_b)
    for spec, name in ((v_a, names.v_a), (s_a, names.s_a), (v_b, names.v_b), (s_b, names.s_b)):
        expect_device(spec, v_a.device, name, names.v_a)
        expect_aligned(spec, name)
    return StateShape(num_tokens, num_heads, head_size, v_a.dtype, v_a.device)


def check_two(specs: TwoStateOperands, names: TwoStateOperands, options: TwoStateOptions) -> StateShape:
    """Every shape rule of a two-way call (outputs to be allocated given as fresh specs)."""
    state = check_two_inputs(specs, names)
    check_outputs(specs.out, specs.out_lse, state, names.out, names.out_lse, names.v_a)
    if specs.mask is not None:
        expect_token_mask(specs.mask, state.num_tokens, state.device, names.mask, names.v_a)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, state.num_heads, state.device, names.sinks, names.v_a)
    check_quantisation(specs, names, options, state, ("v_a", "v_b"))
    return state


def check_many_inputs(specs: ManyStateOperands, names: ManyStateOperands) -> tuple[StateShape, int]:
    """Dense (``indptr`` None): ``v`` [states, tokens, heads, head_size], ``s`` [states, heads, tokens].
    Ragged: ``v`` [total_states, heads, head_size], ``s`` [heads, total_states], ``indptr`` [tokens + 1].
    Returns the state shape and the number of states (dense) or rows (ragged)."""
    v, s, indptr = specs.v, specs.s, specs.indptr
    if indptr is None:
        expect_ndim(v, 4, names.v, "[num_states, num_tokens, num_heads, head_size]")
        expect_ndim(s, 3, names.s, "[num_states, num_heads, num_tokens]")
    else:
        expect_ndim(v, 3, names.v, "[total_states, num_heads, head_size]")
        expect_ndim(s, 2, names.s, "[num_heads, total_states]")
        expect_index_array(indptr, names.indptr)
    expect_value_dtype(v, names.v)
    expect_float32(s, names.s)
    if indptr is None:
        num_states, num_tokens, num_heads, head_size = v.shape
        expect_lse_shape(s, (num_states, num_heads, num_tokens), names.s, names.v)
        expect_state_count(num_states, names.v)
    else:
        num_states, num_heads, head_size = v.shape
        num_tokens = indptr.shape[0] - 1
        if tuple(s.shape) != (num_heads, num_states):
            raise ValueError(
                f"{names.s}: expected shape (num_heads, total_states) = {(num_heads, num_states)} from "
                f"{names.v}, got {tuple(s.shape)}"
            )
    expect_unit_last_stride(v, names.v)
    for spec, name in ((v, names.v), (s, names.s), (indptr, names.indptr)):
        if spec is not None:
            expect_device(spec, v.device, name, names.v)
            expect_aligned(spec, name)
    return StateShape(num_tokens, num_heads, head_size, v.dtype, v.device), num_states


def check_many(
    specs: ManyStateOperands, names: ManyStateOperands, options: ManyStateOptions
) -> tuple[StateShape, int]:
    """Every shape rule of an N-way call (outputs to be allocated given as fresh specs)."""
    state, num_states = check_many_inputs(specs, names)
    check_outputs(specs.out, specs.out_lse, state, names.out, names.out_lse, names.v)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, state.num_heads, state.device, names.sinks, names.v)
    check_quantisation(specs, names, options, state, ("v",))
    return state, num_states


# -- gradients ------------------------------------------------------------------------------------


def check_backward(
    specs: BackwardOperands, names: BackwardOperands, options: BackwardOptions
) -> tuple[StateShape, int]:
    """Every shape rule of a merge's gradient: the states as the forward merge takes them, and the
    gradients of its results (a two-way merge's when ``v_b`` is given). Returns the state shape
    and the number of states (or rows)."""
    del options  # every option is valid here
    if specs.v_b is not None:
        state = check_two_inputs(
            TwoStateOperands(None, None, specs.v, specs.s, specs.v_b, specs.s_b),
            TwoStateOperands(None, None, names.v, names.s, names.v_b, names.s_b),
        )
        num_states = 2
    else:
        state, num_states = check_many_inputs(
            ManyStateOperands(None, None, specs.v, specs.s, specs.indptr),
            ManyStateOperands(None, None, names.v, names.s, names.indptr),
        )
    like = names.v
    _expect_token_values(specs.grad_out, names.grad_out, state, like)
    expect_value_dtype(specs.grad_out, names.grad_out)
    if specs.grad_lse is not None:
        _expect_token_lse(specs.grad_lse, names.grad_lse, state, like)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, state.num_heads, state.device, names.sinks, like)
    _check_merge_results(specs, names, state)
    return state, num_states


def _expect_token_values(spec: ArraySpec, name: str, state: StateShape, like: str) -> None:
    """A gradient's array of one row of values a token: ``[num_tokens, num_heads, head_size]``."""
    expect_ndim(spec, 3, name, VALUES_LAYOUT)
    expect_shape(spec, (state.num_tokens, state.num_heads, state.head_size), name,
                 f"{VALUES_LAYOUT} of the merge of {like}")  # fmt: skip
    expect_unit_last_stride(spec, name)
    expect_device(spec, state.device, name, like)
    expect_aligned(spec, name)


def _expect_token_lse(spec: ArraySpec, name: str, state: StateShape, like: str) -> None:
    """A gradient's array of one LSE a token: float32 ``[num_heads, num_tokens]``."""
    expect_ndim(spec, 2, name, LSE_LAYOUT)
    expect_float32(spec, name)
    expect_lse_shape(spec, (state.num_heads, state.num_tokens), name, like)
    expect_device(spec, state.device, name, like)
    expect_aligned(spec, name)


def _check_merge_results(specs: BackwardOperands, names: BackwardOperands, state: StateShape) -> None:
    """The merge's results, given to a gradient: both or neither, as the merge returned them (the
    values in ``grad_out``'s dtype and shape, the LSE float32 ``[num_heads, num_tokens]``)."""
    merged, merged_lse = specs.merged, specs.merged_lse
    if merged is None and merged_lse is None:
        return
    if merged is None or merged_lse is None:
        given, missing = (names.merged, names.merged_lse) if merged is not None else (names.merged_lse, names.merged)
        raise ValueError(f"{missing}: expected it with {given} (the merge's results, both or neither), got None")
    _expect_token_values(merged, names.merged, state, names.v)
    if merged.dtype != specs.grad_out.dtype:
        raise TypeError(
            f"{names.merged}: expected the dtype of {names.grad_out} ({specs.grad_out.dtype}), the merge's output "
            f"dtype, got {merged.dtype}"
        )
    _expect_token_lse(merged_lse, names.merged_lse, state, names.v)


# -- the cross-rank merge -----------------------------------------------------------------------


#: The cross-rank merge's argument names.
RANK_NAMES = RankOperands("v", "s", "out", "out_lse", "sinks")


def check_rank(
    specs: RankOperands, names: RankOperands, world: int, shard_heads: bool
) -> tuple[StateShape, int]:
    """Every shape rule of a cross-rank merge (``specs`` holds ArraySpecs, CPU tensors on
    :data:`HOST`): one rank's state as a two-way merge's input, its outputs as a merge's outputs
    of the result's heads. Returns the state shape and the heads of the result."""
    v, s = specs.v, specs.s
    expect_ndim(v, 3, names.v, VALUES_LAYOUT)
    expect_ndim(s, 2, names.s, LSE_LAYOUT)
    expect_value_dtype(v, names.v)
    expect_float32(s, names.s)
    expect_unit_last_stride(v, names.v)  # the pack and scale kernels read a row's elements one after another
    num_tokens, num_heads, head_size = v.shape
    expect_lse_shape(s, (num_heads, num_tokens), names.s, names.v)
    for spec, name in ((v, names.v), (s, names.s)):
        expect_device(spec, v.device, name, names.v)
        expect_aligned(spec, name)
    if shard_heads and num_heads % world:
        raise ValueError(
            f"{names.v}: expected num_heads divisible by the {world} ranks to shard heads over them, got {num_heads}"
        )
    heads = num_heads // world if shard_heads else num_heads
    result = StateShape(num_tokens, heads, head_size, v.dtype, v.device)
    check_outputs_of_result(specs.out, specs.out_lse, result, names)
    if specs.sinks is not None:
        expect_sinks(specs.sinks, num_heads, v.device, names.sinks, names.v)
    state = StateShape(num_tokens, num_heads, head_size, v.dtype, v.device)
    return state, heads


def check_outputs_of_result(out, out_lse, result: StateShape, names: RankOperands) -> None:
    """A cross-rank merge's outputs: the result's shape and dtype, then a merge output's rules."""
    for spec, name, shape, dtype in (
        (out, names.out, (result.num_tokens, result.num_heads, result.head_size), result.dtype),
        (out_lse, names.out_lse, (result.num_heads, result.num_tokens), "float32"),
    ):
        if spec is None:
            continue
        if tuple(spec.shape) != shape or spec.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} of shape {shape}, got {spec.dtype} of shape {tuple(spec.shape)}")
        if spec is out:
            expect_unit_last_stride(spec, name)
        expect_device(spec, result.device, name, names.v)
        expect_aligned(spec, name)
        expect_no_self_overlap(spec, name)
