// The gradient of a merge given its results: the merged values V (`out`) and LSE S (`out_lse`),
// as the merge returned them. With both known, each state's gradients are its own:
//   w_i = exp(s_i - S),  dV_i = w_i dV,  ds_i = w_i (<dV, V_i> - <dV, V> + dS),  dz = w_z (dS - <dV, V>)
// so a row's states need no fold of their LSEs and no sum over them before an LSE gradient is
// known (merge_backward.cu's two steps, which left its long rows waiting on memory at the
// occupancy their registers allow, session 14), and any share of them may go to any block. The
// price is one more read, of V: [tokens, heads, head_size], a state's worth.
// Conventions as merge_backward.cu's (layouts, base-2 LSEs, zero-weight states, ragged rows no
// token owns zeroed, the sinks' gradients summed over tokens); S is read as given: a NaN S gives
// its row NaN gradients, -inf (an empty row) or +inf (a +inf sink) zero weights.
//
// Launch: block (lanes, rows_y), 128 threads, `lanes` (a power of two <= 32) threads a row; a
// grid-stride loop over rows; gridDim.y splits, split y taking the row's chunks y, y + splits, ...
// of kChunk states. PACKS (1 or 2): a row is 1 to PACKS x lanes packs, each lane holding its
// packs of dV in registers; 0: any head_size (rows loop over their packs).
//
// On sm_90 and sm_100 (kStagingFits) a thread stages its chunks (rows of 1 or 2 packs a lane of 4,
// 8 or 16 bytes: kStaged) in shared memory through cp.async, several chunks in flight (MERGE_ASYNC),
// as merge_backward.cu's: held in registers, a thread's chunk loads waited one after another, few
// blocks a multiprocessor (rows of 64 states: 0.78 waves, 22 % of warps active, session 18).
// Held chunks ask L2 for the next (MERGE_PREFETCH).
#include "backward.cuh"
#include "grid.cuh"

#ifndef MERGE_CHUNK
#define MERGE_CHUNK 4
#endif
// Staged chunks (the tuning's backward_given_*): dense rows MERGE_GIVEN_STAGES chunks of
// MERGE_GIVEN_CHUNK states in flight a thread, ragged rows MERGE_GIVEN_RAGGED_STAGES of
// MERGE_GIVEN_RAGGED_CHUNK. Held chunks are of MERGE_CHUNK states.
#ifndef MERGE_GIVEN_CHUNK
#define MERGE_GIVEN_CHUNK 2
#endif
#ifndef MERGE_GIVEN_STAGES
#define MERGE_GIVEN_STAGES 4
#endif
#ifndef MERGE_GIVEN_RAGGED_CHUNK
#define MERGE_GIVEN_RAGGED_CHUNK 4
#endif
#ifndef MERGE_GIVEN_RAGGED_STAGES
#define MERGE_GIVEN_RAGGED_STAGES 2
#endif

namespace cupy_merge {

// Four chunks of two states in flight took dense rows of 64 states from 81.8 to 85.6 % of the
// copy where two of four had the same bytes in flight (session 20); ragged rows lost 1-4 points.
// The kernel has no other shared arrays: its chunks may take all 48 KiB of static shared memory.
template <bool RAGGED>
constexpr int kGivenStagedChunk = RAGGED ? MERGE_GIVEN_RAGGED_CHUNK : MERGE_GIVEN_CHUNK;
template <bool RAGGED>
constexpr int kGivenStages = RAGGED ? MERGE_GIVEN_RAGGED_STAGES : MERGE_GIVEN_STAGES;
template <typename TIn, int VEC, int PACKS, bool RAGGED>
constexpr bool kFromOutputStaged =
    kStaged<MERGE_ASYNC, TIn, VEC, PACKS, kGivenStagedChunk<RAGGED>, kGivenStages<RAGGED>, 49152>;
// Blocks a multiprocessor keeps, with 32-bit offsets: without a bound ptxas took 108 registers
// (dense rows of two packs a lane), 114 (ragged) and 64-79 (one pack), chunks held; held ragged
// rows spill at 5 and 8. Staged, ragged rows of two packs a lane fit 5 (96 registers, no spill;
// ragged rows of one 16-byte pack spill 4 bytes at 6, session 19).
template <typename Index, int PACKS, bool RAGGED, bool STAGED>
constexpr int kFromOutputMinBlocks = sizeof(Index) != 4 ? 1
                                     : RAGGED           ? (PACKS == 2 ? (STAGED ? 5 : 4) : 6)
                                                        : (PACKS == 2 ? 5 : 8);

template <typename TIn, typename TOut, int VEC, int PACKS, bool RAGGED, bool SINKS, typename Index>
__global__ void __launch_bounds__(kBackwardThreads, kFromOutputMinBlocks<Index, PACKS, RAGGED, kFromOutputStaged<TIn, VEC, PACKS, RAGGED>>) merge_states_backward_from_output(
    TIn* __restrict__ gv0, TIn* __restrict__ gv1, float* __restrict__ gs0, float* __restrict__ gs1,
    float* sink_terms,
    const TIn* __restrict__ v0, const TIn* __restrict__ v1, const float* __restrict__ s0, const float* __restrict__ s1,
    const TOut* __restrict__ grad_out, const float* __restrict__ grad_lse, const TOut* __restrict__ out,
    const float* __restrict__ out_lse, const float* __restrict__ sinks,
    const void* indptr, long long indptr_bytes, long long indptr_stride,
    long long num_states, long long num_tokens, long long num_heads, long long head_size,
    long long v0_stride_token, long long v0_stride_head, long long v1_stride_token, long long v1_stride_head,
    long long v_stride_state,
    long long gv0_stride_token, long long gv0_stride_head, long long gv1_stride_token, long long gv1_stride_head,
    long long gv_stride_state,
    long long s0_stride_head, long long s0_stride_token, long long s1_stride_head, long long s1_stride_token,
    long long s_stride_state,
    long long gs0_stride_head, long long gs0_stride_token, long long gs1_stride_head, long long gs1_stride_token,
    long long gs_stride_state,
    long long grad_out_stride_token, long long grad_out_stride_head,
    long long grad_lse_stride_head, long long grad_lse_stride_token,
    long long out_stride_token, long long out_stride_head, long long out_lse_stride_head, long long out_lse_stride_token,
    long long sinks_stride, long long lanes, long long lse_base_2, long long head_multiplier, long long head_shift) {
  constexpr int kHeld = PACKS > 0 ? PACKS : 1;  // the packs a lane holds (PACKS 0: its first, unused)
  constexpr bool kAsync = kFromOutputStaged<TIn, VEC, PACKS, RAGGED>;
  constexpr int kChunk = kAsync ? kGivenStagedChunk<RAGGED> : MERGE_CHUNK;  // states loaded together
  constexpr int kStages = kGivenStages<RAGGED>;                             // staged: chunks in flight
  static_assert(kStages >= 2, "two chunks in flight at least");
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  using Stages = StagedChunks<InPack, kChunk, kHeld, kStages>;
  __shared__ __align__(16) unsigned char staged_values[kAsync ? Stages::kValueBytes : 16];
  __shared__ float staged_lses[kAsync ? Stages::kLses : 1];
  launch_dependents();
  const int lane = threadIdx.x;
  const Stages staged{reinterpret_cast<InPack*>(staged_values), staged_lses,
                      static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x)};
  const Index split = static_cast<Index>(blockIdx.y), splits = static_cast<Index>(gridDim.y);
  const Index packs = static_cast<Index>(head_size / VEC);
  const int row_lanes = static_cast<int>(lanes);
  bool has_pack[kHeld];
  Index pack[kHeld];  // the packs this lane loads: lane, lane + lanes, ... (those past the row's: its first)
#pragma unroll
  for (int q = 0; q < kHeld; ++q) {
    has_pack[q] = lane + q * row_lanes < packs;
    pack[q] = has_pack[q] ? lane + q * row_lanes : 0;
  }
  const float to_natural = lse_to_natural(lse_base_2);
  const float ln2_if_base_2 = lse_base_2 ? kLn2 : 1.0f;
  const float log2e_if_base_2 = lse_base_2 ? kLog2E : 1.0f;
  const Index heads = static_cast<Index>(num_heads);
  const Index rows = static_cast<Index>(num_tokens) * heads;
  wait_for_inputs();
  // The block's rows advance together, so that a warp stays converged: a row past the last
  // (valid false) reads the last row, writes nothing and, ragged, has no states.
  for (Index block_row = static_cast<Index>(blockIdx.x) * blockDim.y; block_row < rows;
       block_row += static_cast<Index>(gridDim.x) * blockDim.y) {
    const bool valid = block_row + static_cast<Index>(threadIdx.y) < rows;
    const Index row = valid ? block_row + static_cast<Index>(threadIdx.y) : rows - 1;
    const BackwardRow<Index> at = backward_row<RAGGED>(row, valid, heads, head_multiplier, head_shift, indptr, indptr_bytes,
                                                       indptr_stride, num_states, static_cast<Index>(num_states));
    const Index token = at.token, head = at.head, first = at.first, count = at.count;
    const bool bad = at.bad;
    const Index loop_count = RAGGED ? warp_max(count) : count;  // every row of the warp loops this far
    const Index t0 = RAGGED ? 0 : token;  // a ragged token's offset is in its state index
    const auto lse_at = StatePointers<const float, Index>::of(s0, s1, t0, head, s0_stride_token, s0_stride_head,
                                                              s1_stride_token, s1_stride_head, s_stride_state);
    const auto v_at = StatePointers<const TIn, Index>::of(v0, v1, t0, head, v0_stride_token, v0_stride_head,
                                                          v1_stride_token, v1_stride_head, v_stride_state);
    const auto gv_at = StatePointers<TIn, Index>::of(gv0, gv1, t0, head, gv0_stride_token, gv0_stride_head,
                                                     gv1_stride_token, gv1_stride_head, gv_stride_state);
    const auto gs_at = StatePointers<float, Index>::of(gs0, gs1, t0, head, gs0_stride_token, gs0_stride_head,
                                                       gs1_stride_token, gs1_stride_head, gs_stride_state);
    // State i (0 <= i < loop_count) as loaded: past the row's count the last (or the batch's
    // first, for none) stands in, and is not used: within a chunk the loads are unconditional.
    auto loaded = [&](Index i) { return count == 0 ? 0 : first + min(i, count - 1); };
    // This split's chunks: states i0 .. i0 + kChunk - 1 for i0 = first_chunk, + chunk_step, ...
    const Index first_chunk = split * kChunk, chunk_step = splits * kChunk;
    auto stage_chunk = [&](Index i0, int stage) {  // kAsync: chunk i0 into `stage`
      if constexpr (kAsync) staged.copy(stage, i0 < loop_count, [&](int j) { return loaded(i0 + j); }, lse_at, v_at, pack);
    };
    if constexpr (kAsync) {  // issued before the row's own loads below, which need nothing of them
      stage_chunk(first_chunk, 0);
      stage_chunk(first_chunk + chunk_step, 1);
#pragma unroll
      for (int stage = 2; stage < kStages; ++stage) stage_chunk(first_chunk + stage * chunk_step, stage);
    }

    // The row's S, dS, its lanes' packs of dV and <dV, V>: loads in flight with the first chunk's
    // (staged: copied above; held: loaded below, nothing of theirs depending on these).
    const float S = out_lse[head * static_cast<Index>(out_lse_stride_head) + token * static_cast<Index>(out_lse_stride_token)] *
                    to_natural;
    const float dS = grad_lse == nullptr ? 0.0f
                     : grad_lse[head * static_cast<Index>(grad_lse_stride_head) + token * static_cast<Index>(grad_lse_stride_token)] * log2e_if_base_2;
    const Index row_offset_out = token * static_cast<Index>(out_stride_token) + head * static_cast<Index>(out_stride_head);
    const OutPack* V_row = reinterpret_cast<const OutPack*>(out + row_offset_out);
    const OutPack* dV_row = grad_out == nullptr ? nullptr
                            : reinterpret_cast<const OutPack*>(grad_out + (token * static_cast<Index>(grad_out_stride_token) +
                                                                           head * static_cast<Index>(grad_out_stride_head)));
    float dV[kHeld][VEC] = {};  // PACKS: this lane's packs of dV, widened once for every state (zero past the row)
    float dot_part = 0.0f;      // this lane's part of <dV, V>
    if (dV_row != nullptr) {
      if constexpr (PACKS > 0) {
#pragma unroll
        for (int q = 0; q < kHeld; ++q) {
          if (!has_pack[q]) continue;
          const OutPack held = dV_row[pack[q]];
          const OutPack merged = V_row[pack[q]];
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            dV[q][k] = to_float(held.v[k]);
            dot_part = fmaf(dV[q][k], to_float(merged.v[k]), dot_part);
          }
        }
      } else {
        for (Index p = lane; p < packs; p += row_lanes) {
          const OutPack held = dV_row[p], merged = V_row[p];
#pragma unroll
          for (int k = 0; k < VEC; ++k) dot_part = fmaf(to_float(held.v[k]), to_float(merged.v[k]), dot_part);
        }
      }
    }
    const float dot_v = row_sum(dot_part, row_lanes);  // <dV, V>
    const bool finite_S = S != negative_infinity() && S != positive_infinity();
    auto weight = [&](float s) { return finite_S ? backward_weight(s - S) : (is_nan(S) ? S : 0.0f); };
    // w_i (<dV, V_i> - <dV, V> + dS), in the LSEs' base.
    auto lse_gradient = [&](float w, float d_i) {
      return (w == 0.0f ? 0.0f : w * (d_i - dot_v + dS)) * ln2_if_base_2;
    };

    if constexpr (PACKS > 0) {
      int stage = 0;
#pragma unroll 1
      for (Index i0 = first_chunk; i0 < loop_count; i0 += chunk_step, stage = next_stage<kStages>(stage)) {
        // Held: the chunk's loads together, then L2 asked for the next chunk's values. Staged:
        // each state's packs read from shared memory just before their use (fewer registers).
        float lse[kChunk];
        InPack x[kChunk][kHeld];
        if constexpr (kAsync) {
          wait_async<kStages - 1>();  // this chunk's group (the next chunks' may still be out)
#pragma unroll
          for (int j = 0; j < kChunk; ++j) lse[j] = staged.lse(stage, j);
        } else {
#pragma unroll
          for (int j = 0; j < kChunk; ++j) {
            lse[j] = *lse_at.at(loaded(i0 + j));
#pragma unroll
            for (int q = 0; q < kHeld; ++q) x[j][q] = load_pack(reinterpret_cast<const InPack*>(v_at.at(loaded(i0 + j))) + pack[q]);
          }
          if (MERGE_PREFETCH && i0 + chunk_step < loop_count) {  // uniform across the warp
            prefetch_chunk<kChunk, InPack>([&](int j) { return loaded(i0 + chunk_step + j); }, v_at, pack);
          }
        }
        // Every state of the chunk, past the row too (weight 0, nothing stored): each one's value
        // gradients and this lane's part of <dV, V_i>, then the row's sums of all of them together.
        float w[kChunk], d[kChunk];
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const Index i = i0 + j;
          w[j] = i < count ? weight(empty_if_inf(lse[j]) * to_natural) : 0.0f;
          d[j] = 0.0f;
#pragma unroll
          for (int q = 0; q < kHeld; ++q) {
            float part = 0.0f;
            const InPack x_jq = kAsync ? staged.value(stage, j, q) : x[j][q];
            const InPack g = state_gradient<TIn, VEC>(w[j], x_jq, dV[q], part);
            d[j] += has_pack[q] ? part : 0.0f;  // a pack past the row's is its first: 0 x inf would be NaN
            InPack* const to = reinterpret_cast<InPack*>(gv_at.at(first + i)) + pack[q];  // outside the test: a predicated store
            if (valid && i < count && has_pack[q]) store_pack(to, g);
          }
        }
        stage_chunk(i0 + kStages * chunk_step, stage);  // staged: after this chunk's reads
        row_sums(d, row_lanes);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const Index i = i0 + j;
          if (valid && i < count && (j & (row_lanes - 1)) == lane) *gs_at.at(first + i) = lse_gradient(w[j], d[j]);
        }
      }
    } else {
#pragma unroll 1
      for (Index i = split; i < loop_count; i += splits) {
        const bool real = valid && i < count;
        const float w = i < count ? weight(empty_if_inf(*lse_at.at(loaded(i))) * to_natural) : 0.0f;
        const InPack* vi = reinterpret_cast<const InPack*>(v_at.at(loaded(i)));
        float partial = 0.0f;
        for (Index p = lane; i < count && p < packs; p += row_lanes) {
          const OutPack dv = dV_row != nullptr ? dV_row[p] : OutPack{};
          float d[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) d[k] = to_float(dv.v[k]);
          const InPack g = state_gradient<TIn, VEC>(w, load_pack(vi + p), d, partial);
          if (valid) store_pack(reinterpret_cast<InPack*>(gv_at.at(first + i)) + p, g);
        }
        const float d_i = row_sum(partial, row_lanes);
        if (real && lane == 0) *gs_at.at(first + i) = lse_gradient(w, d_i);
      }
    }
    if (split != 0 || !valid) continue;
    if constexpr (RAGGED) {
      if (bad) zero_bad_token_rows<VEC>(gv_at, gs_at, indptr, indptr_bytes, indptr_stride, token, num_states, lane,
                                        row_lanes, packs, Index{0}, Index{1});
    }
    if constexpr (SINKS) {
      if (lane == 0) {  // every row's term is written: bad offsets add 0
        const float sink = sink_logit<SINKS>(sinks, static_cast<int>(sinks_stride), head);
        const float w_z = bad ? 0.0f : S == positive_infinity() ? 1.0f : S == negative_infinity() ? 0.0f
                                                                         : backward_weight(sink - S);
        sink_terms[head * static_cast<Index>(num_tokens) + token] = w_z == 0.0f ? 0.0f : w_z * (dS - dot_v);
      }
    }
  }
  if constexpr (RAGGED) {
    const Index block = static_cast<Index>(blockIdx.y) * gridDim.x + blockIdx.x;
    const Index thread_rows = static_cast<Index>(gridDim.x) * gridDim.y * blockDim.y;
    zero_unowned_rows<VEC, TIn, Index>(gv0, gv1, gs0, gs1, indptr, indptr_bytes, indptr_stride, num_states, num_tokens, heads,
                           packs, gv0_stride_head, gv1_stride_head, gv_stride_state, gs0_stride_head, gs1_stride_head,
                           gs_stride_state, block * static_cast<Index>(blockDim.y) + static_cast<Index>(threadIdx.y), thread_rows, lane,
                           row_lanes);
  }
}

}  // namespace cupy_merge
