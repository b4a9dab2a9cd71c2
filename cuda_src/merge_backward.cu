// The gradient of a merge of attention states (two-way, N-way or ragged, with optional sinks).
//
// Forward (natural log): S = log(sum_i exp(s_i) [+ exp(z)]), V = sum_i w_i V_i, w_i = exp(s_i - S).
// Given the gradients dV of V and dS of S:
//   dV_i = w_i dV
//   ds_i = w_i (<dV, V_i> - <dV, V> + dS)        (<.,.> over head_size; <dV, V> = sum_i w_i <dV, V_i>)
//   dz   = w_z (dS - <dV, V>),  w_z = exp(z - S)  (summed over the tokens of the sink's head)
// A state of weight zero gets zero gradients, never NaN, even when its values are NaN. A row
// whose S is NaN (a NaN LSE or sink) gets NaN gradients; an empty row (S = -inf) zeros.
// Base-2 LSEs (lse_base_2): s and S are converted to natural log on the way in, and ds to base 2
// on the way out (ds_2 = w_i (ln 2 (<dV, V_i> - <dV, V>) + dS_2)); sinks are natural either way.
//
// Layout: states are numbered 0..count-1 within a row (a (token, head) pair). State 0 lives at
// `v0` (strides v0_stride_token, v0_stride_head), states 1.. at `v1` + (i - 1) v_stride_state
// (strides v1_*): a dense stack passes v1 = v0 + one state, a two-way merge its two arrays, a
// ragged batch rows indptr[t] + i (token strides 0; the planner points v0/v1 at rows 0 and 1).
// The same for the LSEs (s0, s1), the value gradients (gv0, gv1) and the LSE gradients (gs0, gs1).
// Gradients of the values are written in TIn, of the LSEs in float32; dV is read in TOut (the
// forward output's dtype), dS (grad_lse, may be null: 0) in float32.
//
// Launch: block (lanes, rows_y), at most 128 threads: `lanes` (a power of two <= 32) threads share
// a row, striding over its packs; rows_y rows a block; a grid-stride loop over rows. ONE_PACK:
// every row is at most `lanes` packs, so each thread holds its pack of dV in registers across
// the states, which it takes MERGE_CHUNK at a time.
#include "conversions.cuh"
#include "packs.cuh"
#include "grid.cuh"
#include "ragged.cuh"

#ifndef MERGE_CHUNK
#define MERGE_CHUNK 4
#endif

namespace cupy_merge {

// The sum of `x` over the `lanes` threads of a row (consecutive lanes of one warp, `mask` theirs:
// rows of one warp may run their loops a different number of times, so only a row's own lanes meet).
__device__ __forceinline__ float row_sum(float x, int lanes, unsigned mask) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(mask, x, offset, lanes);
  return x;
}

// The offsets of one state array in a row (token and head already applied) and its state stride.
template <typename Index>
struct StateOffsets {
  Index first, rest, stride_state;
  static __device__ __forceinline__ StateOffsets of(Index token, Index head, long long first_token,
                                                    long long first_head, long long rest_token, long long rest_head,
                                                    long long stride_state) {
    return {static_cast<Index>(token * first_token + head * first_head),
            static_cast<Index>(token * rest_token + head * rest_head), static_cast<Index>(stride_state)};
  }
  template <typename T>
  __device__ __forceinline__ T* at(T* p0, T* p1, Index i) const {
    return i == 0 ? p0 + first : p1 + (i - 1) * stride_state + rest;
  }
};

// Index: the integer type of element offsets (int when the host found that every offset fits:
// 89 registers a thread with long long offsets held the kernel to 31 % occupancy, session 10).
// Pointers are __restrict__: the gradients are fresh arrays, so a state's loads may be issued
// before the previous state's stores (states 0 and 1.. of one array are disjoint regions).
template <typename TIn, typename TOut, int VEC, bool ONE_PACK, bool RAGGED, bool SINKS, typename Index>
__global__ void __launch_bounds__(128) merge_states_backward(
    TIn* __restrict__ gv0, TIn* __restrict__ gv1, float* __restrict__ gs0, float* __restrict__ gs1,
    float* grad_sinks,
    const TIn* __restrict__ v0, const TIn* __restrict__ v1, const float* __restrict__ s0, const float* __restrict__ s1,
    const TOut* __restrict__ grad_out, const float* __restrict__ grad_lse, const float* __restrict__ sinks,
    const void* indptr, long long indptr_bytes, long long indptr_stride,
    long long num_states, long long num_tokens, long long num_heads, long long head_size,
    long long v0_stride_token, long long v0_stride_head, long long v1_stride_token, long long v1_stride_head,
    long long v_stride_state,
    long long gv0_stride_token, long long gv0_stride_head, long long gv1_stride_token, long long gv1_stride_head,
    long long gv_stride_state,
    long long s0_stride_head, long long s0_stride_token, long long s1_stride_head, long long s1_stride_token,
    long long s_stride_state,
    long long gs0_stride_head, long long gs0_stride_token, long long gs1_stride_head, long long gs1_stride_token,
    long long gs_stride_state,
    long long grad_out_stride_token, long long grad_out_stride_head,
    long long grad_lse_stride_head, long long grad_lse_stride_token,
    long long sinks_stride, long long lanes, long long lse_base_2) {
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  launch_dependents();
  const int lane = threadIdx.x;
  const Index packs = static_cast<Index>(head_size / VEC);
  const int row_lanes = static_cast<int>(lanes);
  const float to_natural = lse_to_natural(lse_base_2);
  const float ln2_if_base_2 = lse_base_2 ? kLn2 : 1.0f;
  const Index heads = static_cast<Index>(num_heads);
  const Index rows = static_cast<Index>(num_tokens) * heads;
  const unsigned row_mask =
      lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << ((threadIdx.y * static_cast<unsigned>(lanes)) & 31u);
  wait_for_inputs();
  for (Index row = static_cast<Index>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += static_cast<Index>(gridDim.x) * blockDim.y) {
    const Index token = row / heads, head = row - token * heads;
    Index first = 0, count = static_cast<Index>(num_states);
    bool bad = false;
    if constexpr (RAGGED) {
      const RaggedRow ragged = ragged_row(indptr, indptr_bytes, indptr_stride, token, num_states);
      first = static_cast<Index>(ragged.first);
      count = static_cast<Index>(ragged.count);
      bad = ragged.bad;
    }
    // Offsets of the token's states: in a ragged batch the token's own offset moves into the
    // state index (rows first .. first + count - 1).
    const Index t0 = RAGGED ? 0 : token;
    const auto lse_at = StateOffsets<Index>::of(t0, head, s0_stride_token, s0_stride_head, s1_stride_token,
                                                s1_stride_head, s_stride_state);
    const auto v_at = StateOffsets<Index>::of(t0, head, v0_stride_token, v0_stride_head, v1_stride_token,
                                              v1_stride_head, v_stride_state);
    const auto gv_at = StateOffsets<Index>::of(t0, head, gv0_stride_token, gv0_stride_head, gv1_stride_token,
                                               gv1_stride_head, gv_stride_state);
    const auto gs_at = StateOffsets<Index>::of(t0, head, gs0_stride_token, gs0_stride_head, gs1_stride_token,
                                               gs1_stride_head, gs_stride_state);
    auto lse_of = [&](Index i) { return empty_if_inf(*lse_at.at(s0, s1, first + i)) * to_natural; };
    // Loads that need nothing of S go first, so that their round trips overlap the LSEs'.
    const float dS = grad_lse == nullptr ? 0.0f
                                         : grad_lse[head * grad_lse_stride_head + token * grad_lse_stride_token] / ln2_if_base_2;
    const OutPack* dV_row = grad_out == nullptr ? nullptr
                            : reinterpret_cast<const OutPack*>(grad_out + token * grad_out_stride_token + head * grad_out_stride_head);
    OutPack held = {};
    if (ONE_PACK && dV_row != nullptr && lane < packs) held = dV_row[lane];
    // S from the LSEs (every lane reads the same words: one transaction each).
    const float sink = sink_logit<SINKS>(sinks, static_cast<int>(sinks_stride), head);
    float top = sink == positive_infinity() ? negative_infinity() : sink;
    bool broken = bad || is_nan(sink);
    for (Index i = 0; i < count; ++i) {
      const float s = lse_of(i);
      broken |= is_nan(s);
      top = fmaxf(top, s);
    }
    float total = 0.0f;
    if (top != negative_infinity()) {
      for (Index i = 0; i < count; ++i) total += exp_weight(lse_of(i) - top);
      if constexpr (SINKS) total += exp_weight(sink - top);
    }
    const float S = sink == positive_infinity() ? positive_infinity()
                    : top == negative_infinity() ? negative_infinity()
                                                 : top + __logf(total);
    auto weight_of = [&](float s) {
      return broken ? quiet_nan() : (S == negative_infinity() || S == positive_infinity()) ? 0.0f : exp_weight(s - S);
    };
    // State i's value gradient w_i dV, and its share w_i <dV, V_i> of <dV, V>, kept (until <dV, V>
    // is known) by lane i % lanes, which finishes it below: every lane holds d_i (row_sum is a
    // butterfly), so the finishing loop runs on all the row's lanes.
    float dot_v = 0.0f;  // <dV, V>
    auto finish_state = [&](Index i, float w, float partial) {
      const float d_i = row_sum(partial, row_lanes, row_mask);
      const float term = w == 0.0f ? 0.0f : w * d_i;  // a zero-weight state's NaN values add nothing
      dot_v += term;
      if ((i & (row_lanes - 1)) == lane) *gs_at.at(gs0, gs1, first + i) = term;
    };
    if constexpr (ONE_PACK) {
      // MERGE_CHUNK states at a time: their LSEs and packs loaded together, then used (one round
      // trip a chunk; a short chunk re-reads its last state).
      const bool has_pack = lane < packs;
#pragma unroll 1
      for (Index i0 = 0; i0 < count; i0 += MERGE_CHUNK) {
        float w[MERGE_CHUNK];
        InPack x[MERGE_CHUNK];
#pragma unroll
        for (int j = 0; j < MERGE_CHUNK; ++j) {
          const Index i = min(i0 + j, count - 1);
          w[j] = weight_of(lse_of(i));
          x[j] = has_pack ? load_pack(reinterpret_cast<const InPack*>(v_at.at(v0, v1, first + i)) + lane) : InPack{};
        }
#pragma unroll
        for (int j = 0; j < MERGE_CHUNK; ++j) {
          if (i0 + j >= count) break;  // uniform across the row
          float partial = 0.0f;
          InPack g;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float d = to_float(held.v[k]);
            partial = fmaf(d, to_float(x[j].v[k]), partial);
            g.v[k] = from_float<TIn>(w[j] == 0.0f ? 0.0f : w[j] * d);
          }
          if (has_pack) store_pack(reinterpret_cast<InPack*>(gv_at.at(gv0, gv1, first + i0 + j)) + lane, g);
          finish_state(i0 + j, w[j], partial);
        }
      }
    } else {
#pragma unroll 4
      for (Index i = 0; i < count; ++i) {
        const float w = weight_of(lse_of(i));
        const InPack* vi = reinterpret_cast<const InPack*>(v_at.at(v0, v1, first + i));
        InPack* gvi = reinterpret_cast<InPack*>(gv_at.at(gv0, gv1, first + i));
        float partial = 0.0f;
        for (Index p = lane; p < packs; p += row_lanes) {
          const OutPack dv = dV_row != nullptr ? dV_row[p] : OutPack{};
          const InPack x = load_pack(vi + p);
          InPack g;
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float d = to_float(dv.v[k]);
            partial = fmaf(d, to_float(x.v[k]), partial);
            g.v[k] = from_float<TIn>(w == 0.0f ? 0.0f : w * d);
          }
          store_pack(gvi + p, g);
        }
        finish_state(i, w, partial);
      }
    }
    for (Index i = lane; i < count; i += row_lanes) {
      float* gsi = gs_at.at(gs0, gs1, first + i);
      const float w = weight_of(lse_of(i));
      const float natural = w == 0.0f ? 0.0f : *gsi + w * (dS - dot_v);
      *gsi = broken ? quiet_nan() : natural * ln2_if_base_2;
    }
    if constexpr (SINKS) {
      if (lane == 0 && !bad) {
        const float w_z = broken ? quiet_nan() : S == positive_infinity() ? 1.0f
                          : S == negative_infinity() ? 0.0f : exp_weight(sink - S);
        const float d_z = w_z == 0.0f ? 0.0f : w_z * (dS - dot_v);
        atomicAdd(grad_sinks + head, d_z);
      }
    }
  }
}

}  // namespace cupy_merge
