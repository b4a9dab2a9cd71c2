// The gradient of a merge given its results (as merge_backward_from_output.cu), its states' values
// moved by bulk copies: a PROBE (.ci/bulk_probe.py), not yet a kernel of the library.
//
// A slab is one state's values of one token and a group of heads (`group` heads of head_size,
// contiguous: 128 threads x one pack each). The slabs are numbered (token, head group, state) with
// no gaps, and block b takes slabs [b n / B, (b + 1) n / B): every block the same share to within
// one slab, whatever the rows' lengths. One thread copies the block's slabs global -> shared
// (cp.async.bulk, an mbarrier a slot), RING slabs in flight; every thread reads its pack of each,
// stages its head's LSE of each through cp.async (its own slots, LOOKAHEAD in flight), and writes
// its gradients. Where the block enters a head group of a token (a unit), its threads load the
// unit's dV, V, S and dS.
//
// Dense: state i of token t at v + t v_stride_token + i v_stride_state. Ragged: token t's rows
// indptr[t] .. indptr[t + 1] - 1 (v_stride_token 0, v_stride_state a row); valid offsets only.
#include "backward.cuh"

#ifndef BULK_RING
#define BULK_RING 8
#endif
#ifndef BULK_LOOKAHEAD
#define BULK_LOOKAHEAD 4
#endif

namespace cupy_merge {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbarrier_expect_bytes(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(bar)) : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "retry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra retry;\n"
      "}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy(void* to, const void* from, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(to)),
               "l"(from), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// Where slab k is: its token (and the token's first row, ragged), head group and state; advance()
// steps to slab k + 1.
template <bool RAGGED>
struct SlabPosition {
  long long token, group, state, first, count;
  const void* indptr;
  long long indptr_bytes, indptr_stride, base, groups;

  __device__ void enter(long long t) {  // token t, or the next one with states
    token = t;
    for (;;) {
      first = indptr_entry(indptr, indptr_bytes, indptr_stride, token);
      count = indptr_entry(indptr, indptr_bytes, indptr_stride, token + 1) - first;
      if (count > 0) return;
      ++token;
    }
  }
  __device__ void start(long long k, long long num_tokens) {
    if constexpr (RAGGED) {
      // The last token whose slabs begin at or before k.
      long long lo = 0, hi = num_tokens - 1;
      while (lo < hi) {
        const long long mid = (lo + hi + 1) / 2;
        if (groups * (indptr_entry(indptr, indptr_bytes, indptr_stride, mid) - base) <= k) lo = mid;
        else hi = mid - 1;
      }
      enter(lo);
      const long long r = k - groups * (first - base);
      group = r / count;
      state = r - group * count;
    } else {
      const long long unit = k / count;
      state = k - unit * count;
      token = unit / groups;
      group = unit - token * groups;
    }
  }
  __device__ void advance() {
    if (++state < count) return;
    state = 0;
    if (++group < groups) return;
    group = 0;
    if constexpr (RAGGED) enter(token + 1);
    else ++token;
  }
};

template <typename TIn, typename TOut, int VEC, int PACKS, bool RAGGED, typename Index>
__global__ void __launch_bounds__(kBackwardThreads) merge_states_backward_bulk(
    TIn* __restrict__ gv, float* __restrict__ gs, const TIn* __restrict__ v, const float* __restrict__ s,
    const TOut* __restrict__ grad_out, const float* __restrict__ grad_lse, const TOut* __restrict__ out,
    const float* __restrict__ out_lse, const void* indptr, long long indptr_bytes, long long indptr_stride,
    long long slabs, long long num_states, long long num_tokens, long long num_heads, long long head_size,
    long long group_heads, long long v_stride_token, long long v_stride_state, long long gv_stride_token,
    long long gv_stride_state, long long s_stride_head, long long s_stride_token, long long s_stride_state,
    long long gs_stride_head, long long gs_stride_token, long long gs_stride_state, long long grad_out_stride_token,
    long long grad_out_stride_head, long long grad_lse_stride_head, long long grad_lse_stride_token,
    long long out_stride_token, long long out_stride_head, long long out_lse_stride_head,
    long long out_lse_stride_token, long long lse_base_2) {
  constexpr int kRing = BULK_RING, kAhead = BULK_LOOKAHEAD;
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  // A slab: pack q * 128 + thread is thread's q-th (so that a head's packs are consecutive lanes).
  __shared__ __align__(128) InPack ring[kRing][PACKS][kBackwardThreads];
  __shared__ float lses[kAhead + 1][PACKS][kBackwardThreads];
  __shared__ __align__(8) unsigned long long full[kRing], empty[kRing];
  const int thread = threadIdx.x;
  const int packs = static_cast<int>(head_size / VEC);  // a head's packs: threads a head (a power of two <= 32)
  int head_in_group[PACKS], pack[PACKS];
#pragma unroll
  for (int q = 0; q < PACKS; ++q) {
    head_in_group[q] = (q * kBackwardThreads + thread) / packs;
    pack[q] = (q * kBackwardThreads + thread) % packs;
  }
  const long long groups = (num_heads + group_heads - 1) / group_heads;
  const long long k0 = blockIdx.x * slabs / gridDim.x, k1 = (blockIdx.x + 1) * slabs / gridDim.x;
  const float to_natural = lse_to_natural(lse_base_2);
  const float ln2_if_base_2 = lse_base_2 ? kLn2 : 1.0f;
  const float log2e_if_base_2 = lse_base_2 ? kLog2E : 1.0f;
  const long long base = RAGGED ? indptr_entry(indptr, indptr_bytes, indptr_stride, 0) : 0;
  auto position_of = [&](long long k) {
    SlabPosition<RAGGED> p;
    p.indptr = indptr, p.indptr_bytes = indptr_bytes, p.indptr_stride = indptr_stride, p.base = base;
    p.groups = groups, p.first = 0, p.count = num_states;
    p.start(k, num_tokens);
    return p;
  };
  auto heads_of = [&](const SlabPosition<RAGGED>& p) { return min(group_heads, num_heads - p.group * group_heads); };
  auto slab_offset = [&](const SlabPosition<RAGGED>& p, long long stride_token, long long stride_state) {
    return p.token * stride_token + (p.first + p.state) * stride_state + p.group * group_heads * head_size;
  };
  if (thread == 0) {
    for (int r = 0; r < kRing; ++r) mbarrier_init(&full[r], 1), mbarrier_init(&empty[r], kBackwardThreads);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (k0 >= k1) return;

  // The copier's position (thread 0): slab kc into slot (kc - k0) % kRing.
  SlabPosition<RAGGED> copier = position_of(k0);
  long long kc = k0;
  auto copy_next = [&]() {
    const int slot = static_cast<int>((kc - k0) % kRing);
    const unsigned bytes = static_cast<unsigned>(heads_of(copier) * head_size * sizeof(TIn));
    mbarrier_expect_bytes(&full[slot], bytes);
    bulk_copy(ring[slot], v + slab_offset(copier, v_stride_token, v_stride_state), bytes, &full[slot]);
    ++kc;
    if (kc < k1) copier.advance();
  };
  if (thread == 0) {
    while (kc < k1 && kc < k0 + kRing) copy_next();
  }
  // This thread's LSEs of slab k (its packs' heads'), staged kAhead slabs ahead.
  SlabPosition<RAGGED> stager = position_of(k0);
  long long ks = k0;
  auto stage_next = [&]() {
    if (ks < k1) {
      const float* row = s + (stager.token * s_stride_token + (stager.first + stager.state) * s_stride_state);
#pragma unroll
      for (int q = 0; q < PACKS; ++q) {
        const long long head = min(stager.group * group_heads + head_in_group[q], num_heads - 1);
        copy_async<4>(&lses[(ks - k0) % (kAhead + 1)][q][thread], row + head * s_stride_head);
      }
      ++ks;
      if (ks < k1) stager.advance();
    }
    commit_async();
  };
  for (int j = 0; j < kAhead; ++j) stage_next();

  SlabPosition<RAGGED> at = position_of(k0);
  float dV[PACKS][VEC];
  float dot_v[PACKS], S[PACKS], dS[PACKS];
  bool has_head[PACKS];
  long long head[PACKS];
  for (long long k = k0; k < k1; ++k) {
    if (k == k0 || (at.state == 0)) {  // a new unit: its dV, <dV, V>, S, dS (the whole block at once)
      float part[PACKS];
#pragma unroll
      for (int q = 0; q < PACKS; ++q) {
        head[q] = at.group * group_heads + head_in_group[q];
        has_head[q] = head_in_group[q] < group_heads && head[q] < num_heads;
        const long long h = has_head[q] ? head[q] : 0;
        const OutPack d = grad_out == nullptr ? OutPack{}
                          : reinterpret_cast<const OutPack*>(grad_out + at.token * grad_out_stride_token + h * grad_out_stride_head)[pack[q]];
        const OutPack V = reinterpret_cast<const OutPack*>(out + at.token * out_stride_token + h * out_stride_head)[pack[q]];
        part[q] = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          dV[q][e] = has_head[q] ? to_float(d.v[e]) : 0.0f;
          part[q] = fmaf(dV[q][e], to_float(V.v[e]), part[q]);
        }
        S[q] = out_lse[h * out_lse_stride_head + at.token * out_lse_stride_token] * to_natural;
        dS[q] = grad_lse == nullptr ? 0.0f : grad_lse[h * grad_lse_stride_head + at.token * grad_lse_stride_token] * log2e_if_base_2;
      }
      row_sums(part, packs);
#pragma unroll
      for (int q = 0; q < PACKS; ++q) dot_v[q] = part[q];
    }
    stage_next();
    wait_async<kAhead>();
    const int slot = static_cast<int>((k - k0) % kRing);
    const unsigned parity = static_cast<unsigned>(((k - k0) / kRing) & 1);
    mbarrier_wait(&full[slot], parity);
    InPack x[PACKS];
#pragma unroll
    for (int q = 0; q < PACKS; ++q) x[q] = ring[slot][q][thread];
    mbarrier_arrive(&empty[slot]);
    float w[PACKS], d[PACKS];
    InPack* const to = reinterpret_cast<InPack*>(gv + slab_offset(at, gv_stride_token, gv_stride_state));
#pragma unroll
    for (int q = 0; q < PACKS; ++q) {
      const float lse = lses[(k - k0) % (kAhead + 1)][q][thread];
      const bool finite_S = S[q] != negative_infinity() && S[q] != positive_infinity();
      w[q] = finite_S ? backward_weight(empty_if_inf(lse) * to_natural - S[q]) : (is_nan(S[q]) ? S[q] : 0.0f);
      d[q] = 0.0f;
      const InPack g = state_gradient<TIn, VEC>(w[q], x[q], dV[q], d[q]);
      d[q] = has_head[q] ? d[q] : 0.0f;
      if (has_head[q]) store_pack(to + q * kBackwardThreads + thread, g);
    }
    row_sums(d, packs);
    const long long row_offset = at.token * gs_stride_token + (at.first + at.state) * gs_stride_state;
#pragma unroll
    for (int q = 0; q < PACKS; ++q) {
      if (has_head[q] && pack[q] == 0) {
        gs[head[q] * gs_stride_head + row_offset] = (w[q] == 0.0f ? 0.0f : w[q] * (d[q] - dot_v[q] + dS[q])) * ln2_if_base_2;
      }
    }
    // The copier refills the slot of slab k - 1 (its readers are most likely past it).
    if (thread == 0 && k > k0 && kc < k1) {
      const long long before = k - 1 - k0;
      mbarrier_wait(&empty[before % kRing], static_cast<unsigned>((before / kRing) & 1));
      copy_next();
    }
    if (k + 1 < k1) at.advance();
  }
}

}  // namespace cupy_merge
