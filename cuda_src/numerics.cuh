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

// Every value is read once and written once: 16-byte packs move with the
// cache-streaming hint (.cs), measured 2-15 points of copy speed faster on the
// H200 (docs/PERF.md). -DCUPY_MERGE_STREAMING=0 turns it off.
#ifndef CUPY_MERGE_STREAMING
#define CUPY_MERGE_STREAMING 1
#endif

#ifndef CUPY_MERGE_LOAD_OP
#define CUPY_MERGE_LOAD_OP "ld.global.cs.v4.u32"
#endif

struct alignas(16) Bytes16 { unsigned x, y, z, w; };

template <typename P>
__device__ __forceinline__ P load_pack(const P* address) {
#if CUPY_MERGE_STREAMING
  if constexpr (sizeof(P) == 16) {
    Bytes16 b;
    asm volatile(CUPY_MERGE_LOAD_OP " {%0, %1, %2, %3}, [%4];"
                 : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "l"(address));
    return *reinterpret_cast<P*>(&b);
  }
#endif
  return *address;
}

template <typename P>
__device__ __forceinline__ void store_pack(P* address, const P& value) {
#if CUPY_MERGE_STREAMING
  if constexpr (sizeof(P) == 16) {
    const Bytes16 b = *reinterpret_cast<const Bytes16*>(&value);
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(address), "r"(b.x), "r"(b.y), "r"(b.z), "r"(b.w) : "memory");
    return;
  }
#endif
  *address = value;
}

__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

// +inf marks an empty row in FlashAttention-2; it is read as -inf.
__device__ __forceinline__ float empty_if_inf(float lse) {
  return lse == positive_infinity() ? negative_infinity() : lse;
}

// Shared memory is addressed with 32-bit offsets in the shared window (cheaper
// than generic 64-bit pointers, and it keeps registers free).
__device__ __forceinline__ unsigned shared_address(const void* shared_pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(shared_pointer));
}

// Asynchronous 16-byte copy from global to shared memory (sm_80+), bypassing L1.
__device__ __forceinline__ void copy_async_16(unsigned shared_destination, const void* global_source) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_destination), "l"(global_source) : "memory");
#else
  asm volatile("{ .reg .b32 x, y, z, w; ld.global.v4.b32 {x, y, z, w}, [%1]; st.shared.v4.b32 [%0], {x, y, z, w}; }"
               ::"r"(shared_destination), "l"(global_source) : "memory");
#endif
}

// Waits until every asynchronous copy this thread issued has landed.
__device__ __forceinline__ void wait_async_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\ncp.async.wait_all;" ::: "memory");
#endif
}

// Work items (a block's tokens of one head) are numbered head-fastest, so that
// blocks running at the same time read neighbouring heads of the same tokens:
// contiguous memory (1-2 points of copy speed over token-fastest, docs/PERF.md).
__device__ __forceinline__ long long block_head(long long work, long long num_heads) { return work % num_heads; }
__device__ __forceinline__ long long block_token_block(long long work, long long num_heads) { return work / num_heads; }

// LSEs may be natural-log (vLLM) or base-2 (FlashInfer); the kernels work in
// natural log and convert at the edges (multiplying by 1 is exact).
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kLog2E = 1.442695040888963407f;
__device__ __forceinline__ float lse_to_natural(int lse_base_2) { return lse_base_2 ? kLn2 : 1.0f; }
__device__ __forceinline__ float lse_from_natural(int lse_base_2) { return lse_base_2 ? kLog2E : 1.0f; }

}  // namespace cupy_merge
