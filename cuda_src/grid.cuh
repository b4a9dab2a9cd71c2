// Where a thread is in the grid, and when a grid may start: work numbering, the packed
// kernels' pack positions, programmatic dependent launch.
#pragma once

namespace cupy_merge {

// Work items (a block's tokens of one head) are numbered head-fastest, so that
// blocks running at the same time read neighbouring heads of the same tokens:
// contiguous memory (1-2 points of copy speed over token-fastest, benchmarks/PERF.md).
__device__ __forceinline__ long long block_head(long long work, long long num_heads) { return work % num_heads; }
__device__ __forceinline__ long long block_token_block(long long work, long long num_heads) { return work / num_heads; }

// n / d for 0 <= n < 2^31 as a multiply-high, an add and a shift; the host finds
// multiplier and shift for each divisor d (cupy_merge/_plan.py, fast_divisor).
__device__ __forceinline__ int fast_divide(int n, unsigned multiplier, unsigned shift) {
  return static_cast<int>((__umulhi(static_cast<unsigned>(n), multiplier) + static_cast<unsigned>(n)) >> shift);
}

// The packed kernels number output packs over (token, head, pack) with no gaps; pack p
// lies in `token`, at `within` packs from the token's first (its head's packs and the
// heads before), in `head`.
struct PackPosition {
  int token, within, head;
};

__device__ __forceinline__ PackPosition pack_position(int p, bool valid, int packs_per_token, unsigned token_multiplier,
                                                      unsigned token_shift, unsigned head_multiplier,
                                                      unsigned head_shift) {
  PackPosition at;
  at.token = valid ? fast_divide(p, token_multiplier, token_shift) : 0;
  at.within = p - at.token * packs_per_token;
  at.head = fast_divide(at.within, head_multiplier, head_shift);
  return at;
}

// Programmatic dependent launch (sm_90 and newer). A merge launched with the
// programmatic-serialisation attribute starts while the kernel before it drains:
// it lets its own dependents launch at once, computes its indices, and waits for
// the kernel before it (which made its inputs) only before its first load. Launched
// without the attribute, both instructions return at once.
__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cupy_merge
