// FP8 outputs (float8_e4m3fn): conversion, the per-tensor scale, group scales.
#pragma once
#include "conversions.cuh"
#include "packs.cuh"
#include "grid.cuh"

namespace cupy_merge {

// OCP FP8: 4 exponent bits, bias 7, 3 mantissa bits, no infinities, one NaN
// pattern per sign, largest finite 448. An output type only.
struct alignas(1) fp8_e4m3_t { unsigned char bits; };

template <typename T>
constexpr bool kIsFp8 = false;
template <>
constexpr bool kIsFp8<fp8_e4m3_t> = true;

constexpr float kFp8Max = 448.0f;

// Round to nearest even, saturating to +-448 (infinities included), NaN kept:
// the semantics of the hardware's cvt.rn.satfinite. The portable version below
// serves chips without the instruction (before sm_89), and a GPU test checks
// that both agree on every float32 bit pattern.
__device__ __forceinline__ unsigned char fp8_e4m3_portable(float x) {
  const unsigned u = __float_as_uint(x);
  const unsigned char sign = static_cast<unsigned char>((u >> 24) & 0x80u);
  const unsigned magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7fu;                   // NaN
  if (magnitude >= __float_as_uint(kFp8Max)) return sign | 0x7eu;     // saturate
  if (magnitude < 0x3c800000u) {                                      // below 2^-6: subnormal steps of 2^-9
    return sign | static_cast<unsigned char>(__float2int_rn(__uint_as_float(magnitude) * 512.0f));
  }
  // Keep 3 of the 23 mantissa bits, rounding to nearest even; a carry steps the exponent.
  const unsigned rounded = (magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20;
  return sign | static_cast<unsigned char>(rounded - ((127u - 7u) << 3));
}

template <>
__device__ __forceinline__ fp8_e4m3_t from_float<fp8_e4m3_t>(float x) {
  fp8_e4m3_t f;
#if __CUDA_ARCH__ >= 890 && !defined(CUPY_MERGE_PORTABLE_FP8)
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(x));
  f.bits = static_cast<unsigned char>(pair & 0xffu);
#else
  f.bits = fp8_e4m3_portable(x);
#endif
  return f;
}

// The output element of a merged value: FP8 outputs are divided by their scale
// (as a multiplication by its reciprocal, as vLLM does), other types converted as they are.
template <typename TOut>
__device__ __forceinline__ TOut to_output(float x, float inverse_scale) {
  if constexpr (kIsFp8<TOut>) return from_float<TOut>(x * inverse_scale);
  return from_float<TOut>(x);
}

// A per-tensor FP8 scale is read on the device at every launch, so a replayed
// CUDA graph sees the scale of its replay. Null (no FP8 output, or group scales): 1.
template <typename TOut>
__device__ __forceinline__ float output_inverse_scale(const float* output_scale) {
  if constexpr (kIsFp8<TOut>) {
    if (output_scale != nullptr) return 1.0f / *output_scale;
  }
  return 1.0f;
}

// A pack of merged values as output elements (see to_output).
template <typename TOut, int VEC>
__device__ __forceinline__ Pack<TOut, VEC> output_pack(const float (&merged)[VEC], float inverse_scale) {
  Pack<TOut, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) out.v[k] = to_output<TOut>(merged[k], inverse_scale);
  return out;
}

// FP8 with one scale per group of consecutive output elements (vLLM's
// per-token-group quantisation): each group's scale is its largest magnitude
// over 448, floored so that an all-zero group gets a finite scale, optionally
// rounded up to a power of two (UE8M0, exactly representable as an exponent byte).
constexpr float kFp8AbsMaxFloor = 1e-10f;

__device__ __forceinline__ float fp8_group_scale(float amax, int ue8m0) {
  float scale = (is_nan(amax) ? amax : fmaxf(amax, kFp8AbsMaxFloor)) / kFp8Max;
  const unsigned bits = __float_as_uint(scale);
  if (ue8m0 && (bits & 0x007fffffu) != 0 && bits < 0x7f800000u) {
    scale = __uint_as_float((bits + 0x00800000u) & 0xff800000u);  // next power of two up
  }
  return scale;
}

// A group is `packs_per_group` consecutive threads of one block (the host sizes
// blocks in whole groups); `group_max` is shared memory, one word per group of
// the block. Returns the largest magnitude of the group's values: as float bits
// compared as integers, so a NaN anywhere wins and gives the group a NaN scale.
// Every thread of the block must call it (it holds two barriers). `slot`: the
// thread's group within the block; `leader`: its first thread; `contributes`:
// whether its values count (a valid, unmasked row merged by this thread).
template <int VEC>
__device__ __forceinline__ float group_abs_max(const float (&values)[VEC], unsigned* group_max, int slot, bool leader,
                                               bool contributes) {
  unsigned local = 0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) local = max(local, __float_as_uint(values[k]) & 0x7fffffffu);
  if (leader) group_max[slot] = 0;
  __syncthreads();
  if (contributes) atomicMax(group_max + slot, local);
  __syncthreads();
  return __uint_as_float(group_max[slot]);
}

// The packed kernels' group scales: where they go, [num_tokens, groups of a token] (float32
// for FP8, e4m3 bytes for NVFP4), and how a group's packs are numbered (packs_per_group
// consecutive packs). NVFP4's may lie in swizzled tiles instead of strides (col_tiles > 0,
// see fp4_scale_offset), their padding zeroed: rows from `rows` to `padded_rows`.
struct BlockScales {
  void* scales;
  int stride_token, stride_group, packs_per_group;
  unsigned multiplier, shift;
  int ue8m0;
  int col_tiles, rows, padded_rows;
};

// The group-scaled FP8 epilogue of a packed kernel: the group's scale from every
// contributing thread's merged pack, written by the group's first thread (when
// `may_lead`); returns the inverse scale this thread's pack is multiplied by.
// Every thread of the block must call it (see group_abs_max).
template <int VEC>
__device__ __forceinline__ float quantise_group(const float (&merged)[VEC], const BlockScales& g, unsigned* group_max,
                                                bool contributes, bool may_lead, int token, int within) {
  const int slot = fast_divide(threadIdx.x, g.multiplier, g.shift);
  const bool leader = may_lead && threadIdx.x == slot * g.packs_per_group;
  const float scale = fp8_group_scale(group_abs_max(merged, group_max, slot, leader, contributes), g.ue8m0);
  if (leader && contributes) {
    static_cast<float*>(g.scales)[token * g.stride_token + fast_divide(within, g.multiplier, g.shift) * g.stride_group] =
        scale;
  }
  return 1.0f / scale;
}

}  // namespace cupy_merge
