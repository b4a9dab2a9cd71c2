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

// The index of the e2m1 magnitude nearest m in [0, 6], ties to the even index: of 0, 0.5, 1,
// 1.5, 2, 3, 4, 6. Indices follow m on three lines, 2m below 2, m + 2 to 4, m / 2 + 4 to 6, so
// the index is the least of the three lines rounded to an integer (rounding to nearest even
// commutes with the least). Each line is one exact multiply-add onto 1.5 * 2^23, whose single
// rounding leaves the integer in the low mantissa bits: three FMAs and two minima.
__device__ __forceinline__ unsigned e2m1_index(float m) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: a unit in its last place is 1
  const float low = __fmaf_rn(m, 2.0f, kRound);
  const float middle = __fmaf_rn(m, 1.0f, kRound + 2.0f);
  const float high = __fmaf_rn(m, 0.5f, kRound + 4.0f);
  return __float_as_uint(fminf(fminf(low, middle), high)) - __float_as_uint(kRound);
}

// The e2m1 code of x * reciprocal: the sign in bit 3, the index of its nearest magnitude
// (beyond 6, 6) below it.
__device__ __forceinline__ unsigned e2m1_code(float x, float reciprocal) {
  const float scaled = __fmul_rn(x, reciprocal);
  return e2m1_index(fminf(fabsf(scaled), kE2m1Max)) | ((__float_as_uint(scaled) >> 28) & 8u);
}

// A normal e4m3 byte's value (the block scales are clamped to [2^-6, 448] before rounding).
__device__ __forceinline__ float e4m3_value(unsigned char bits) {
  return __uint_as_float(((((bits >> 3) & 15u) + 120u) << 23) | ((bits & 7u) << 20));
}

// What a block's values are multiplied by before rounding; `nan`: the block holds a NaN (or the
// global scale is bad), its scale is NaN and every code of the block is 0.
struct Fp4Scale {
  float reciprocal;
  bool nan;
};

// Where the scale byte of block `block` of row `row` (a token) lies: by strides, or swizzled
// (col_tiles > 0) in CUTLASS's and cuBLAS's 128 x 4 tiles of 512 bytes, tile (row / 128,
// block / 4) at 512 * (row / 128 * col_tiles + block / 4), and inside it
// 16 * (row % 32) + 4 * (row % 128 / 32) + block % 4.
__device__ __forceinline__ int fp4_scale_offset(const BlockScales& g, int row, int block) {
  if (g.col_tiles == 0) return row * g.stride_token + block * g.stride_group;
  return ((row >> 7) * g.col_tiles + (block >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (block & 3);
}

// The lanes of this thread's warp that exist (a block's last warp may be partial).
__device__ __forceinline__ unsigned warp_lanes() {
  const unsigned linear = threadIdx.x + threadIdx.y * blockDim.x;
  const unsigned left = blockDim.x * blockDim.y - (linear & ~31u);
  return left >= 32 ? 0xffffffffu : (1u << left) - 1u;
}

// The NVFP4 epilogue of a packed kernel: the block's scale from its 16 / VEC threads' merged
// packs (consecutive lanes of one warp: the host sizes blocks in whole groups along x), written
// by the block's first thread (`contributes`: a merged row of this thread), which also zeroes
// its row's padded columns in the swizzled layout when it holds the row's last block (`pads`: a
// valid pack, whatever its mask). Every thread of the warp must call it (the lanes exchange
// their maxima). The padded rows are zero_padding_rows' job.
template <int VEC>
__device__ __forceinline__ Fp4Scale quantise_fp4_group(const float (&merged)[VEC], const BlockScales& g,
                                                       bool contributes, bool pads, int token, int within,
                                                       int packs_per_token, const float* global_scale) {
  constexpr int kPacks = VEC >= 16 ? 1 : 16 / VEC;
  unsigned local = 0;  // magnitudes as bits compared as integers: a NaN wins
#pragma unroll
  for (int k = 0; k < VEC; ++k) local = max(local, __float_as_uint(merged[k]) & 0x7fffffffu);
  if (!contributes) local = 0;
  const unsigned lanes = warp_lanes();
#pragma unroll
  for (int offset = 1; offset < kPacks; offset <<= 1) local = max(local, __shfl_xor_sync(lanes, local, offset));
  const float amax = __uint_as_float(local);
  const float gs = *global_scale;
  const float per_tensor = __fdiv_rn(1.0f, gs);
  // A global scale that is not positive and finite (or whose reciprocal is not) makes every block NaN.
  const bool bad_global = !(gs > 0.0f && gs < positive_infinity() && per_tensor < positive_infinity());
  Fp4Scale q;
  q.nan = is_nan(amax) || bad_global;
  const float scale = fminf(fmaxf(__fdiv_rn(__fdiv_rn(amax, kE2m1Max), per_tensor), kNvfp4ScaleFloor), kFp8Max);
  const unsigned char bits = q.nan ? 0x7fu : from_float<fp8_e4m3_t>(scale).bits;
  q.reciprocal = __fdiv_rn(__fdiv_rn(1.0f, per_tensor), e4m3_value(bits));
  const bool leader = threadIdx.x % kPacks == 0;
  if (leader && pads) {
    unsigned char* scales = static_cast<unsigned char*>(g.scales);
    const int block = within / kPacks;
    if (contributes) scales[fp4_scale_offset(g, token, block)] = bits;
    if (g.col_tiles != 0 && within + kPacks >= packs_per_token) {  // the row's last block: its padded columns
      for (int pad = block + 1; pad < g.col_tiles * 4; ++pad) scales[fp4_scale_offset(g, token, pad)] = 0;
    }
  }
  return q;
}

// The swizzled layout's padded rows (from g.rows up to g.padded_rows, all in the last tile row)
// zeroed a 4-byte word at a time: a word holds one row's four scales of a column tile. Thread p
// of `threads` takes every threads-th word of that tile row, in memory order (coalesced).
__device__ __forceinline__ void zero_padding_rows(const BlockScales& g, int p, int threads) {
  if (g.col_tiles == 0 || g.padded_rows == g.rows) return;
  const int first_row = g.rows & ~127;
  unsigned* words = static_cast<unsigned*>(g.scales) + (first_row >> 7) * g.col_tiles * 128;
  for (int w = p; w < g.col_tiles * 128; w += threads) {
    const int in_tile = w & 127;  // 4 * (row % 32) + (row % 128) / 32
    if (first_row + (in_tile & 3) * 32 + (in_tile >> 2) >= g.rows) words[w] = 0;
  }
}

// A pack of merged values as e2m1 codes, two a byte, the first in the low nibble: eight codes
// a 32-bit word (an index added at its nibble, the sign or-ed into the nibble's top bit), the
// words stored whole.
template <int VEC>
__device__ __forceinline__ OutputPack<nvfp4x2_t, VEC> fp4_pack(const float (&merged)[VEC], const Fp4Scale& q) {
  static_assert(VEC == 2 || VEC == 4 || VEC == 8 || VEC == 16, "an NVFP4 pack is one to eight bytes");
  constexpr int kWords = (VEC + 7) / 8;
  unsigned words[kWords];
#pragma unroll
  for (int w = 0; w < kWords; ++w) words[w] = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float scaled = __fmul_rn(merged[k], q.reciprocal);
    const int shift = 4 * (k % 8);
    words[k / 8] += e2m1_index(fminf(fabsf(scaled), kE2m1Max)) << shift;
    words[k / 8] |= (__float_as_uint(scaled) >> (28 - shift)) & (8u << shift);
  }
  OutputPack<nvfp4x2_t, VEC> out;
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    const unsigned word = q.nan ? 0u : words[w];
    if constexpr (VEC >= 8) {
      reinterpret_cast<unsigned*>(out.v)[w] = word;  // the pack is aligned to its 4 or 8 bytes
    } else {
#pragma unroll
      for (int k = 0; k < VEC / 2; ++k) out.v[k].bits = static_cast<unsigned char>(word >> (8 * k));
    }
  }
  return out;
}

}  // namespace cupy_merge
