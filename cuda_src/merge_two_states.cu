// Merge of two attention states (section 2.2 of arXiv 2501.01005):
//   lse = log(exp(lse_a) + exp(lse_b))
//   out = exp(lse_a - lse) * v_a + exp(lse_b - lse) * v_b
//
// Shapes (strides in elements, any sign; the last value dim is contiguous):
//   out, v_a, v_b        [num_tokens, num_heads, head_size]   TValue
//   out_lse, lse_a/b     [num_heads, num_tokens]              float32
//
// Launch: block (threads_x, rows_per_block), grid (token blocks, head blocks).
// A block owns rows_per_block consecutive tokens of one head at a time, so the
// head-major LSE loads of a warp are contiguous; threads_x threads stride
// over the row in packs of VEC elements.
#include "numerics.cuh"

namespace cupy_merge {

struct StateWeights {
  float weight_a;
  float weight_b;
  float lse;
};

// +inf marks an empty row in FlashAttention-2 and is treated as -inf. Two empty
// states give weights 0 and lse -inf, never NaN; a NaN lse poisons its own row.
__device__ __forceinline__ StateWeights weigh_two_states(float lse_a, float lse_b) {
  const float inf = positive_infinity();
  lse_a = lse_a == inf ? -inf : lse_a;
  lse_b = lse_b == inf ? -inf : lse_b;
  StateWeights w;
  if (is_nan(lse_a) || is_nan(lse_b)) {
    w.weight_a = w.weight_b = w.lse = quiet_nan();
    return w;
  }
  const float lse_max = fmaxf(lse_a, lse_b);
  if (lse_max == -inf) {
    w.weight_a = w.weight_b = 0.0f;
    w.lse = -inf;
    return w;
  }
  const float exp_a = expf(lse_a - lse_max);
  const float exp_b = expf(lse_b - lse_max);
  const float sum = exp_a + exp_b;
  w.weight_a = exp_a / sum;
  w.weight_b = exp_b / sum;
  // One of the two exponentials is exactly 1; log1p keeps the other's digits.
  w.lse = lse_max + log1pf(fminf(exp_a, exp_b));
  return w;
}

// A state of weight zero contributes nothing, even if its values are NaN or
// uninitialised (an empty split): its products are replaced, not added.
template <typename TValue, int VEC>
__device__ __forceinline__ Pack<TValue, VEC> merge_pack(const StateWeights& w,
                                                        const Pack<TValue, VEC>& a,
                                                        const Pack<TValue, VEC>& b) {
  Pack<TValue, VEC> out;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float part_a = w.weight_a == 0.0f ? 0.0f : w.weight_a * to_float(a.v[i]);
    const float merged = w.weight_b == 0.0f ? part_a : fmaf(w.weight_b, to_float(b.v[i]), part_a);
    out.v[i] = from_float<TValue>(merged);
  }
  return out;
}

template <typename TValue, int VEC>
__global__ void merge_two_states(
    TValue* out, float* out_lse,
    const TValue* v_a, const float* lse_a,
    const TValue* v_b, const float* lse_b,
    long long num_tokens, long long num_heads, long long head_size,
    long long out_stride_token, long long out_stride_head,
    long long a_stride_token, long long a_stride_head,
    long long b_stride_token, long long b_stride_head,
    long long out_lse_stride_head, long long out_lse_stride_token,
    long long lse_a_stride_head, long long lse_a_stride_token,
    long long lse_b_stride_head, long long lse_b_stride_token) {
  using VecPack = Pack<TValue, VEC>;
  const long long token = static_cast<long long>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool token_valid = token < num_tokens;
  const long long num_packs = head_size / VEC;
  const long long first_pack = threadIdx.x;

  // gridDim.y is capped at 65535, so a block may visit several heads.
  for (long long head = blockIdx.y; head < num_heads; head += gridDim.y) {
    const VecPack* row_a = reinterpret_cast<const VecPack*>(v_a + token * a_stride_token + head * a_stride_head);
    const VecPack* row_b = reinterpret_cast<const VecPack*>(v_b + token * b_stride_token + head * b_stride_head);
    VecPack* row_out = reinterpret_cast<VecPack*>(out + token * out_stride_token + head * out_stride_head);
    // The first packs are loaded before the weights are known, so the value and
    // LSE loads travel to memory together instead of one round trip after the other.
    float s_a = 0.0f, s_b = 0.0f;
    VecPack a, b;
    const bool has_first = token_valid && first_pack < num_packs;
    if (token_valid) {
      s_a = lse_a[head * lse_a_stride_head + token * lse_a_stride_token];
      s_b = lse_b[head * lse_b_stride_head + token * lse_b_stride_token];
    }
    if (has_first) {
      a = row_a[first_pack];
      b = row_b[first_pack];
    }
    const StateWeights w = weigh_two_states(s_a, s_b);
    if (out_lse != nullptr) {
      // out_lse may be lse_a or lse_b itself: every thread of the row must
      // have read the old value before one thread overwrites it.
      __syncthreads();
      if (token_valid && threadIdx.x == 0) {
        out_lse[head * out_lse_stride_head + token * out_lse_stride_token] = w.lse;
      }
    }
    if (!has_first) continue;
    row_out[first_pack] = merge_pack(w, a, b);
    for (long long p = first_pack + blockDim.x; p < num_packs; p += blockDim.x) {
      row_out[p] = merge_pack(w, row_a[p], row_b[p]);
    }
  }
}

}  // namespace cupy_merge
