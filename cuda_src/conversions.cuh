// Value types and conversions shared by the merge kernels; special values; LSE bases.
//
// Deliberately includes no CUDA header: 16-bit types are plain bit containers
// converted with PTX, so NVRTC compiles these files with no CUDA toolkit and no
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

// A 32-bit word of two bfloat16 values widened: element 0 (the low half) and element 1.
__device__ __forceinline__ float bfloat16_low(unsigned word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bfloat16_high(unsigned word) { return __uint_as_float(word & 0xffff0000u); }

template <typename T>
constexpr bool kIsBfloat16 = false;
template <>
constexpr bool kIsBfloat16<bfloat16_t> = true;

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

// Weights use the fast exponential (ex2.approx; FlashInfer's choice too): a few
// ulp, far below the 16-bit outputs' rounding and within 1e-6 of float64 in the
// tests, and it measured 1-3 points of copy speed faster in the two-way kernels
// (session 4, sweep 2) and 0.1-2 in the N-way ones (session 7, run 5).
__device__ __forceinline__ float exp_weight(float x) { return __expf(x); }

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

// +inf marks an empty row in FlashAttention-2; it is read as -inf.
__device__ __forceinline__ float empty_if_inf(float lse) {
  return lse == positive_infinity() ? negative_infinity() : lse;
}

// LSEs may be natural-log (vLLM) or base-2 (FlashInfer); the kernels work in
// natural log and convert at the edges (multiplying by 1 is exact). Sinks are
// the model's natural-log logits in either base.
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kLog2E = 1.442695040888963407f;
__device__ __forceinline__ float lse_to_natural(int lse_base_2) { return lse_base_2 ? kLn2 : 1.0f; }
__device__ __forceinline__ float lse_from_natural(int lse_base_2) { return lse_base_2 ? kLog2E : 1.0f; }

// An attention sink of head `head` (a natural-log logit counted once in the denominator), or
// -inf (no sink) when the kernel has none.
template <bool SINKS>
__device__ __forceinline__ float sink_logit(const float* sinks, int sinks_stride, long long head) {
  if constexpr (SINKS) return sinks[head * sinks_stride];
  return negative_infinity();
}

}  // namespace cupy_merge
