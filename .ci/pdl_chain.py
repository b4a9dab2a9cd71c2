"""The merge's added time in a CUDA-graph chain (producer -> merge -> consumer), with and without
programmatic dependent launch, against its time alone; and two merges back to back.

The producer writes the merge's input (an elementwise op of attention's output size), the consumer
reads its output. Times are medians of graph replays (CUDA events, 300 replays after 30).

Usage: python3 .ci/pdl_chain.py
"""

import statistics

import torch

import cupy_merge as cm
from cupy_merge import _tuning


def replay_us(graph, repeats=300):
    for _ in range(30):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def graph_of(steps):
    for step in steps:
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    return graph


def main():
    print(f"{'tokens':>6} {'pdl':>4} {'alone':>7} {'chain':>7} {'no merge':>8} {'added':>7} {'2 merges':>9} {'2nd adds':>8}")
    for tokens in (1, 16, 64, 512):
        heads, head_size = 32, 128
        x, v_a, v_b, out, out2 = (torch.randn(tokens, heads, head_size, device="cuda", dtype=torch.bfloat16) for _ in range(5))
        s_a, s_b, out_lse = (torch.randn(heads, tokens, device="cuda") for _ in range(3))
        y = torch.empty_like(out)
        for pdl in (False, True):
            with _tuning.use(_tuning.DEFAULT.replace(programmatic_launch=pdl)):
                merge = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b, out_lse)
                merge_again = cm.bind(cm.merge_attn_states, out2, out, out_lse, v_b, s_b)
            def produce(x=x, v_a=v_a):
                torch.mul(x, 1.0001, out=v_a)

            def consume(out=out, y=y):
                torch.add(out, 1.0, out=y)

            alone = replay_us(graph_of([merge]))
            chain = replay_us(graph_of([produce, merge, consume]))
            base = replay_us(graph_of([produce, consume]))
            two = replay_us(graph_of([produce, merge, merge_again, consume]))
            print(f"{tokens:>6} {pdl!s:>4} {alone:7.2f} {chain:7.2f} {base:8.2f} {chain - base:7.2f} {two:9.2f} {two - chain:8.2f}")


if __name__ == "__main__":
    main()
