// Value types, conversions and vector packs shared by the merge kernels.
//
// Deliberately includes no CUDA header: 16-bit types are plain bit containers
// converted with PTX, so NVRTC compiles this file with no CUDA toolkit and no
// header wheel whose version would have to match NVRTC's.
#pragma once

namespace cupy_merge {

struct alignas(2) half_t { unsigned short bits; };
struct alignas(2) bfloat16_t { unsigned short bits; };

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

// bfloat16 is the upper half of a float32, so widening is exact.
__device__ __forceinline__ float to_float(bfloat16_t x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

template <>
__device__ __forceinline__ half_t from_float<half_t>(float x) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
  return h;
}

template <>
__device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float x) {
  bfloat16_t b;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(x));
#else
  // Round to nearest even by hand; older chips lack the instruction.
  const unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    b.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);  // quiet NaN
  } else {
    b.bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
#endif
  return b;
}

// N consecutive elements moved as one aligned load or store (up to 16 bytes).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

}  // namespace cupy_merge
