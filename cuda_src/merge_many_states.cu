// One-pass merge of any number of attention states (section 2.2 of arXiv 2501.01005):
//   lse = log(sum_i exp(lse_i))
//   out = sum_i exp(lse_i - lse) * v_i
//
// Dense (indptr == nullptr): token t merges states 0..num_states-1:
//   v    [num_states, num_tokens, num_heads, head_size]   TIn
//   lse  [num_states, num_heads, num_tokens]              float32
// Ragged (indptr given, int32 or int64, num_tokens + 1 entries): token t merges
// rows indptr[t] .. indptr[t+1]-1; the token strides are then 0 and
//   v    [total_states, num_heads, head_size],  lse [num_heads, total_states].
// Out-of-range indptr entries (negative, decreasing, past total_states) give a
// NaN row; the host checks them first unless told not to.
// Output: out [num_tokens, num_heads, head_size] TOut, out_lse [num_heads, num_tokens].
//
// Launch: block (threads_x, rows_y, splits), a 1-D grid over work items (rows_y
// tokens of one head). Thread (x, y, z) takes pack x of token y's row over the
// states z, z + splits, ...: MERGE_CHUNK states at a time, all their LSEs and
// value packs loaded before any is used, folded into a running maximum, weight
// sum and weighted sum (online softmax). With splits > 1 the partial results
// meet in shared memory and split 0 combines them: many states, or few tokens,
// still give every multiprocessor enough loads in flight.
#include "numerics.cuh"

#ifndef MERGE_CHUNK
#define MERGE_CHUNK 4
#endif

namespace cupy_merge {

template <int VEC>
struct Partial {
  float acc[VEC];
  float sum;      // sum of exp(lse_i - lse_max) over the states folded in so far
  float lse_max;  // natural log; -inf until a non-empty state is seen
  bool any_nan;

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    sum = 0.0f;
    lse_max = negative_infinity();
    any_nan = false;
  }

  // Adds states (or another partial) whose maximum is `other_max`: rescales to the new maximum.
  __device__ __forceinline__ float rebase(float other_max) {
    const float new_max = fmaxf(lse_max, other_max);
    if (new_max == negative_infinity()) return new_max;  // everything so far is empty
    const float rescale = expf(lse_max - new_max);      // exp(-inf) = 0 the first time
    sum *= rescale;
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] *= rescale;
    lse_max = new_max;
    return new_max;
  }

  template <typename TIn>
  __device__ __forceinline__ void fold(const float (&lse)[MERGE_CHUNK], const Pack<TIn, VEC> (&values)[MERGE_CHUNK], int n) {
    float chunk_max = negative_infinity();
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j) {
      if (j < n) {
        any_nan |= is_nan(lse[j]);
        chunk_max = fmaxf(chunk_max, lse[j]);  // fmaxf ignores NaN
      }
    }
    if (rebase(chunk_max) == negative_infinity()) return;
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j) {
      if (j < n) {
        const float weight = expf(lse[j] - lse_max);
        sum += weight;
        // A state of weight zero adds nothing, even if its values are NaN (an empty split).
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          acc[k] = weight == 0.0f ? acc[k] : fmaf(weight, to_float(values[j].v[k]), acc[k]);
        }
      }
    }
  }

  __device__ __forceinline__ void combine(const Partial& other) {
    any_nan |= other.any_nan;
    if (other.lse_max == negative_infinity()) return;
    rebase(other.lse_max);
    const float scale = expf(other.lse_max - lse_max);
    sum = fmaf(other.sum, scale, sum);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = fmaf(other.acc[k], scale, acc[k]);
  }
};

// SPLIT: whether the block's z threads share rows (the instantiation without it
// has no barrier or shared memory at all; blockDim.z is then 1).
template <typename TIn, typename TOut, int VEC, bool SPLIT>
__global__ void merge_many_states(
    TOut* out, float* out_lse, const TIn* v, const float* lse,
    const void* indptr, long long indptr_bytes, long long indptr_stride,
    long long num_states, long long num_tokens, long long num_heads, long long head_size,
    long long out_stride_token, long long out_stride_head,
    long long v_stride_state, long long v_stride_token, long long v_stride_head,
    long long out_lse_stride_head, long long out_lse_stride_token,
    long long lse_stride_state, long long lse_stride_head, long long lse_stride_token,
    long long lse_base_2) {
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  // Partials of splits 1.. for split 0 to combine: [splits - 1][rows_y][threads_x].
  extern __shared__ unsigned char shared_bytes[];
  Partial<VEC>* shared_partials = reinterpret_cast<Partial<VEC>*>(shared_bytes);
  const int split = SPLIT ? threadIdx.z : 0, splits = SPLIT ? blockDim.z : 1;
  const long long num_packs = head_size / VEC;
  const long long pack_stride_state = v_stride_state / VEC;  // the host checks divisibility
  const float to_natural = lse_to_natural(lse_base_2);
  const float from_natural = lse_from_natural(lse_base_2);
  const long long token_blocks = (num_tokens + blockDim.y - 1) / blockDim.y;
  // A thread covers packs x, x + threads_x, ...; with head_size 0 one pass still computes the LSE.
  const long long passes = num_packs == 0 ? 1 : (num_packs + blockDim.x - 1) / blockDim.x;

  for (long long work = blockIdx.x; work < token_blocks * num_heads; work += gridDim.x) {
    const long long head = block_head(work, num_heads);
    const long long token = block_token_block(work, num_heads) * blockDim.y + threadIdx.y;
    const bool token_valid = token < num_tokens;

    long long first = 0, count = token_valid ? num_states : 0;
    bool bad_indptr = false;
    if (indptr != nullptr && token_valid) {
      long long begin, end;
      if (indptr_bytes == 8) {
        begin = static_cast<const long long*>(indptr)[token * indptr_stride];
        end = static_cast<const long long*>(indptr)[(token + 1) * indptr_stride];
      } else {
        begin = static_cast<const int*>(indptr)[token * indptr_stride];
        end = static_cast<const int*>(indptr)[(token + 1) * indptr_stride];
      }
      bad_indptr = begin < 0 || end < begin || end > num_states;
      first = bad_indptr ? 0 : begin;
      count = bad_indptr ? 0 : end - begin;
    }
    const float* row_lse = lse + first * lse_stride_state + head * lse_stride_head + token * lse_stride_token;
    const InPack* column = reinterpret_cast<const InPack*>(v + first * v_stride_state + token * v_stride_token + head * v_stride_head);

    for (long long pass = 0; pass < passes; ++pass) {
      const long long p = pass * blockDim.x + threadIdx.x;
      const bool has_pack = p < num_packs;
      Partial<VEC> part;
      part.reset();
      for (long long i0 = split * MERGE_CHUNK; i0 < count; i0 += static_cast<long long>(splits) * MERGE_CHUNK) {
        const int n = count - i0 < MERGE_CHUNK ? static_cast<int>(count - i0) : MERGE_CHUNK;
        float chunk_lse[MERGE_CHUNK];
        InPack chunk_values[MERGE_CHUNK];
#pragma unroll
        for (int j = 0; j < MERGE_CHUNK; ++j) {
          if (j < n) {
            chunk_lse[j] = empty_if_inf(row_lse[(i0 + j) * lse_stride_state]) * to_natural;
            if (has_pack) chunk_values[j] = load_pack(column + (i0 + j) * pack_stride_state + p);
          }
        }
        part.template fold<TIn>(chunk_lse, chunk_values, n);
      }
      if constexpr (SPLIT) {
        // Uniform across the block: every thread reaches both barriers.
        const int slot = threadIdx.y * blockDim.x + threadIdx.x;
        const int row_slots = blockDim.x * blockDim.y;
        if (split > 0) shared_partials[(split - 1) * row_slots + slot] = part;
        __syncthreads();
        if (split == 0) {
          for (int other = 1; other < splits; ++other) part.combine(shared_partials[(other - 1) * row_slots + slot]);
        }
        __syncthreads();  // the slots are reused by the next pass
      }
      if (split != 0 || !token_valid) continue;
      const bool broken = part.any_nan || bad_indptr;
      if (has_pack) {
        // Empty rows (no state, or only empty ones) give 0; a NaN LSE or bad offsets give NaN.
        const bool empty = part.lse_max == negative_infinity();
        const float scale = broken ? quiet_nan() : empty ? 0.0f : 1.0f / part.sum;
        OutPack merged;
#pragma unroll
        for (int k = 0; k < VEC; ++k) merged.v[k] = from_float<TOut>(part.acc[k] * scale);
        store_pack(reinterpret_cast<OutPack*>(out + token * out_stride_token + head * out_stride_head) + p, merged);
      }
      if (out_lse != nullptr && pass == 0 && threadIdx.x == 0) {
        float merged_lse = part.lse_max == negative_infinity() ? negative_infinity()
                                                               : (part.lse_max + logf(part.sum)) * from_natural;
        out_lse[head * out_lse_stride_head + token * out_lse_stride_token] = broken ? quiet_nan() : merged_lse;
      }
    }
  }
}

}  // namespace cupy_merge
