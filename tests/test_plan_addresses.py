"""A fuzz of the planner against a model of the kernels' addressing (no GPU needed).

For random shapes, strides, offsets, dtypes and in-place choices, every plan is
replayed thread by thread in Python, with each kernel's index arithmetic (the
packed kernels' fast division included, as ``_plan.fast_divide`` computes it):
every element a launch reads must lie in the array it reads, and every element
of the outputs must be written by exactly one thread.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from views import view

from cupy_merge import _catalogue as cat
from cupy_merge import _dispatch, _plan
from cupy_merge.merge import _MERGE_STATE
from cupy_merge.merge_many import _MERGE_STATES, _MERGE_STATES_VARLEN

CASES = 150


def _elements(v) -> set[int]:
    """Element offsets (from the view's pointer) of every element of a view."""
    ranges = [range(n) for n in v.shape]
    return {sum(i * s for i, s in zip(index, v.strides)) for index in itertools.product(*ranges)}


def _address(v, offset: int) -> int:
    return v.ptr // v.itemsize + offset  # element units at the view's own address


class Memory:
    """What a launch touched: reads checked against their arrays, writes counted."""

    def __init__(self, views: dict):
        self.views = views
        self.allowed = {name: _elements(v) for name, v in views.items() if v is not None}
        self.writes: Counter = Counter()

    def read(self, name: str, offset: int, count: int = 1) -> None:
        for k in range(count):
            assert offset + k in self.allowed[name], f"read outside {name}: element {offset + k}"

    def write(self, name: str, offset: int, count: int = 1) -> None:
        for k in range(count):
            assert offset + k in self.allowed[name], f"write outside {name}: element {offset + k}"
            self.writes[(name, offset + k)] += 1

    def expect_each_output_element_written_once(self) -> None:
        for name in ("out", "out_lse", "scales"):
            if self.views.get(name) is None:
                continue
            written = {offset for (array, offset) in self.writes if array == name}
            assert written == self.allowed[name], (
                f"{name}: {len(self.allowed[name] - written)} elements not written"
            )
        twice = [key for key, n in self.writes.items() if n > 1]
        assert not twice, f"written more than once: {twice[:5]}"


def _args(plan):
    family = next(f for f in cat.FAMILIES if plan.kernel.startswith(f"cupy_merge::{f.name}<"))
    template = dict(zip(family.template, plan.kernel[plan.kernel.index("<") + 1 : -1].split(", ")))
    return family, template, dict(zip(family.params, plan.args))


def _divide(n: int, multiplier: int, shift: int) -> int:
    return _plan.fast_divide(n, _plan.FastDivisor(0, multiplier, shift))


def _packed_position(a: dict, p: int) -> tuple[int, int, int]:
    """(token, pack within the token, head) of output pack ``p``, as the packed kernels find them."""
    token = _divide(p, a["token_multiplier"], a["token_shift"])
    within = p - token * a["packs_per_token"]
    head = _divide(within, a["head_multiplier"], a["head_shift"])
    assert token == p // a["packs_per_token"] and head == within // a["packs_per_row"]
    return token, within, head


def _group_scale(plan, memory: Memory, a: dict, x: int, token: int, within: int, partials: int = 0) -> None:
    """A grouped FP8 plan: blocks hold whole groups, the group's shared word lies in the launch's
    shared memory, and the group's first thread writes its scale."""
    group = a["packs_per_group"]
    assert plan.block[0] % group == 0, "a group would straddle two blocks"
    slot = _divide(x, a["group_multiplier"], a["group_shift"])
    assert slot == x // group and partials + 4 * (slot + 1) <= plan.shared_bytes
    if x == slot * group:
        index = _divide(within, a["group_multiplier"], a["group_shift"])
        assert index == within // group
        memory.write("scales", token * a["group_stride_token"] + index * a["group_stride_group"])


def _threads(plan):
    (gx, _, _), (bx, by, bz) = plan.grid, plan.block
    for block in range(gx):
        for z, y, x in itertools.product(range(bz), range(by), range(bx)):
            yield block, x, y, z


def replay_two(plan, memory: Memory) -> None:
    family, template, a = _args(plan)
    vec = int(template["VEC"])
    if family is cat.TWO_PACKED:
        for block, x, _, _ in _threads(plan):
            p = block * plan.block[0] + x
            if p >= a["total_packs"]:
                continue
            token, within, head = _packed_position(a, p)
            memory.read("s_a", head * a["lse_a_stride_head"] + token * a["lse_a_stride_token"])
            memory.read("s_b", head * a["lse_b_stride_head"] + token * a["lse_b_stride_token"])
            memory.read("v_a", (token * a["a_stride_token"] + within) * vec, vec)
            memory.read("v_b", (token * a["b_stride_token"] + within) * vec, vec)
            memory.write("out", (token * a["out_stride_token"] + within) * vec, vec)
            if a["out_lse"] and within == head * a["packs_per_row"]:
                memory.write("out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"])
            if template["GROUPED"] == "true":
                _group_scale(plan, memory, a, x, token, within)
        return
    rows = int(template["ROWS"])
    tokens, heads, head_size = a["num_tokens"], a["num_heads"], a["head_size"]
    rows_per_block = plan.block[1] * rows
    work_items = -(-tokens // rows_per_block) * heads
    for block, x, y, _ in _threads(plan):
        for work in range(block, work_items, plan.grid[0]):
            head, token_block = work % heads, work // heads
            for r in range(rows):
                token = token_block * rows_per_block + r * plan.block[1] + y
                if token >= tokens:
                    continue
                memory.read("s_a", head * a["lse_a_stride_head"] + token * a["lse_a_stride_token"])
                memory.read("s_b", head * a["lse_b_stride_head"] + token * a["lse_b_stride_token"])
                if a["out_lse"] and x == 0:
                    memory.write(
                        "out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"]
                    )
                for pack in range(x, head_size // vec, plan.block[0]):
                    memory.read(
                        "v_a", token * a["a_stride_token"] + head * a["a_stride_head"] + pack * vec, vec
                    )
                    memory.read(
                        "v_b", token * a["b_stride_token"] + head * a["b_stride_head"] + pack * vec, vec
                    )
                    memory.write(
                        "out", token * a["out_stride_token"] + head * a["out_stride_head"] + pack * vec, vec
                    )


def replay_many(plan, memory: Memory, indptr: list[int] | None) -> None:
    family, template, a = _args(plan)
    vec, chunk = int(template["VEC"]), cat.MERGE_CHUNK
    split_axis = 1 if family is cat.MANY_PACKED else 2
    splits = plan.block[split_axis]

    def states(token, split):
        first, count = (
            (0, a["num_states"]) if indptr is None else (indptr[token], indptr[token + 1] - indptr[token])
        )
        for i0 in range(split * chunk, count, splits * chunk):
            for j in range(chunk):
                yield first + min(i0 + j, count - 1)

    if family is cat.MANY_PACKED:
        for block, x, y, _ in _threads(plan):
            p = block * plan.block[0] + x
            if p >= a["total_packs"]:
                continue
            token, within, head = _packed_position(a, p)
            for i in states(token, y):
                memory.read(
                    "s",
                    i * a["lse_stride_state"] + head * a["lse_stride_head"] + token * a["lse_stride_token"],
                )
                memory.read("v", (i * a["v_stride_state"] + token * a["v_stride_token"] + within) * vec, vec)
            if y == 0:
                memory.write("out", (token * a["out_stride_token"] + within) * vec, vec)
                if a["out_lse"] and within == head * a["packs_per_row"]:
                    memory.write(
                        "out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"]
                    )
                if template["GROUPED"] == "true":
                    partials = (splits - 1) * plan.block[0] * (vec + 3) * 4
                    _group_scale(plan, memory, a, x, token, within, partials)
        return
    tokens, heads, head_size = a["num_tokens"], a["num_heads"], a["head_size"]
    work_items = -(-tokens // plan.block[1]) * heads
    for block, x, y, z in _threads(plan):
        for work in range(block, work_items, plan.grid[0]):
            head, token = work % heads, (work // heads) * plan.block[1] + y
            if token >= tokens:
                continue
            passes = max(1, -(-(head_size // vec) // plan.block[0]))
            for pass_ in range(passes):
                pack = pass_ * plan.block[0] + x
                for i in states(token, z):
                    memory.read(
                        "s",
                        i * a["lse_stride_state"]
                        + head * a["lse_stride_head"]
                        + token * a["lse_stride_token"],
                    )
                    if pack < head_size // vec:
                        memory.read(
                            "v",
                            i * a["v_stride_state"]
                            + token * a["v_stride_token"]
                            + head * a["v_stride_head"]
                            + pack * vec,
                            vec,
                        )
                if z == 0 and pack < head_size // vec:
                    memory.write(
                        "out", token * a["out_stride_token"] + head * a["out_stride_head"] + pack * vec, vec
                    )
                if z == 0 and pass_ == 0 and x == 0 and a["out_lse"]:
                    memory.write(
                        "out_lse", head * a["out_lse_stride_head"] + token * a["out_lse_stride_token"]
                    )


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


@pytest.mark.parametrize("packed", [True, False])
def test_two_way_launches_touch_only_their_arrays_and_write_each_output_once(packed, monkeypatch):
    monkeypatch.setattr(_plan, "PACKED_KERNELS", packed)
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
        arrays = [views[n] for n in ("out", "out_lse", "v_a", "s_a", "v_b", "s_b")] + [None, None, None]
        plan = _dispatch.plan_call(_MERGE_STATE, _plan.TwoStateOptions(), arrays).plan
        memory = Memory(views)
        replay_two(plan, memory)
        memory.expect_each_output_element_written_once()


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("ragged", [False, True])
def test_n_way_launches_touch_only_their_arrays_and_write_each_output_once(packed, ragged, monkeypatch):
    monkeypatch.setattr(_plan, "PACKED_KERNELS", packed)
    monkeypatch.setattr(_plan, "BUSY_THREADS", 64)  # small cases split their states too
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
            operation, states = _MERGE_STATES_VARLEN, rows
        else:
            indptr, states = None, rng.choice([0, 1, 3, 5, 9])
            v = _random_values(rng, (states, tokens, heads, head_size), dtype, 1 << 32)
            s = (
                _lse(rng, (states, heads, tokens), 2 << 32)
                if rng.random() < 0.5
                else view((states, heads, tokens), "float32", 2 << 32)
            )
            index, operation = None, _MERGE_STATES
        views = {
            "v": v, "s": s,
            "out": _random_values(rng, (tokens, heads, head_size), dtype, 5 << 32),
            "out_lse": _lse(rng, (heads, tokens), 6 << 32),
        }  # fmt: skip
        arrays = [views["out"], views["out_lse"], v, s, index, None, None]
        plan = _dispatch.plan_call(operation, _plan.ManyStateOptions(), arrays).plan
        memory = Memory(views)
        if "merge_two_states" in plan.kernel:  # two dense states go to the two-way kernel
            memory = Memory({"v_a": _state(v, 0), "s_a": _state(s, 0), "v_b": _state(v, 1), "s_b": _state(s, 1),
                             "out": views["out"], "out_lse": views["out_lse"]})  # fmt: skip
            replay_two(plan, memory)
        else:
            replay_many(plan, memory, indptr)
        memory.expect_each_output_element_written_once()


def _state(v, index):
    return v._replace(ptr=v.ptr + index * v.strides[0] * v.itemsize, shape=v.shape[1:], strides=v.strides[1:])


@pytest.mark.parametrize("many", [False, True])
def test_fp8_group_scales_are_written_once_each_from_whole_groups(many, monkeypatch):
    monkeypatch.setattr(_plan, "BUSY_THREADS", 64)  # small cases split their states too
    rng = random.Random(7 + many)
    planned = 0
    while planned < CASES // 3:
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
            views = {"v": v, "s": s, "out": out, "out_lse": out_lse, "scales": scales}
            options = _plan.ManyStateOptions(0, None, False, group, 0)
            arrays = [out, out_lse, v, s, None, None, scales]
            operation = _MERGE_STATES
        else:
            views = {
                "v_a": _random_values(rng, (tokens, heads, head_size), dtype, 1 << 32),
                "s_a": _lse(rng, (heads, tokens), 2 << 32),
                "v_b": _random_values(rng, (tokens, heads, head_size), dtype, 3 << 32),
                "s_b": _lse(rng, (heads, tokens), 4 << 32),
                "out": out, "out_lse": out_lse, "scales": scales,
            }  # fmt: skip
            options = _plan.TwoStateOptions(0, None, None, group, 0)
            arrays = [views[n] for n in ("out", "out_lse", "v_a", "s_a", "v_b", "s_b")] + [None, None, scales]
            operation = _MERGE_STATE
        try:
            plan = _dispatch.plan_call(operation, options, arrays).plan
        except ValueError as error:  # a head-major layout: group scales need heads back to back
            assert "heads back to back" in str(error)
            continue
        planned += 1
        _, template, _ = _args(plan)
        assert template["GROUPED"] == "true"
        if "merge_two_states" in plan.kernel and many:
            memory = Memory({"v_a": _state(v, 0), "s_a": _state(s, 0), "v_b": _state(v, 1), "s_b": _state(s, 1),
                             "out": out, "out_lse": out_lse, "scales": scales})  # fmt: skip
            replay_two(plan, memory)
        elif many:
            memory = Memory(views)
            replay_many(plan, memory, None)
        else:
            memory = Memory(views)
            replay_two(plan, memory)
        memory.expect_each_output_element_written_once()
