"""A fuzz of the planner against a model of the kernels' addressing (no GPU needed).

For random shapes, strides, offsets, dtypes and in-place choices, every plan is
replayed thread by thread in Python, with each kernel's index arithmetic (the
packed kernels' fast division included, as ``_plan.fast_divide`` computes it),
launch after launch, through its pointer slots bound to the arrays' addresses
(``views.bound_args``): every element a launch reads must lie in the array its
slot names, no launch may read what an earlier one overwrote, and every element
of the outputs must be written by exactly one thread.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from views import bound_args, family, plan_checked, slot_fields, template, view

from cupy_merge import _catalogue as cat
from cupy_merge import _plan, _tuning
from cupy_merge._operands import ManyStateOptions, TwoStateOptions
from cupy_merge._ops import MERGE_ATTN_STATES, MERGE_STATE, MERGE_STATES, MERGE_STATES_VARLEN

CASES = 150
OUTPUTS = ("out", "out_lse", "output_block_scale")


def _elements(v) -> set[int]:
    """Byte addresses of every element of a view."""
    ranges = [range(n) for n in v.shape]
    return {
        v.ptr + sum(i * s for i, s in zip(index, v.strides)) * v.itemsize
        for index in itertools.product(*ranges)
    }


class Memory:
    """What a plan's launches touched: reads checked against the arrays their slots name, writes counted.

    ``within``: a pointer parameter whose reads must stay in a part of its array (a state's slice)."""

    def __init__(self, views: dict, within: dict | None = None):
        self.views = {name: v for name, v in views.items() if v is not None}
        self.allowed = {name: _elements(v) for name, v in self.views.items()}
        self.within = {param: _elements(v) for param, v in (within or {}).items()}
        self.writes: Counter = Counter()
        self.written_by: dict = {}  # (field, address) -> the launch that wrote it

    def expect_each_output_element_written_once(self) -> None:
        for name in OUTPUTS:
            if name not in self.views:
                continue
            written = {address for (array, address) in self.writes if array == name}
            assert written == self.allowed[name], (
                f"{name}: {len(self.allowed[name] - written)} elements not written"
            )
        twice = [key for key, n in self.writes.items() if n > 1]
        assert not twice, f"written more than once: {twice[:5]}"


class Launch:
    """One launch of a plan, its pointer slots bound to the views' addresses, replayed into ``memory``."""

    def __init__(self, launch, memory: Memory, number: int = 0):
        self.launch, self.memory, self.number = launch, memory, number
        self.family, self.template = family(launch), template(launch)
        self.args = bound_args(launch, memory.views)
        self.fields = {param: field for param, (field, _) in slot_fields(launch).items()}
        assert (self.template["SINKS"] == "true") == ("sinks" in self.fields), "sinks read iff given"

    def _addresses(self, param: str, offset: int, count: int) -> tuple[str, list[int]]:
        assert param in self.fields, f"{self.launch.kernel}: {param} dereferenced through a null pointer"
        field = self.fields[param]
        itemsize = self.memory.views[field].itemsize
        return field, [self.args[param] + (offset + k) * itemsize for k in range(count)]

    def read(self, param: str, offset: int, count: int = 1) -> None:
        field, addresses = self._addresses(param, offset, count)
        for address in addresses:
            assert address in self.memory.allowed[field], (
                f"read outside {field} through {param}: {address:#x}"
            )
            if param in self.memory.within:
                assert address in self.memory.within[param], f"{param} read outside its part of {field}"
            for output in OUTPUTS:
                earlier = self.memory.written_by.get((output, address), self.number)
                assert earlier >= self.number, f"{param} read what launch {earlier} already overwrote"

    def write(self, param: str, offset: int, count: int = 1) -> None:
        field, addresses = self._addresses(param, offset, count)
        for address in addresses:
            assert address in self.memory.allowed[field], (
                f"write outside {field} through {param}: {address:#x}"
            )
            self.memory.writes[(field, address)] += 1
            self.memory.written_by[(field, address)] = self.number


def replay(plan, memory: Memory, replay_one, *args) -> None:
    assert plan, "nothing planned"
    for number, launch in enumerate(plan):
        replay_one(Launch(launch, memory, number), *args)


def _divide(n: int, multiplier: int, shift: int) -> int:
    return _plan.fast_divide(n, _plan.FastDivisor(0, multiplier, shift))


def _packed_position(a: dict, p: int) -> tuple[int, int, int]:
    """(token, pack within the token, head) of output pack ``p``, as the packed kernels find them."""
    token = _divide(p, a["token_multiplier"], a["token_shift"])
    within = p - token * a["packs_per_token"]
    head = _divide(within, a["head_multiplier"], a["head_shift"])
    assert token == p // a["packs_per_token"] and head == within // a["packs_per_row"]
    return token, within, head


def _group_scale(run: Launch, x: int, token: int, within: int, partials: int = 0) -> None:
    """A grouped FP8 plan: blocks hold whole groups, the group's shared word lies in the launch's
    shared memory, and the group's first thread writes its scale."""
    plan, a = run.launch, run.args
    group = a["packs_per_group"]
    assert plan.block[0] % group == 0, "a group would straddle two blocks"
    slot = _divide(x, a["group_multiplier"], a["group_shift"])
    assert slot == x // group and partials + 4 * (slot + 1) <= plan.shared_bytes
    if x == slot * group:
        index = _divide(within, a["group_multiplier"], a["group_shift"])
        assert index == within // group
        run.write(
            "output_block_scale",
            token * a["block_scale_stride_token"] + index * a["block_scale_stride_group"],
        )


def _threads(plan):
    (gx, _, _), (bx, by, bz) = plan.grid, plan.block
    for block in range(gx):
        for z, y, x in itertools.product(range(bz), range(by), range(bx)):
            yield block, x, y, z


def _sink(run: Launch, head: int) -> None:
    if run.template["SINKS"] == "true":
        run.read("sinks", head * run.args["sinks_stride"])


def replay_two(run: Launch) -> None:
    plan, a = run.launch, run.args
    vec = int(run.template["VEC"])
    if run.family is cat.TWO_PACKED:
        for block, x, _, _ in _threads(plan):
            p = block * plan.block[0] + x
            if p >= a["total_packs"]:
                continue
            token, within, head = _packed_position(a, p)
            run.read("lse_a", head * a["lse_a_stride_head"] + token * a["lse_a_stride_token"])
            run.read("lse_b", head * a["lse_b_stride_head"] + token * a["lse_b_stride_token"])
            _sink(run, head)
            run.read("v_a", (token * a["a_stride_token"] + within) * vec, vec)
            run.read("v_b", (token * a["b_stride_token"] + within) * vec, vec)
            run.write("out", (token * a["out_stride_token"] + within) * vec, vec)
            if a["out_lse"] and within == head * a["packs_per_row"]:
                run.write("out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"])
            if run.template["GROUPED"] == "true":
                _group_scale(run, x, token, within)
        return
    rows = int(run.template["ROWS"])
    tokens, heads, head_size = a["num_tokens"], a["num_heads"], a["head_size"]
    rows_per_block = plan.block[1] * rows
    work_items = -(-tokens // rows_per_block) * heads
    for block, x, y, _ in _threads(plan):
        for work in range(block, work_items, plan.grid[0]):
            head, token_block = work % heads, work // heads
            _sink(run, head)
            for r in range(rows):
                token = token_block * rows_per_block + r * plan.block[1] + y
                if token >= tokens:
                    continue
                run.read("lse_a", head * a["lse_a_stride_head"] + token * a["lse_a_stride_token"])
                run.read("lse_b", head * a["lse_b_stride_head"] + token * a["lse_b_stride_token"])
                if a["out_lse"] and x == 0:
                    run.write("out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"])
                for pack in range(x, head_size // vec, plan.block[0]):
                    run.read("v_a", token * a["a_stride_token"] + head * a["a_stride_head"] + pack * vec, vec)
                    run.read("v_b", token * a["b_stride_token"] + head * a["b_stride_head"] + pack * vec, vec)
                    run.write(
                        "out", token * a["out_stride_token"] + head * a["out_stride_head"] + pack * vec, vec
                    )


def replay_many(run: Launch, indptr: list[int] | None, chunk: int) -> None:
    plan, a = run.launch, run.args
    vec = int(run.template["VEC"])
    split_axis = 1 if run.family is cat.MANY_PACKED else 2
    splits = plan.block[split_axis]

    def states(token, split):
        if indptr is None:
            first, count = 0, a["num_states"]
        else:
            run.read("indptr", token * a["indptr_stride"])
            run.read("indptr", (token + 1) * a["indptr_stride"])
            first, count = indptr[token], indptr[token + 1] - indptr[token]
        for i0 in range(split * chunk, count, splits * chunk):
            for j in range(chunk):
                yield first + min(i0 + j, count - 1)

    if run.family is cat.MANY_PACKED:
        for block, x, y, _ in _threads(plan):
            p = block * plan.block[0] + x
            if p >= a["total_packs"]:
                continue
            token, within, head = _packed_position(a, p)
            for i in states(token, y):
                run.read(
                    "lse",
                    i * a["lse_stride_state"] + head * a["lse_stride_head"] + token * a["lse_stride_token"],
                )
                run.read("v", (i * a["v_stride_state"] + token * a["v_stride_token"] + within) * vec, vec)
            if y == 0:
                _sink(run, head)
                run.write("out", (token * a["out_stride_token"] + within) * vec, vec)
                if a["out_lse"] and within == head * a["packs_per_row"]:
                    run.write("out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"])
                if run.template["GROUPED"] == "true":
                    partials = (splits - 1) * plan.block[0] * (vec + 3) * 4
                    _group_scale(run, x, token, within, partials)
        return
    tokens, heads, head_size = a["num_tokens"], a["num_heads"], a["head_size"]
    work_items = -(-tokens // plan.block[1]) * heads
    for block, x, y, z in _threads(plan):
        for work in range(block, work_items, plan.grid[0]):
            head, token = work % heads, (work // heads) * plan.block[1] + y
            if token >= tokens:
                continue
            _sink(run, head)
            passes = max(1, -(-(head_size // vec) // plan.block[0]))
            for pass_ in range(passes):
                pack = pass_ * plan.block[0] + x
                for i in states(token, z):
                    run.read(
                        "lse",
                        i * a["lse_stride_state"]
                        + head * a["lse_stride_head"]
                        + token * a["lse_stride_token"],
                    )
                    if pack < head_size // vec:
                        run.read(
                            "v",
                            i * a["v_stride_state"]
                            + token * a["v_stride_token"]
                            + head * a["v_stride_head"]
                            + pack * vec,
                            vec,
                        )
                if z == 0 and pack < head_size // vec:
                    run.write(
                        "out", token * a["out_stride_token"] + head * a["out_stride_head"] + pack * vec, vec
                    )
                if z == 0 and pass_ == 0 and x == 0 and a["out_lse"]:
                    run.write("out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"])


def _random_values(rng, shape, dtype, ptr):
    """A view of ``shape`` cut at a random element offset from a padded buffer; sometimes the
    buffer holds the last two leading axes the other way round (head-major)."""
    padded = [n + rng.choice([0, 0, 1, 3]) for n in shape[:-1]] + [shape[-1] + rng.choice([0, 0, 0, 8, 5])]
    order = list(range(len(shape)))
    if len(shape) >= 3 and rng.random() < 0.2:
        order[-3], order[-2] = order[-2], order[-3]
    strides, step = [0] * len(shape), 1
    for axis in reversed(order):
        strides[axis] = step
        step *= padded[axis]
    offset = rng.choice([0, 0, padded[-1] - shape[-1]])
    itemsize = {"float32": 4, "float8_e4m3fn": 1}.get(dtype, 2)
    return view(shape, dtype, ptr + offset * itemsize, strides)


def _lse(rng, shape, ptr):
    if rng.random() < 0.5:
        return view(shape, "float32", ptr)
    transposed = view(shape[::-1], "float32", ptr)  # token-major buffer, passed transposed
    return transposed._replace(shape=shape, strides=transposed.strides[::-1])


def _with_fresh(planned, views: dict) -> dict:
    """``views`` and the outputs the run allocates (C-contiguous, at fresh addresses), as their
    addresses are patched into the launches."""
    views = dict(views)
    for number, output in enumerate(planned.fresh):
        views[output.field] = view(output.shape, output.dtype, (14 + number) << 32)
    return views


def _sinks(rng, heads):
    """Sometimes attention sinks, at any stride."""
    if rng.random() < 0.25:
        return view((heads,), "float32", 9 << 32, strides=(rng.choice([1, 1, 3]),))
    return None


@pytest.mark.parametrize("packed", [True, False])
def test_two_way_launches_touch_only_their_arrays_and_write_each_output_once(packed):
    tuning = _tuning.DEFAULT.replace(packed_kernels=packed)
    rng = random.Random(1234 + packed)
    for case in range(CASES):
        tokens, heads = rng.randint(1, 9), rng.randint(1, 4)
        head_size = rng.choice([1, 4, 8, 16, 24, 40, 64, 256])
        dtype = rng.choice(["float32", "float16", "bfloat16"])
        out_dtype = rng.choice([dtype, "float32", "bfloat16"])
        views = {
            "v_a": _random_values(rng, (tokens, heads, head_size), dtype, 1 << 32),
            "s_a": _lse(rng, (heads, tokens), 2 << 32),
            "v_b": _random_values(rng, (tokens, heads, head_size), dtype, 3 << 32),
            "s_b": _lse(rng, (heads, tokens), 4 << 32),
            "out": _random_values(rng, (tokens, heads, head_size), out_dtype, 5 << 32),
            "out_lse": _lse(rng, (heads, tokens), 6 << 32) if rng.random() < 0.8 else None,
        }
        if rng.random() < 0.2 and out_dtype == dtype:
            views["out"] = views["v_a"]  # in place
        if rng.random() < 0.2 and views["out_lse"] is not None:
            views["out_lse"] = views["s_b"]
        views["sinks"] = _sinks(rng, heads)
        # Without out_lse: merge_state allocates it, merge_attn_states does not write it.
        operation = MERGE_STATE if views["out_lse"] is not None or rng.random() < 0.5 else MERGE_ATTN_STATES
        planned = plan_checked(operation, TwoStateOptions(), views, tuning)
        allocated = views["out_lse"] is None and operation is MERGE_STATE
        assert [f.field for f in planned.fresh] == (["out_lse"] if allocated else [])
        memory = Memory(_with_fresh(planned, views))
        replay(planned.plan, memory, replay_two)
        memory.expect_each_output_element_written_once()


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("ragged", [False, True])
def test_n_way_launches_touch_only_their_arrays_and_write_each_output_once(packed, ragged):
    # busy_threads 64: small cases split their states too.
    tuning = _tuning.DEFAULT.replace(packed_kernels=packed, busy_threads=64)
    rng = random.Random(99 + 2 * packed + ragged)
    for case in range(CASES // 2):
        tokens, heads = rng.randint(1, 6), rng.randint(1, 3)
        head_size = rng.choice([2, 8, 16, 24, 64])
        dtype = rng.choice(["float32", "float16", "bfloat16"])
        if ragged:
            counts = [rng.randint(0, 7) for _ in range(tokens)]
            indptr = [0]
            for count in counts:
                indptr.append(indptr[-1] + count)
            rows = indptr[-1]
            v = _random_values(rng, (rows, heads, head_size), dtype, 1 << 32)
            s = _lse(rng, (heads, rows), 2 << 32)
            index = view((tokens + 1,), "int32", 7 << 32)
            operation, states = MERGE_STATES_VARLEN, rows
        else:
            indptr, states = None, rng.choice([0, 1, 2, 3, 5, 9])
            v = _random_values(rng, (states, tokens, heads, head_size), dtype, 1 << 32)
            s = (
                _lse(rng, (states, heads, tokens), 2 << 32)
                if rng.random() < 0.5
                else view((states, heads, tokens), "float32", 2 << 32)
            )
            index, operation = None, MERGE_STATES
        views = {
            "v": v, "s": s, "indptr": index,
            "out": _random_values(rng, (tokens, heads, head_size), dtype, 5 << 32),
            "out_lse": _lse(rng, (heads, tokens), 6 << 32),
            "sinks": _sinks(rng, heads),
        }  # fmt: skip
        planned = plan_checked(operation, ManyStateOptions(), views, tuning)
        if "merge_two_states" in planned.plan[0].kernel:  # two dense states go to the two-way kernel
            assert states == 2 and not ragged
            # Through slots into v and s: each state's reads stay in that state's slice.
            memory = Memory(views, {"v_a": _state(v, 0), "lse_a": _state(s, 0), "v_b": _state(v, 1),
                                    "lse_b": _state(s, 1)})  # fmt: skip
            replay(planned.plan, memory, replay_two)
        else:
            memory = Memory(views)
            replay(planned.plan, memory, replay_many, indptr, tuning.merge_chunk)
        memory.expect_each_output_element_written_once()


def _state(v, index):
    return v._replace(ptr=v.ptr + index * v.strides[0] * v.itemsize, shape=v.shape[1:], strides=v.strides[1:])


@pytest.mark.parametrize("many", [False, True])
def test_fp8_group_scales_are_written_once_each_from_whole_groups(many):
    tuning = _tuning.DEFAULT.replace(busy_threads=64)  # small cases split their states too
    rng = random.Random(7 + many)
    planned_cases = 0
    while planned_cases < CASES // 3:
        tokens, heads = rng.randint(1, 7), rng.randint(1, 4)
        head_size = rng.choice([8, 16, 24, 40, 48, 64, 96, 128])
        group = rng.choice([d for d in range(1, head_size + 1) if head_size % d == 0])
        dtype = rng.choice(["float32", "float16", "bfloat16"])
        groups = heads * head_size // group
        scales = _lse(rng, (tokens, groups), 8 << 32)
        out = _random_values(rng, (tokens, heads, head_size), "float8_e4m3fn", 5 << 32)
        out_lse = _lse(rng, (heads, tokens), 6 << 32)
        if many:
            states = rng.choice([2, 3, 9])
            v = _random_values(rng, (states, tokens, heads, head_size), dtype, 1 << 32)
            s = _lse(rng, (states, heads, tokens), 2 << 32)
            views = {"v": v, "s": s, "out": out, "out_lse": out_lse, "output_block_scale": scales}
            options, operation = ManyStateOptions(group_size=group), MERGE_STATES
        else:
            views = {
                "v_a": _random_values(rng, (tokens, heads, head_size), dtype, 1 << 32),
                "s_a": _lse(rng, (heads, tokens), 2 << 32),
                "v_b": _random_values(rng, (tokens, heads, head_size), dtype, 3 << 32),
                "s_b": _lse(rng, (heads, tokens), 4 << 32),
                "out": out, "out_lse": out_lse, "output_block_scale": scales,
            }  # fmt: skip
            options, operation = TwoStateOptions(group_size=group), MERGE_STATE
        try:
            planned = plan_checked(operation, options, views, tuning)
        except ValueError as error:  # a head-major layout: group scales need heads back to back
            assert "heads back to back" in str(error)
            continue
        planned_cases += 1
        (launch,) = planned.plan
        assert template(launch)["GROUPED"] == "true"
        memory = Memory(views)
        if "merge_two_states" in launch.kernel and many:
            memory = Memory(views, {"v_a": _state(v, 0), "lse_a": _state(s, 0), "v_b": _state(v, 1),
                                    "lse_b": _state(s, 1)})  # fmt: skip
            replay(planned.plan, memory, replay_two)
        elif many:
            replay(planned.plan, memory, replay_many, None, tuning.merge_chunk)
        else:
            replay(planned.plan, memory, replay_two)
        memory.expect_each_output_element_written_once()


@pytest.mark.parametrize(
    "dtype, head_size, group",
    [("bfloat16", 8 * 1025, 200), ("float32", 4 * 1032, 96), ("float16", 8 * 1024, 128)],
)
def test_an_in_place_lse_with_group_scales_is_written_once_whatever_the_row_length(dtype, head_size, group):
    # Rows of more than 1024 packs do not fit a block: the LSE is written by a second launch,
    # after the first read the old one; 1024 packs still fit, and one launch writes everything.
    tokens, heads = 2, 2
    views = {
        "v_a": view((tokens, heads, head_size), dtype, 1 << 32),
        "s_a": view((heads, tokens), "float32", 2 << 32),
        "v_b": view((tokens, heads, head_size), dtype, 3 << 32),
        "s_b": view((heads, tokens), "float32", 4 << 32),
        "out": view((tokens, heads, head_size), "float8_e4m3fn", 5 << 32),
        "output_block_scale": view((tokens, heads * head_size // group), "float32", 8 << 32),
    }
    views["out_lse"] = views["s_a"]
    planned = plan_checked(MERGE_STATE, TwoStateOptions(group_size=group), views)
    vec = int(template(planned.plan[0])["VEC"])
    assert len(planned.plan) == (2 if head_size // vec > 1024 else 1)
    memory = Memory(views)
    replay(planned.plan, memory, replay_two)
    memory.expect_each_output_element_written_once()
