// NVFP4 outputs: e2m1 values two a byte, a float8_e4m3fn scale per 16 values, a float32 global scale.
//
// The recipe is torchao's NVFP4 reference quantiser (cupy_merge.reference.quantize_nvfp4 is its
// NumPy twin, and the GPU tests compare bit for bit), every step a float32 operation rounded to
// nearest: per_tensor = 1 / global_scale; a block's scale s = e4m3(clamp(amax / 6 / per_tensor,
// 2^-6, 448)); each value x -> e2m1(x * ((1 / per_tensor) / s)), nearest, ties to even, +-6 at
// most. The divisions are written as __fdiv_rn so that no compiler flag makes them approximate.
#pragma once
#include "conversions.cuh"
#include "packs.cuh"
#include "grid.cuh"
#include "fp8.cuh"

namespace cupy_merge {

// Two e2m1 values: the first in the low nibble. An output type only.
struct alignas(1) nvfp4x2_t { unsigned char bits; };

template <typename T>
constexpr bool kIsNvfp4 = false;
template <>
constexpr bool kIsNvfp4<nvfp4x2_t> = true;

// A pack of VEC output values as stored: VEC / 2 bytes for NVFP4, VEC elements otherwise.
template <typename TOut, int VEC>
struct OutputPackOf {
  using type = Pack<TOut, VEC>;
};
template <int VEC>
struct OutputPackOf<nvfp4x2_t, VEC> {
  using type = Pack<nvfp4x2_t, VEC / 2>;
};
template <typename TOut, int VEC>
using OutputPack = typename OutputPackOf<TOut, VEC>::type;

constexpr float kE2m1Max = 6.0f;
constexpr float kNvfp4ScaleFloor = 0.015625f;  // 2^-6, the smallest normal e4m3 (torchao's floor)

// The e2m1 code of x * reciprocal: sign in bit 3, then the index of the nearest of
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to the even index; beyond 6, 6). Each comparison
// is with a midpoint, strict where the index below it is the even one.
__device__ __forceinline__ unsigned e2m1_code(float x, float reciprocal) {
  const float scaled = __fmul_rn(x, reciprocal);
  const float m = fabsf(scaled);
  const unsigned index = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) + (m > 5.0f);
  return index | ((__float_as_uint(scaled) >> 28) & 8u);
}

// A normal e4m3 byte's value (the block scales are clamped to [2^-6, 448] before rounding).
__device__ __forceinline__ float e4m3_value(unsigned char bits) {
  return __uint_as_float(((((bits >> 3) & 15u) + 120u) << 23) | ((bits & 7u) << 20));
}

// What a block's values are multiplied by before rounding; `nan`: the block (or the global
// scale) is NaN, and every code of the block is 0.
struct Fp4Scale {
  float reciprocal;
  bool nan;
};

// The scale byte of a block scale (an e4m3 offset into swizzled tiles or strides): row `row`,
// block `block`. Swizzled (col_tiles > 0): CUTLASS's and cuBLAS's 128 x 4 tiles of 512 bytes,
// tile (row / 128, block / 4) at 512 * (row / 128 * col_tiles + block / 4), and inside it
// 16 * (row % 32) + 4 * (row % 128 / 32) + block % 4.
__device__ __forceinline__ int fp4_scale_offset(const BlockScales& g, int row, int block) {
  if (g.col_tiles == 0) return row * g.stride_token + block * g.stride_group;
  return ((row >> 7) * g.col_tiles + (block >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (block & 3);
}

// The NVFP4 epilogue of a packed kernel: the block's scale from every contributing thread's
// merged pack, written by the block's first thread (`contributes`: a merged row of this
// thread), and the swizzled layout's padding zeroed by the first threads of the blocks of
// every real row (`pads`: a valid pack, whatever its mask), so that the scales read as the
// reference writes them. Every thread of the CUDA block must call it (see group_abs_max).
template <int VEC>
__device__ __forceinline__ Fp4Scale quantise_fp4_group(const float (&merged)[VEC], const BlockScales& g,
                                                       unsigned* group_max, bool contributes, bool pads, int token,
                                                       int within, int packs_per_token, const float* global_scale) {
  const int slot = fast_divide(threadIdx.x, g.multiplier, g.shift);
  const bool leader = threadIdx.x == slot * g.packs_per_group;
  const float amax = group_abs_max(merged, group_max, slot, leader && pads, contributes);
  const float per_tensor = __fdiv_rn(1.0f, *global_scale);
  // A global scale that is not positive and finite (or whose reciprocal is not) makes every block NaN.
  const bool bad_global = !(*global_scale > 0.0f && *global_scale < positive_infinity() && per_tensor < positive_infinity());
  Fp4Scale q;
  q.nan = is_nan(amax) || bad_global;
  float scale = __fdiv_rn(__fdiv_rn(amax, kE2m1Max), per_tensor);
  scale = fminf(fmaxf(scale, kNvfp4ScaleFloor), kFp8Max);
  const unsigned char bits = q.nan ? 0x7fu : from_float<fp8_e4m3_t>(scale).bits;
  q.reciprocal = __fdiv_rn(__fdiv_rn(1.0f, per_tensor), e4m3_value(bits));
  unsigned char* scales = reinterpret_cast<unsigned char*>(g.scales);
  const int block = fast_divide(within, g.multiplier, g.shift);
  if (leader && contributes) scales[fp4_scale_offset(g, token, block)] = bits;
  if (leader && pads && g.col_tiles != 0) {
    const bool last_block = within + g.packs_per_group >= packs_per_token;
    const int padded_blocks = g.col_tiles * 4;
    const int blocks = block + 1;  // when last_block: the row's blocks
    for (int row = token; row < g.padded_rows; row += g.rows) {
      if (row != token) scales[fp4_scale_offset(g, row, block)] = 0;
      if (last_block) {
        for (int pad = blocks; pad < padded_blocks; ++pad) scales[fp4_scale_offset(g, row, pad)] = 0;
      }
    }
  }
  return q;
}

// A pack of merged values as e2m1 codes, two a byte, the first in the low nibble.
template <int VEC>
__device__ __forceinline__ OutputPack<nvfp4x2_t, VEC> fp4_pack(const float (&merged)[VEC], const Fp4Scale& q) {
  OutputPack<nvfp4x2_t, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC / 2; ++k) {
    const unsigned low = e2m1_code(merged[2 * k], q.reciprocal), high = e2m1_code(merged[2 * k + 1], q.reciprocal);
    out.v[k].bits = q.nan ? 0 : static_cast<unsigned char>(low | (high << 4));
  }
  return out;
}

}  // namespace cupy_merge
