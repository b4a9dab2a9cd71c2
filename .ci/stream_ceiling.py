"""What DRAM gives the N-way gradients' access pattern, without the merge's arithmetic: P planes of
a stack ([P, tokens, heads, head_size], bfloat16, a plane apart), each thread reading its 16 bytes
at the same offset of every plane and writing them to a second stack (as the gradient kernel
reads the states and writes their value gradients), against a copy of the same bytes. Variants:
planes padded (not a power of two apart), one more plane read (dV), reads only into one plane
(the forward's pattern), and the library's gradients of the same shape, states stacked plane by
plane and token by token.

Usage (on the GPU machine): python3 .ci/stream_ceiling.py
"""

import cupy

import cupy_merge as cm
from cupy_merge.tools.timing import copy_us, median_ms

HEADS, HEAD_SIZE = 32, 128

SOURCE = r"""
extern "C" __global__ void planes(const int4* __restrict__ src, int4* __restrict__ dst, const int4* __restrict__ extra,
                                  long long src_plane, long long dst_plane, long long packs, int reads, int writes,
                                  int use_extra) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= packs) return;
  int4 x[16];
  #pragma unroll
  for (int p = 0; p < 16; ++p) if (p < reads) x[p] = src[p * src_plane + i];
  const int4 e = use_extra ? extra[i] : make_int4(0, 0, 0, 0);
  #pragma unroll
  for (int p = 0; p < 16; ++p) {
    if (p < writes) {
      int4 y = writes == 1 ? x[0] : x[p];
      #pragma unroll
      for (int q = 1; q < 16; ++q) {
        if (writes == 1 && q < reads) y.x ^= x[q].x, y.y ^= x[q].y, y.z ^= x[q].z, y.w ^= x[q].w;
      }
      y.x ^= e.x;
      dst[p * dst_plane + i] = y;
    }
  }
}
"""


def pattern(kernel, planes: int, tokens: int, pad: int, extra: bool, writes: int) -> tuple[int, float]:
    """(bytes moved, µs) of `planes` planes read, `writes` written, `pad` bytes between planes."""
    plane_bytes = tokens * HEADS * HEAD_SIZE * 2
    stride = (plane_bytes + pad) // 16
    packs = plane_bytes // 16
    src = cupy.empty(planes * stride * 16, dtype=cupy.uint8)
    dst = cupy.empty(max(writes, 1) * stride * 16, dtype=cupy.uint8)
    more = cupy.empty(plane_bytes if extra else 16, dtype=cupy.uint8)
    args = (src, dst, more, cupy.int64(stride), cupy.int64(stride), cupy.int64(packs), cupy.int32(planes),
            cupy.int32(writes), cupy.int32(extra))
    grid = ((packs + 127) // 128,)
    us = median_ms(lambda: kernel(grid, (128,), args)) * 1e3
    return plane_bytes * (planes + writes + (1 if extra else 0)), us


def main() -> None:
    kernel = cupy.RawKernel(SOURCE, "planes")
    rows = []
    for planes, tokens in ((16, 1024), (8, 4096), (4, 4096), (2, 4096), (16, 2048)):
        for pad, extra, writes, what in (
            (0, False, planes, "copy P planes"),
            (4096 + 256, False, planes, "copy P planes, padded"),
            (0, True, planes, "P + dV read, P written (gradients)"),
            (0, False, 1, "P read, 1 written (forward)"),
        ):
            nbytes, us = pattern(kernel, planes, tokens, pad, extra, writes)
            rows.append((f"P={planes} T={tokens}", what, nbytes, us, 100 * copy_us(nbytes) / us))
    generator = cupy.random.default_rng(0)
    for states, tokens in ((16, 1024), (8, 4096), (4, 4096)):
        grad = generator.standard_normal((tokens, HEADS, HEAD_SIZE), dtype=cupy.float32).astype(cupy.float16)
        grad_s = generator.standard_normal((HEADS, tokens), dtype=cupy.float32)
        for layout in ("state-major", "token-major"):
            shape = (states, tokens) if layout == "state-major" else (tokens, states)
            v = generator.standard_normal((*shape, HEADS, HEAD_SIZE), dtype=cupy.float32).astype(cupy.float16)
            if layout == "token-major":
                v = v.transpose(1, 0, 2, 3)
            s = generator.standard_normal((states, HEADS, tokens), dtype=cupy.float32)
            nbytes = 2 * (v.nbytes + s.nbytes) + grad.nbytes + grad_s.nbytes
            us = median_ms(lambda v=v, s=s, grad=grad, grad_s=grad_s: cm.merge_states_backward(v, s, grad, grad_s)) * 1e3
            rows.append((f"S={states} T={tokens}", f"library gradients, {layout} input", nbytes, us,
                         100 * copy_us(nbytes) / us))  # fmt: skip
    print(f"{'case':<14} {'pattern':<40} {'MB':>7} {'us':>8} {'% copy':>7}")
    for case, what, nbytes, us, pct in rows:
        print(f"{case:<14} {what:<40} {nbytes / 1e6:>7.1f} {us:>8.1f} {pct:>7.1f}")


if __name__ == "__main__":
    main()
