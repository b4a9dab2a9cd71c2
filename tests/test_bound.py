"""bind() on the CPU: what it accepts, and the capture that plans without launching."""

from __future__ import annotations

import threading

import pytest

import cupy_merge as cm
from cupy_merge import _dispatch


def test_bind_takes_only_this_librarys_merges():
    with pytest.raises(TypeError, match=r"^merge: expected one of cupy_merge's merges \(merge_attn_states, "):
        cm.bind(print, 1, 2)


def test_bind_refuses_a_stream_which_belongs_to_each_launch():
    with pytest.raises(TypeError, match=r"^stream: pass it to each launch"):
        cm.bind(cm.merge_attn_states, None, None, None, None, None, stream=0)


def test_capture_takes_the_call_instead_of_launching_it():
    call = _dispatch.Call(None, "cupy", 0)
    with _dispatch.capture() as captured:
        _dispatch.run(call, stream=0)
    assert captured.call is call
    assert _dispatch._capturing == 0


def test_capture_that_planned_nothing_says_so():
    with pytest.raises(RuntimeError, match="^bind: the merge planned no launch"), _dispatch.capture():
        pass


def test_capture_on_one_thread_leaves_other_threads_launching():
    call = _dispatch.Call(None, "cupy", 0)
    seen = []
    with _dispatch.capture() as captured:
        worker = threading.Thread(target=lambda: seen.append(_dispatch._take_captured(call)))
        worker.start()
        worker.join()
        _dispatch.run(call, stream=0)
    assert seen == [False]  # the other thread's run() would have launched
    assert captured.call is call


def test_an_error_inside_capture_propagates_and_ends_the_capture():
    with pytest.raises(ValueError, match="bad"), _dispatch.capture():
        raise ValueError("bad")
    assert _dispatch._capturing == 0


def test_captures_on_many_threads_at_once_keep_the_count_exact():
    barrier = threading.Barrier(8)

    def bind_many():
        barrier.wait()
        for _ in range(2000):
            with _dispatch.capture():
                _dispatch.run(_dispatch.Call(None, "cupy", 0), stream=0)

    workers = [threading.Thread(target=bind_many) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert _dispatch._capturing == 0  # no lost update left it off zero
