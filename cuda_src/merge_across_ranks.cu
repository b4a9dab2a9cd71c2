// The steps around the collectives of a cross-rank merge (cupy_merge/distributed).
//
// Every rank holds the state of the same queries over its own shard of the KV:
//   v    [num_tokens, num_heads, head_size]   T, any token and head strides
//   lse  [num_heads, num_tokens]              float32, any strides
// Heads are cut into `shards` equal groups of heads_per_shard (the ranks of a
// head-sharded result; one group for a result of all heads).
//
// pack_states: one buffer of `shards` chunks of chunk_bytes, chunk d holding
// this rank's values of head group d, [num_tokens, heads_per_shard, head_size]
// in T, then at lse_offset bytes its LSE, [heads_per_shard, num_tokens]
// float32: what one all-gather (a chunk) or one all-to-all (a chunk per rank)
// moves. The receiver merges the chunks in place (strided views, no unpacking).
//
// scale_for_sum: with every rank's LSE gathered, [world, num_heads, num_tokens]
// float32 (contiguous), this rank's values multiplied by their final weight
// exp(lse_rank - lse) in T, so that a sum over ranks (all-reduce or
// reduce-scatter) is the merge; written in `shards` chunks of
// [num_tokens, heads_per_shard, head_size] (chunk_elements apart), the layout a
// reduce-scatter over head groups needs. Also the merged LSE of the heads
// [first_head, first_head + out_heads) into out_lse [out_heads, num_tokens].
// Empty LSEs (-inf, or +inf as FlashAttention-2 marks them) weigh 0 and add
// exactly 0; a row empty on every rank gives 0 and -inf; a NaN LSE on any rank
// makes the row NaN on every rank. Sinks (optional, float32 [num_heads], natural
// log): each head's sink enters the denominator once, on every rank alike, so the
// sum over ranks counts it once.
//
// Launch: block (threads_x, rows_y): rows_y (token, head) rows at a time,
// numbered head-fastest, threads_x threads striding over a row in packs of VEC
// elements (16 bytes where the host found every row aligned, else 1 element).
#include "conversions.cuh"
#include "packs.cuh"
#include "grid.cuh"

namespace cupy_merge {

template <typename T, int VEC>
__global__ void pack_states(
    unsigned char* packed, const T* v, const float* lse,
    long long num_tokens, long long num_heads, long long head_size, long long heads_per_shard,
    long long chunk_bytes, long long lse_offset,
    long long v_stride_token, long long v_stride_head, long long lse_stride_head, long long lse_stride_token) {
  using P = Pack<T, VEC>;
  launch_dependents();
  wait_for_inputs();
  const long long rows = num_tokens * num_heads, packs = head_size / VEC;
  for (long long row = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<long long>(gridDim.x) * blockDim.y) {
    const long long token = row / num_heads, head = row - token * num_heads;
    const long long shard = head / heads_per_shard, shard_head = head - shard * heads_per_shard;
    unsigned char* chunk = packed + shard * chunk_bytes;
    P* to = reinterpret_cast<P*>(reinterpret_cast<T*>(chunk) + (token * heads_per_shard + shard_head) * head_size);
    const P* from = reinterpret_cast<const P*>(v + token * v_stride_token + head * v_stride_head);
    for (long long p = threadIdx.x; p < packs; p += blockDim.x) store_pack(to + p, load_pack(from + p));
    if (threadIdx.x == 0) {
      reinterpret_cast<float*>(chunk + lse_offset)[shard_head * num_tokens + token] =
          lse[head * lse_stride_head + token * lse_stride_token];
    }
  }
}

template <typename T, int VEC>
__global__ void scale_for_sum(
    T* scaled, float* out_lse, const T* v, const float* gathered_lse,
    long long world, long long rank, long long num_tokens, long long num_heads, long long head_size,
    long long heads_per_shard, long long chunk_elements, long long first_head, long long out_heads,
    long long v_stride_token, long long v_stride_head, long long out_lse_stride_head, long long out_lse_stride_token,
    long long lse_base_2, const float* sinks, long long sinks_stride) {
  using P = Pack<T, VEC>;
  launch_dependents();
  wait_for_inputs();
  const float to_natural = lse_to_natural(lse_base_2);
  const long long rows = num_tokens * num_heads, packs = head_size / VEC;
  const long long rank_stride = num_heads * num_tokens;  // rank r's LSE at r * rank_stride
  for (long long row = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<long long>(gridDim.x) * blockDim.y) {
    const long long token = row / num_heads, head = row - token * num_heads;
    const float* column = gathered_lse + head * num_tokens + token;
    const float sink = sinks == nullptr ? negative_infinity() : sinks[head * sinks_stride];
    float lse_max = sink == positive_infinity() ? negative_infinity() : sink;  // a +inf sink: below
    bool any_nan = is_nan(sink);
    for (long long r = 0; r < world; ++r) {
      const float s = empty_if_inf(column[r * rank_stride]) * to_natural;
      any_nan |= is_nan(s);
      lse_max = fmaxf(lse_max, s);  // fmaxf ignores NaN
    }
    float total = 0.0f, own = 0.0f;
    if (lse_max != negative_infinity()) {
      for (long long r = 0; r < world; ++r) {
        const float weight = expf(empty_if_inf(column[r * rank_stride]) * to_natural - lse_max);
        total += weight;
        if (r == rank) own = weight;
      }
      total += expf(sink - lse_max);  // 0 without a sink
    }
    // Empty everywhere: weight 0; a NaN anywhere: NaN; a +inf sink takes all the weight.
    const bool sink_takes_all = sink == positive_infinity();
    const float weight = any_nan ? quiet_nan() : (total == 0.0f || sink_takes_all) ? 0.0f : own / total;
    const long long shard = head / heads_per_shard, shard_head = head - shard * heads_per_shard;
    P* to = reinterpret_cast<P*>(scaled + shard * chunk_elements + (token * heads_per_shard + shard_head) * head_size);
    const P* from = reinterpret_cast<const P*>(v + token * v_stride_token + head * v_stride_head);
    for (long long p = threadIdx.x; p < packs; p += blockDim.x) {
      const P x = load_pack(from + p);
      P y;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        // A state of weight zero adds exactly 0, even if its values are NaN (an empty shard).
        y.v[k] = from_float<T>(weight == 0.0f ? 0.0f : weight * to_float(x.v[k]));
      }
      store_pack(to + p, y);
    }
    if (threadIdx.x == 0 && head >= first_head && head < first_head + out_heads) {
      const float merged = any_nan          ? quiet_nan()
                           : sink_takes_all ? positive_infinity()
                           : total == 0.0f  ? negative_infinity()
                                            : (lse_max + logf(total)) * lse_from_natural(lse_base_2);
      out_lse[(head - first_head) * out_lse_stride_head + token * out_lse_stride_token] = merged;
    }
  }
}

}  // namespace cupy_merge
