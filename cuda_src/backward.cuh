// What the two gradient kernels share (merge_backward.cu, merge_backward_from_output.cu): the
// block size, the weights, a row's sums, where a row's states are, and the zeroing of rows; and
// their chunks staged in shared memory (or, held in registers, the L2 prefetch).
#pragma once

#include "conversions.cuh"
#include "grid.cuh"
#include "packs.cuh"
#include "ragged.cuh"

// The tuning's options both gradient kernels read (cupy_merge/_tuning.py): the L2 prefetch of a
// held chunk's successor, and chunks staged in shared memory.
#ifndef MERGE_PREFETCH
#define MERGE_PREFETCH 1
#endif
#ifndef MERGE_ASYNC
#define MERGE_ASYNC 1
#endif

namespace cupy_merge {

// Threads of a block (the planner's BACKWARD_THREADS).
constexpr int kBackwardThreads = 128;

// exp(x) for a weight, as ex2.approx.ftz: weights below 2^-126 of the largest state's add
// nothing a float32 sum keeps, and the flush saves the denormal fix-up (four instructions)
// around every exponential.
__device__ __forceinline__ float backward_weight(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * kLog2E));
  return y;
}

// Every lane of a warp runs every shuffle (the rows of a warp loop to the warp's largest count):
// with a mask known at compile time a shuffle is one instruction, with a row's own mask ptxas
// wraps each in a dozen to make it safe under divergence (session 11, SASS).
constexpr unsigned kWarp = 0xffffffffu;

// The sums of x[0] .. x[N - 1], each over the `lanes` threads of a row (consecutive lanes of one
// warp), every lane getting them: N butterflies side by side, so that their shuffles' latencies
// may overlap (a chunk's states summed one after another were four chains of them), and only the
// levels a row has (`lanes` is the same across the warp: no lane skips a shuffle another runs).
template <int N>
__device__ __forceinline__ void row_sums(float (&x)[N], int lanes) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    if (offset >= lanes) continue;
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] += __shfl_xor_sync(kWarp, x[j], offset, lanes);
  }
}

__device__ __forceinline__ float row_sum(float x, int lanes) {
  float sums[1] = {x};
  row_sums(sums, lanes);
  return sums[0];
}

// The largest `count` of a warp's rows.
template <typename Index>
__device__ __forceinline__ Index warp_max(Index count) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) count = max(count, static_cast<Index>(__shfl_xor_sync(kWarp, count, offset)));
  return count;
}

// Where a row's states of one array are (token and head already applied): state 0 at `first`,
// state i >= 1 at `rest + (i - 1) stride`. Offsets are multiplied in Index: the host checked that
// every offset fits.
template <typename T, typename Index>
struct StatePointers {
  T* first;
  T* rest;
  Index stride;
  static __device__ __forceinline__ StatePointers of(T* p0, T* p1, Index token, Index head, long long first_token,
                                                     long long first_head, long long rest_token, long long rest_head,
                                                     long long stride_state) {
    return {p0 + (token * static_cast<Index>(first_token) + head * static_cast<Index>(first_head)),
            p1 + (token * static_cast<Index>(rest_token) + head * static_cast<Index>(rest_head)),
            static_cast<Index>(stride_state)};
  }
  __device__ __forceinline__ T* at(Index i) const { return i == 0 ? first : rest + (i - 1) * stride; }
};

// Asks L2 for the line holding `address` (no register waits on it). Rows whose chunks are held in
// registers prefetch their next chunk as they load one (MERGE_PREFETCH, the tuning's
// backward_prefetch): they were latency-bound at the occupancy their registers allow (session
// 14, ncu). Staged rows do not: with two chunks staged it measured 1-5 points slower (session 16).
__device__ __forceinline__ void prefetch_l2(const void* address) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
}

// L2 asked for a thread's packs `pack` of the values of states state(0) .. state(CHUNK - 1).
template <int CHUNK, typename InPack, typename TIn, typename Index, int HELD, typename State>
__device__ __forceinline__ void prefetch_chunk(const State& state, const StatePointers<const TIn, Index>& values_of,
                                               const Index (&pack)[HELD]) {
#pragma unroll
  for (int j = 0; j < CHUNK; ++j) {
#pragma unroll
    for (int q = 0; q < HELD; ++q) prefetch_l2(reinterpret_cast<const InPack*>(values_of.at(state(j))) + pack[q]);
  }
}

// Copies global memory to shared without a register waiting on it (cp.async, sm_80 and newer):
// a thread's copies form groups (commit_async), and wait_async<N> waits for all but its newest N
// groups, after which the thread itself may read what they wrote.
//
// Chunks are staged only where a multiprocessor has 228 KB of shared memory (sm_90, sm_100,
// sm_103): 5 staged blocks of up to 42 KB fit there (measured on the H200, session 16). sm_80's
// 164 KB would hold 3 where the held chunks' registers allow 4, sm_86/89/120's 100 KB 2: not
// measured, so those keep the chunks in registers.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || __CUDA_ARCH__ >= 1100)
constexpr bool kStagingFits = false;
#else
constexpr bool kStagingFits = true;
#endif

// Whether rows of PACKS (1 or 2) held packs a lane stage their chunks of CHUNK states in shared
// memory through cp.async (ASYNC: MERGE_ASYNC, the tuning's backward_async), rather than hold a
// chunk in registers across its loads' wait: the long rows were latency-bound at the occupancy
// their registers allow (sessions 12 and 14). Packs of 4, 8 or 16 bytes (what cp.async moves);
// the STAGES chunks' values and LSEs within BUDGET bytes of the 48 KiB of static shared memory
// (the recomputing kernel's other shared arrays take up to 8 KiB of it).
template <bool ASYNC, typename TIn, int VEC, int PACKS, int CHUNK, int STAGES = 2, int BUDGET = 36864>
constexpr bool kStaged = ASYNC && kStagingFits && PACKS > 0 &&
                         (sizeof(TIn) * VEC == 4 || sizeof(TIn) * VEC == 8 || sizeof(TIn) * VEC == 16) &&
                         STAGES * CHUNK * kBackwardThreads * (PACKS * sizeof(TIn) * VEC + sizeof(float)) <= BUDGET;

template <int BYTES>
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async moves 4, 8 or 16 bytes");
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(to), "l"(global), "n"(BYTES) : "memory");
  }
}

__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// The stage after `stage` of STAGES chunks in flight, in turn.
template <int STAGES>
__device__ __forceinline__ int next_stage(int stage) {
  return STAGES == 2 ? stage ^ 1 : (stage + 1 < STAGES ? stage + 1 : 0);
}

template <int N>
__device__ __forceinline__ void wait_async() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A thread's STAGES chunks in flight, staged through cp.async: CHUNK states' LSEs and the
// thread's HELD packs of each one's values, in shared memory the kernel declares
// (values [STAGES][CHUNK][HELD][kBackwardThreads], lses [STAGES][CHUNK][kBackwardThreads]), each
// read only by the thread that staged it (so no barrier).
template <typename InPack, int CHUNK, int HELD, int STAGES = 2>
struct StagedChunks {
  static constexpr int kValueBytes = STAGES * CHUNK * HELD * kBackwardThreads * static_cast<int>(sizeof(InPack));
  static constexpr int kLses = STAGES * CHUNK * kBackwardThreads;
  InPack* values;
  float* lses;
  int thread;

  __device__ __forceinline__ InPack* value_at(int stage, int j, int q) const {
    return values + ((stage * CHUNK + j) * HELD + q) * kBackwardThreads + thread;
  }
  __device__ __forceinline__ float* lse_at(int stage, int j) const { return lses + (stage * CHUNK + j) * kBackwardThreads + thread; }
  __device__ __forceinline__ InPack value(int stage, int j, int q) const { return *value_at(stage, j, q); }
  __device__ __forceinline__ float lse(int stage, int j) const { return *lse_at(stage, j); }

  // Copies the states state(0) .. state(CHUNK - 1) (their LSE, and this thread's packs `pack`
  // of their values) into `stage` as one group; only an empty group where `any` is false.
  template <typename TIn, typename Index, typename State>
  __device__ __forceinline__ void copy(int stage, bool any, const State& state, const StatePointers<const float, Index>& lses_of,
                                       const StatePointers<const TIn, Index>& values_of, const Index (&pack)[HELD]) const {
    if (any) {
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) {
        const Index i = state(j);
        copy_async<4>(lse_at(stage, j), lses_of.at(i));
#pragma unroll
        for (int q = 0; q < HELD; ++q) {
          copy_async<sizeof(InPack)>(value_at(stage, j, q), reinterpret_cast<const InPack*>(values_of.at(i)) + pack[q]);
        }
      }
    }
    commit_async();
  }
};

// A row's token and head, and its states: 0 .. count - 1 from `first` (ragged: rows of the batch,
// none for a row past the last or a token whose offsets are out of range, `bad`).
template <typename Index>
struct BackwardRow {
  Index token, head, first, count;
  bool bad;
};

template <bool RAGGED, typename Index>
__device__ __forceinline__ BackwardRow<Index> backward_row(Index row, bool valid, Index heads, long long head_multiplier,
                                                           long long head_shift, const void* indptr, long long indptr_bytes,
                                                           long long indptr_stride, long long num_states,
                                                           Index dense_count) {
  BackwardRow<Index> r;
  if constexpr (sizeof(Index) == 4) {
    r.token = fast_divide(row, static_cast<unsigned>(head_multiplier), static_cast<unsigned>(head_shift));
  } else {
    r.token = row / heads;
  }
  r.head = row - r.token * heads;
  r.first = 0;
  r.count = dense_count;
  r.bad = false;
  if constexpr (RAGGED) {
    const RaggedRow ragged = ragged_row(indptr, indptr_bytes, indptr_stride, r.token, num_states);
    r.first = static_cast<Index>(ragged.first);
    r.count = valid ? static_cast<Index>(ragged.count) : 0;
    r.bad = ragged.bad;
  }
  return r;
}

// w dV as TIn, and `partial` += this lane's part of <dV, V_i> over one pack.
template <typename TIn, int VEC>
__device__ __forceinline__ Pack<TIn, VEC> state_gradient(float w, const Pack<TIn, VEC>& x, const float (&d)[VEC],
                                                         float& partial) {
  Pack<TIn, VEC> g;
  if constexpr (kIsBfloat16<TIn> && VEC % 2 == 0) {
    // bfloat16 pairs widened from their 32-bit word (a shift, a mask): element by element the
    // upper one took a byte permute and a shift (SASS, session 17).
    const unsigned* words = reinterpret_cast<const unsigned*>(x.v);
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      partial = fmaf(d[k], bfloat16_low(words[k / 2]), partial);
      partial = fmaf(d[k + 1], bfloat16_high(words[k / 2]), partial);
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) partial = fmaf(d[k], to_float(x.v[k]), partial);
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) g.v[k] = from_float<TIn>(w * d[k]);
  // A zero-weight state's gradient is zero even where dV is not finite: selected word by word
  // (a branch around zeroing the pack cost a branch and its reconvergence a pack).
  if constexpr (sizeof(g) % 4 == 0) {
    unsigned* words = reinterpret_cast<unsigned*>(g.v);
#pragma unroll
    for (int k = 0; k < static_cast<int>(sizeof(g) / 4); ++k) words[k] = w == 0.0f ? 0u : words[k];
  } else if (w == 0.0f) {
    g = Pack<TIn, VEC>{};
  }
  return g;
}

// Rows [from, to) of one head's gradients zeroed, by the `lanes` threads of a row.
template <int VEC, typename TIn, typename Index>
__device__ void zero_rows(const StatePointers<TIn, Index>& gv_at, const StatePointers<float, Index>& gs_at, Index from,
                          Index to, int lane, int lanes, Index packs, Index step = 1) {
  for (Index r = from; r < to; r += step) {
    for (Index p = lane; p < packs; p += lanes) store_pack(reinterpret_cast<Pack<TIn, VEC>*>(gv_at.at(r)) + p, {});
    if (lane == 0) *gs_at.at(r) = 0.0f;
  }
}

// The rows of a ragged batch between a bad token's offsets: no token may own them, so zeros, not
// stale memory (by the `lanes` threads of the token's row of one head, every `step`-th from `skip`).
template <int VEC, typename TIn, typename Index>
__device__ void zero_bad_token_rows(const StatePointers<TIn, Index>& gv_at, const StatePointers<float, Index>& gs_at,
                                    const void* indptr, long long indptr_bytes, long long indptr_stride, Index token,
                                    long long num_states, int lane, int lanes, Index packs, Index skip, Index step) {
  const long long begin = indptr_entry(indptr, indptr_bytes, indptr_stride, token);
  const long long end = indptr_entry(indptr, indptr_bytes, indptr_stride, token + 1);
  const auto clamped = [&](long long r) { return static_cast<Index>(min(max(r, 0ll), num_states)); };
  zero_rows<VEC>(gv_at, gs_at, clamped(min(begin, end)) + skip, clamped(max(begin, end)), lane, lanes, packs, step);
}

// The rows of a ragged batch before indptr[0] and from indptr[num_tokens] on belong to no token:
// zeroed by the grid's rows of threads (`thread_row` of `thread_rows`), row-major over (row, head),
// so that neighbouring rows of threads write neighbouring memory. (The gradients are not allocated
// as zeros: that cost a pass over them, session 12.)
template <int VEC, typename TIn, typename Index>
__device__ void zero_unowned_rows(TIn* gv0, TIn* gv1, float* gs0, float* gs1, const void* indptr,
                                  long long indptr_bytes, long long indptr_stride, long long num_states,
                                  long long num_tokens, Index heads, Index packs, long long gv0_stride_head,
                                  long long gv1_stride_head, long long gv_stride_state, long long gs0_stride_head,
                                  long long gs1_stride_head, long long gs_stride_state, Index thread_row,
                                  Index thread_rows, int lane, int lanes) {
  const long long lead = min(max(indptr_entry(indptr, indptr_bytes, indptr_stride, 0), 0ll), num_states);
  const long long trail = min(max(indptr_entry(indptr, indptr_bytes, indptr_stride, num_tokens), lead), num_states);
  const Index unowned = static_cast<Index>(lead + num_states - trail);
  for (Index q = thread_row; q < unowned * heads; q += thread_rows) {
    const Index r = q / heads, head = q - r * heads;
    const Index row = r < lead ? r : static_cast<Index>(trail) + (r - static_cast<Index>(lead));
    const auto gv_at = StatePointers<TIn, Index>::of(gv0, gv1, 0, head, 0, gv0_stride_head, 0, gv1_stride_head,
                                                     gv_stride_state);
    const auto gs_at = StatePointers<float, Index>::of(gs0, gs1, 0, head, 0, gs0_stride_head, 0, gs1_stride_head,
                                                       gs_stride_state);
    zero_rows<VEC>(gv_at, gs_at, row, row + 1, lane, lanes, packs);
  }
}

// The sinks' gradients from the rows' terms ([num_heads, num_tokens], each row's
// w_z (dS - <dV, V>)): grad_sinks[h] = the sum of head h's terms, always in the same order (a block
// of THREADS threads a head, thread x adding tokens x, x + THREADS, ..., then a fixed tree), so
// that the gradient is the same bits on every run (no atomics). A NaN term makes its head's NaN.
template <int THREADS>
__global__ void sum_sink_terms(float* grad_sinks, const float* sink_terms, long long num_tokens, long long num_heads) {
  __shared__ float partial[THREADS];
  for (long long head = blockIdx.x; head < num_heads; head += gridDim.x) {
    const float* terms = sink_terms + head * num_tokens;
    float sum = 0.0f;
    for (long long token = threadIdx.x; token < num_tokens; token += THREADS) sum += terms[token];
    partial[threadIdx.x] = sum;
    __syncthreads();
#pragma unroll
    for (int half = THREADS / 2; half > 0; half /= 2) {
      if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) grad_sinks[head] = partial[0];
    __syncthreads();  // partial is rewritten for the next head
  }
}

}  // namespace cupy_merge
