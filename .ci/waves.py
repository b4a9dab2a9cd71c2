"""The gradients' speed against how full the grid's last wave is: dense rows of 16 states and
ragged rows of ~8 (bfloat16, 32 heads x 128) at token counts whose grids end in a nearly empty or
a nearly full wave. Each row: the kernel's blocks, the blocks a multiprocessor holds (the CUDA
occupancy calculator), the waves they make, and the gradients' time as % of a same-bytes copy
(CUDA events, median, L2 flushed). A sawtooth in the last column says the partial last wave costs
time; a flat one that it does not. Then dense rows whose states are a stack of more tokens than
they use: whether the states' distance apart (a power of two or not) costs time.

Usage (on the GPU machine): python3 .ci/waves.py [held]   (held: chunks held in registers, not staged)
"""

import functools
import sys

import cupy
import numpy

from cupy_merge import _launch, _tuning
from cupy_merge.backward import merge_states_backward, merge_states_varlen_backward
from cupy_merge.tools.sweep import _states
from cupy_merge.tools.timing import copy_us, median_ms

HEADS, HEAD_SIZE = 32, 128
launches = []
_prepare = _launch.prepare


def _recording(launch, device, *args, **kwargs):
    launches.append((launch, device))
    return _prepare(launch, device, *args, **kwargs)


_launch.prepare = _recording


def waves(launch, device) -> tuple[int, int, float]:
    """(blocks, blocks a multiprocessor holds, waves) of one launch."""
    function = _launch.get_function(launch.module, launch.kernel, device)
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        function.pointer, int(numpy.prod(launch.block)), launch.shared_bytes
    )
    sms = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
    blocks = int(numpy.prod(launch.grid))
    return blocks, per_sm, blocks / (per_sm * sms)


def row(label: str, call, nbytes: int) -> str:
    launches.clear()
    call()
    blocks, per_sm, w = waves(*launches[0])
    percent = 100 * copy_us(nbytes) / (median_ms(call) * 1e3)
    return f"{label:<28} {len(launches):>8} {blocks:>7} {per_sm:>6} {w:>6.2f} {percent:>7.1f}"


def gradients(rng, v, s, indptr, tokens: int):
    """The gradients' call for the states ``v``, ``s`` (ragged: ``indptr``) of ``tokens`` tokens, and
    the bytes it moves (the states read and their gradients written, dV and dS read)."""
    grad = cupy.asarray(rng.standard_normal((tokens, HEADS, HEAD_SIZE), dtype=numpy.float32)).astype(v.dtype)
    grad_s = cupy.asarray(rng.standard_normal((HEADS, tokens), dtype=numpy.float32))
    nbytes = 2 * (v.size * v.itemsize + s.size * s.itemsize) + grad.nbytes + grad_s.nbytes
    if indptr is None:
        return functools.partial(merge_states_backward, v, s, grad, grad_s), nbytes
    return functools.partial(merge_states_varlen_backward, v, s, indptr, grad, grad_s), nbytes


def main() -> None:
    rng = numpy.random.default_rng(0)
    print(f"{'case':<28} {'launches':>8} {'blocks':>7} {'per SM':>6} {'waves':>6} {'% copy':>7}")
    # 1040, 1552 and 2064: the grids of 1024, 1536 and 2048 tokens (within 2 %), whose states lie
    # a multiple of 4 MiB apart, 8 KiB a state farther (session 19: 1024, 1536, 2048 the slowest).
    for tokens in (1024, 1040, 1200, 1290, 1400, 1536, 1552, 1650, 2048, 2064):
        v, s, _, label = _states(rng, 16, tokens, HEADS, HEAD_SIZE)
        print(row(label, *gradients(rng, v, s, None, tokens)))
    # The same grids with the states a different distance apart (a stack of `apart` tokens, the
    # first `tokens` of each state taken): whether a power-of-two distance costs time.
    for tokens, apart in ((1024, 1025), (1024, 1040), (1024, 1536), (1290, 2048), (1650, 2048)):
        v, s, _, _ = _states(rng, 16, apart, HEADS, HEAD_SIZE)
        print(
            row(
                f"S=16 T={tokens} apart {apart}",
                *gradients(rng, v[:, :tokens], s[:, :, :tokens], None, tokens),
            )
        )
    for tokens in (512, 600, 660, 792, 900, 1024):  # 0..16 states a token
        v, s, indptr, label = _states(rng, -8, tokens, HEADS, HEAD_SIZE)
        print(row(label, *gradients(rng, v, s, indptr, tokens)))


if __name__ == "__main__":
    with _tuning.use(_tuning.DEFAULT.replace(backward_async="held" not in sys.argv[1:])):
        main()
