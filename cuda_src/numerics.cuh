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

// float8_e4m3fn (OCP FP8: 4 exponent bits, bias 7, 3 mantissa bits, no
// infinities, one NaN pattern per sign, largest finite 448): an output type only.
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
__device__ __forceinline__ float output_inverse_scale(const float* out_scale) {
  if constexpr (kIsFp8<TOut>) {
    if (out_scale != nullptr) return 1.0f / *out_scale;
  }
  return 1.0f;
}

// N consecutive elements moved as one aligned access of up to 16 bytes; wider
// packs (8 floats) are aligned to 16 and move as two 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// A pack of merged values as output elements (see to_output).
template <typename TOut, int VEC>
__device__ __forceinline__ Pack<TOut, VEC> output_pack(const float (&merged)[VEC], float inverse_scale) {
  Pack<TOut, VEC> out;
#pragma unroll
  for (int k = 0; k < VEC; ++k) out.v[k] = to_output<TOut>(merged[k], inverse_scale);
  return out;
}

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

// LSEs may be natural-log (vLLM) or base-2 (FlashInfer); the kernels work in
// natural log and convert at the edges (multiplying by 1 is exact).
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kLog2E = 1.442695040888963407f;
__device__ __forceinline__ float lse_to_natural(int lse_base_2) { return lse_base_2 ? kLn2 : 1.0f; }
__device__ __forceinline__ float lse_from_natural(int lse_base_2) { return lse_base_2 ? kLog2E : 1.0f; }

}  // namespace cupy_merge
