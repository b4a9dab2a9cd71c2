// Merge of two attention states (section 2.2 of arXiv 2501.01005):
//   lse = log(exp(lse_a) + exp(lse_b) [+ exp(sink)])
//   out = exp(lse_a - lse) * v_a + exp(lse_b - lse) * v_b
//
// Shapes (strides in elements, any sign; the last value dim is contiguous):
//   out                  [num_tokens, num_heads, head_size]   TOut
//   v_a, v_b             [num_tokens, num_heads, head_size]   TIn
//   out_lse, lse_a/b     [num_heads, num_tokens]              float32
//   mask (optional)      [num_tokens]                         bool (1 byte)
//   sinks (SINKS)        [num_heads]                          float32, natural-log logits
//
// Per token: mask false -> nothing is read or written; token >= merge_tokens ->
// state b unchanged (vLLM's prefill_tokens_with_context; with a sink, state b
// merged with the sink alone); else merged. A sink is a state of value 0 and
// LSE `sink`: it enters the denominator once, here, where the states meet.
//
// Two kernels: merge_two_states_packed (below) for the common layouts, one
// thread a 16-byte pack; merge_two_states for everything else (any strides,
// narrow packs, 64-bit offsets). The host's planner picks one (cupy_merge/_plan.py).
//
// merge_two_states launch: block (threads_x, rows_y), a 1-D grid over work items (ROWS * rows_y
// tokens of one head), looping when there are more items than blocks. A thread
// owns ROWS tokens, rows_y apart, of one head at a time (the head-major LSE loads
// of a warp stay contiguous), and strides over each row in packs of VEC elements.
// All ROWS rows' first packs and LSEs are loaded before any weight is computed,
// so each thread keeps 2 * ROWS value packs in flight. With head_size 0 it writes
// only the merged LSE (the second launch of an in-place LSE with group scales).
#include "conversions.cuh"
#include "packs.cuh"
#include "grid.cuh"
#include "fp8.cuh"
#include "fp4.cuh"

namespace cupy_merge {

struct StateWeights {
  float weight_a;
  float weight_b;
  float lse;  // natural log
};

// Two empty states (and no sink) give weights 0 and lse -inf, never NaN; a NaN lse or sink
// poisons its row; a +inf sink takes all the weight (lse +inf, weights 0).
template <bool SINKS>
__device__ __forceinline__ StateWeights weigh_two_states(float lse_a, float lse_b, float sink) {
  StateWeights w;
  if (is_nan(lse_a) || is_nan(lse_b) || (SINKS && is_nan(sink))) {
    w.weight_a = w.weight_b = w.lse = quiet_nan();
    return w;
  }
  if (SINKS && sink == positive_infinity()) {
    w.weight_a = w.weight_b = 0.0f;
    w.lse = positive_infinity();
    return w;
  }
  const float lse_max = SINKS ? fmaxf(fmaxf(lse_a, lse_b), sink) : fmaxf(lse_a, lse_b);
  if (lse_max == negative_infinity()) {
    w.weight_a = w.weight_b = 0.0f;
    w.lse = negative_infinity();
    return w;
  }
  const float exp_a = exp_weight(lse_a - lse_max);
  const float exp_b = exp_weight(lse_b - lse_max);
  // In [1, 2] (or [1, 3] with a sink): the fast division and logarithm are exact to a few ulp there.
  const float sum = SINKS ? exp_a + exp_b + exp_weight(sink - lse_max) : exp_a + exp_b;
  w.weight_a = __fdividef(exp_a, sum);
  w.weight_b = __fdividef(exp_b, sum);
  w.lse = lse_max + __logf(sum);
  return w;
}

// A token's weights: past merge_tokens, state b as it is (LSE bits included), or merged with
// the sink alone; otherwise the merge of the two LSEs, read and written in the caller's base.
template <bool SINKS>
__device__ __forceinline__ StateWeights token_weights(bool copy_b, float s_a, float s_b, float sink, float to_natural,
                                                      float from_natural) {
  if (copy_b && (!SINKS || sink == negative_infinity())) return {0.0f, 1.0f, s_b};
  StateWeights w = weigh_two_states<SINKS>(copy_b ? negative_infinity() : empty_if_inf(s_a) * to_natural,
                                           empty_if_inf(s_b) * to_natural, sink);
  w.lse *= from_natural;
  return w;
}

// A state of weight zero contributes nothing, even if its values are NaN or
// uninitialised (an empty split): its products are replaced, not added. A state
// that carries all the weight is copied bit for bit (-0.0 stays -0.0).
template <typename TIn, int VEC>
__device__ __forceinline__ void weigh_pack(const StateWeights& w, const Pack<TIn, VEC>& a, const Pack<TIn, VEC>& b,
                                           float (&merged)[VEC]) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float part_a = w.weight_a == 0.0f ? 0.0f : w.weight_a * to_float(a.v[i]);
    const float part_b = w.weight_b * to_float(b.v[i]);
    merged[i] = w.weight_b == 0.0f ? part_a : w.weight_a == 0.0f ? part_b : fmaf(w.weight_b, to_float(b.v[i]), part_a);
  }
}

// weigh_pack with one branch for the common case where both states count, without its selects
// (the same arithmetic): 4 of the ~40 instructions a value of the NVFP4 epilogue, which is bound
// by instruction issue (ncu, session 27).
template <typename TIn, int VEC>
__device__ __forceinline__ void weigh_pack_branching(const StateWeights& w, const Pack<TIn, VEC>& a,
                                                     const Pack<TIn, VEC>& b, float (&merged)[VEC]) {
  if (w.weight_a != 0.0f && w.weight_b != 0.0f) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) merged[i] = fmaf(w.weight_b, to_float(b.v[i]), w.weight_a * to_float(a.v[i]));
  } else {
    weigh_pack(w, a, b, merged);
  }
}

template <typename TOut, typename TIn, int VEC>
__device__ __forceinline__ Pack<TOut, VEC> merge_pack(const StateWeights& w, const Pack<TIn, VEC>& a,
                                                      const Pack<TIn, VEC>& b, float inverse_scale) {
  float merged[VEC];
  weigh_pack(w, a, b, merged);
  return output_pack<TOut>(merged, inverse_scale);
}

// Index: the integer type of element offsets, int when the host found that every
// offset fits (fewer registers and instructions), else long long.
template <typename TIn, typename TOut, int VEC, int ROWS, typename Index, bool SINKS>
__global__ void merge_two_states(
    TOut* out, float* out_lse, const float* output_scale,
    const TIn* v_a, const float* lse_a,
    const TIn* v_b, const float* lse_b,
    const unsigned char* mask,
    long long num_tokens, long long num_heads, long long head_size, long long merge_tokens,
    long long out_stride_token, long long out_stride_head,
    long long a_stride_token, long long a_stride_head,
    long long b_stride_token, long long b_stride_head,
    long long out_lse_stride_head, long long out_lse_stride_token,
    long long lse_a_stride_head, long long lse_a_stride_token,
    long long lse_b_stride_head, long long lse_b_stride_token,
    long long mask_stride, long long lse_base_2, long long out_lse_is_input,
    const float* sinks, int sinks_stride) {
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  launch_dependents();
  const Index num_packs = head_size / VEC;
  const Index first_pack = threadIdx.x;
  const float to_natural = lse_to_natural(lse_base_2);
  const float from_natural = lse_from_natural(lse_base_2);
  const Index rows_per_block = static_cast<Index>(blockDim.y) * ROWS;
  const Index work_items = (num_tokens + rows_per_block - 1) / rows_per_block * num_heads;
  wait_for_inputs();
  const float inverse_scale = output_inverse_scale<TOut>(output_scale);

  // Blocks are numbered head-fastest: blocks running together cover neighbouring
  // heads of the same tokens, i.e. contiguous memory (see benchmarks/PERF.md).
  for (Index work = blockIdx.x; work < work_items; work += gridDim.x) {
    const Index head = block_head(work, num_heads);
    const float sink = sink_logit<SINKS>(sinks, sinks_stride, head);
    Index token[ROWS];
    bool active[ROWS];
    float s_a[ROWS], s_b[ROWS];
    InPack a[ROWS], b[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      token[r] = block_token_block(work, num_heads) * rows_per_block + r * blockDim.y + threadIdx.y;
      active[r] = token[r] < num_tokens && (mask == nullptr || mask[token[r] * mask_stride] != 0);
      s_a[r] = s_b[r] = 0.0f;
      // The first packs are loaded before the weights are known, so the value and
      // LSE loads travel to memory together instead of one round trip after the other.
      if (active[r]) {
        s_a[r] = lse_a[head * lse_a_stride_head + token[r] * lse_a_stride_token];
        s_b[r] = lse_b[head * lse_b_stride_head + token[r] * lse_b_stride_token];
        if (first_pack < num_packs) {
          const InPack* from_a = reinterpret_cast<const InPack*>(v_a + token[r] * a_stride_token + head * a_stride_head) + first_pack;
          const InPack* from_b = reinterpret_cast<const InPack*>(v_b + token[r] * b_stride_token + head * b_stride_head) + first_pack;
          a[r] = load_pack(from_a);
          b[r] = load_pack(from_b);
        }
      }
    }
    StateWeights w[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      w[r] = token_weights<SINKS>(token[r] >= merge_tokens, s_a[r], s_b[r], sink, to_natural, from_natural);
    }
    if (out_lse != nullptr) {
      // out_lse may be lse_a or lse_b itself: every thread of the row must have
      // read the old value before one thread overwrites it. The flag is uniform.
      if (out_lse_is_input) __syncthreads();
      if (threadIdx.x == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if (active[r]) out_lse[head * out_lse_stride_head + token[r] * out_lse_stride_token] = w[r].lse;
        }
      }
    }
    if (first_pack >= num_packs) continue;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (!active[r]) continue;
      const InPack* row_a = reinterpret_cast<const InPack*>(v_a + token[r] * a_stride_token + head * a_stride_head);
      const InPack* row_b = reinterpret_cast<const InPack*>(v_b + token[r] * b_stride_token + head * b_stride_head);
      OutPack* row_out = reinterpret_cast<OutPack*>(out + token[r] * out_stride_token + head * out_stride_head);
      store_pack(row_out + first_pack, merge_pack<TOut>(w[r], a[r], b[r], inverse_scale));
      for (Index p = first_pack + blockDim.x; p < num_packs; p += blockDim.x) {
        store_pack(row_out + p, merge_pack<TOut>(w[r], load_pack(row_a + p), load_pack(row_b + p), inverse_scale));
      }
    }
  }
}

}  // namespace cupy_merge

namespace cupy_merge {

// The lean variant, for the common layouts: every value array holds the heads of
// a token back to back (head stride = head_size) in rows that start on a pack,
// all offsets fit in 32 bits, and packs are 16 bytes. Thread i of the grid owns
// output pack i, numbered over (token, head, pack) with no gaps, so neighbouring
// threads and blocks stream neighbouring memory. No loop and few registers:
// occupancy, not loads per thread, keeps the bytes in flight (as in FlashInfer's
// merge; two packs a thread measured no faster, session 4 sweep 1).
// STREAMING: the value loads carry the .cs hint (see load_pack).
//
// LSE_IN_PLACE: out_lse is lse_a or lse_b itself. The host then guarantees that
// a row's packs lie in one warp (packs_per_row divides 32), and __syncwarp()
// orders every lane's read of the old LSE before the write of the new one.
//
// GROUPED: an FP8 output with a scale per group of packs_per_group packs, written
// to output_block_scale [num_tokens, groups per token] (see quantise_group; the dynamic
// shared memory holds a word per group of the block). Otherwise an FP8 output
// takes the per-tensor output_scale. An NVFP4 output (always GROUPED, 16 values a group)
// writes e4m3 block scales (quantise_fp4_group) and reads its global scale from output_scale.
// Token strides are in packs; LSE and block-scale strides in elements.
template <typename TIn, typename TOut, int VEC, bool STREAMING, bool LSE_IN_PLACE, bool GROUPED, bool SINKS>
__global__ void merge_two_states_packed(
    TOut* out, float* out_lse, const float* output_scale,
    const TIn* v_a, const float* lse_a,
    const TIn* v_b, const float* lse_b,
    const unsigned char* mask,
    int total_packs, int packs_per_token, unsigned token_multiplier, unsigned token_shift,
    int packs_per_row, unsigned head_multiplier, unsigned head_shift, int merge_tokens,
    int out_stride_token, int a_stride_token, int b_stride_token,
    int out_lse_stride_head, int out_lse_stride_token,
    int lse_a_stride_head, int lse_a_stride_token,
    int lse_b_stride_head, int lse_b_stride_token,
    int mask_stride, int lse_base_2,
    void* output_block_scale, int block_scale_stride_token, int block_scale_stride_group,
    int packs_per_group, unsigned group_multiplier, unsigned group_shift, int scale_ue8m0,
    int block_scale_col_tiles, int block_scale_rows, int block_scale_padded_rows,
    const float* sinks, int sinks_stride) {
  using InPack = Pack<TIn, VEC>;
  using OutPack = OutputPack<TOut, VEC>;
  launch_dependents();
  const float to_natural = lse_to_natural(lse_base_2);
  const float from_natural = lse_from_natural(lse_base_2);
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  const bool valid = p < total_packs;
  const PackPosition at =
      pack_position(p, valid, packs_per_token, token_multiplier, token_shift, head_multiplier, head_shift);
  wait_for_inputs();
  const bool active = valid && (mask == nullptr || mask[at.token * mask_stride] != 0);
  float s_a = 0.0f, s_b = 0.0f, sink = negative_infinity();
  InPack a, b;
  if (active) {
    s_a = lse_a[at.head * lse_a_stride_head + at.token * lse_a_stride_token];
    s_b = lse_b[at.head * lse_b_stride_head + at.token * lse_b_stride_token];
    sink = sink_logit<SINKS>(sinks, sinks_stride, at.head);
    a = load_pack<STREAMING>(reinterpret_cast<const InPack*>(v_a) + at.token * a_stride_token + at.within);
    b = load_pack<STREAMING>(reinterpret_cast<const InPack*>(v_b) + at.token * b_stride_token + at.within);
  }
  if constexpr (LSE_IN_PLACE) __syncwarp();
  OutPack* to = reinterpret_cast<OutPack*>(out) + at.token * out_stride_token + at.within;
  const StateWeights w = token_weights<SINKS>(at.token >= merge_tokens, s_a, s_b, sink, to_natural, from_natural);
  if constexpr (GROUPED) {
    // Every thread reaches the group's barriers; inactive ones do not count.
    float merged[VEC];
    if constexpr (kIsNvfp4<TOut>) {
      weigh_pack_branching(w, a, b, merged);
    } else {
      weigh_pack(w, a, b, merged);
    }
    extern __shared__ unsigned group_max[];
    const BlockScales scales = {output_block_scale, block_scale_stride_token, block_scale_stride_group,
                                packs_per_group, group_multiplier, group_shift, scale_ue8m0,
                                block_scale_col_tiles, block_scale_rows, block_scale_padded_rows};
    if constexpr (kIsNvfp4<TOut>) {
      const Fp4Scale q =
          quantise_fp4_group(merged, scales, active, valid, at.token, at.within, packs_per_token, output_scale);
      if (valid) zero_padding_rows(scales, p, total_packs);
      if (!active) return;
      store_pack(to, fp4_pack(merged, q));
    } else {
      const float inverse_scale = quantise_group(merged, scales, group_max, active, true, at.token, at.within);
      if (!active) return;
      store_pack(to, output_pack<TOut>(merged, inverse_scale));
    }
  } else {
    if (!active) return;
    store_pack(to, merge_pack<TOut>(w, a, b, output_inverse_scale<TOut>(output_scale)));
  }
  if (out_lse != nullptr && at.within == at.head * packs_per_row) {
    out_lse[at.head * out_lse_stride_head + at.token * out_lse_stride_token] = w.lse;
  }
}

}  // namespace cupy_merge
