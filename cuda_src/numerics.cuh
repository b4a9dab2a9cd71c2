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

// N consecutive elements moved as one aligned access of up to 16 bytes; wider
// packs (8 floats) are aligned to 16 and move as two 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// Every value is read once and written once. 16-byte stores carry the
// cache-streaming hint (.cs), measured 2-15 points of copy speed faster on the
// H200 (docs/PERF.md, session 2). Loads carry it when STREAMING: it measured
// up to 3 points faster below about 64 MB of traffic and 5-10 points slower
// above, where plain loads reach the copy's speed (session 4, sweep 2).
struct alignas(16) Bytes16 { unsigned x, y, z, w; };

template <bool STREAMING = true, typename P>
__device__ __forceinline__ P load_pack(const P* address) {
  if constexpr (sizeof(P) == 16 && STREAMING) {
    Bytes16 b;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "l"(address));
    return *reinterpret_cast<P*>(&b);
  }
  return *address;
}

template <typename P>
__device__ __forceinline__ void store_pack(P* address, const P& value) {
  if constexpr (sizeof(P) == 16) {
    const Bytes16 b = *reinterpret_cast<const Bytes16*>(&value);
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(address), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w) : "memory");
    return;
  }
  *address = value;
}

// Weights use the fast exponential (ex2.approx; FlashInfer's choice too): a few
// ulp, far below the 16-bit outputs' rounding and within 1e-6 of float64 in the
// tests, and it measured 1-3 points of copy speed faster (session 4, sweep 2).
__device__ __forceinline__ float exp_weight(float x) { return __expf(x); }

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

// +inf marks an empty row in FlashAttention-2; it is read as -inf.
__device__ __forceinline__ float empty_if_inf(float lse) {
  return lse == positive_infinity() ? negative_infinity() : lse;
}

// Work items (a block's tokens of one head) are numbered head-fastest, so that
// blocks running at the same time read neighbouring heads of the same tokens:
// contiguous memory (1-2 points of copy speed over token-fastest, docs/PERF.md).
__device__ __forceinline__ long long block_head(long long work, long long num_heads) { return work % num_heads; }
__device__ __forceinline__ long long block_token_block(long long work, long long num_heads) { return work / num_heads; }

// n / d for 0 <= n < 2^31 as a multiply-high, an add and a shift; the host finds
// multiplier and shift for each divisor d (cupy_merge/_plan.py, fast_divisor).
__device__ __forceinline__ int fast_divide(int n, unsigned multiplier, unsigned shift) {
  return static_cast<int>((__umulhi(static_cast<unsigned>(n), multiplier) + static_cast<unsigned>(n)) >> shift);
}

// LSEs may be natural-log (vLLM) or base-2 (FlashInfer); the kernels work in
// natural log and convert at the edges (multiplying by 1 is exact).
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kLog2E = 1.442695040888963407f;
__device__ __forceinline__ float lse_to_natural(int lse_base_2) { return lse_base_2 ? kLn2 : 1.0f; }
__device__ __forceinline__ float lse_from_natural(int lse_base_2) { return lse_base_2 ? kLog2E : 1.0f; }

}  // namespace cupy_merge
