// Vector packs: N consecutive elements moved as one aligned access of up to 16 bytes.
#pragma once

namespace cupy_merge {

// Wider packs (8 floats) are aligned to 16 and move as two 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

// Every value is read once and written once. 16-byte stores carry the
// cache-streaming hint (.cs), measured 2-15 points of copy speed faster on the
// H200 (benchmarks/PERF.md, session 2). Loads carry it when STREAMING: it measured
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

}  // namespace cupy_merge
