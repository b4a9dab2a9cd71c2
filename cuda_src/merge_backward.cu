// The gradient of a merge of attention states (two-way, N-way or ragged, with optional sinks).
//
// Forward (natural log): S = log(sum_i exp(s_i) [+ exp(z)]), V = sum_i w_i V_i, w_i = exp(s_i - S).
// Given the gradients dV of V and dS of S:
//   dV_i = w_i dV
//   ds_i = w_i (<dV, V_i> - <dV, V> + dS)        (<.,.> over head_size; <dV, V> = sum_i w_i <dV, V_i>)
//   dz   = w_z (dS - <dV, V>),  w_z = exp(z - S)  (summed over the tokens of the sink's head: each
//          row's term is stored in sink_terms [heads, tokens] (bad offsets: 0), and
//          sum_sink_terms adds them up in a fixed order, so the sinks' gradients are the same bits
//          run to run, where float atomics added them in the order the blocks ran)
// A state of weight zero gets zero gradients, never NaN, even when its values are NaN. A row
// whose S is NaN (a NaN LSE or sink) gets NaN gradients; an empty row (S = -inf) zeros.
// Base-2 LSEs (lse_base_2): s and S are converted to natural log on the way in, and ds to base 2
// on the way out (ds_2 = w_i (ln 2 (<dV, V_i> - <dV, V>) + dS_2)); sinks are natural either way.
//
// Layout: states are numbered 0..count-1 within a row (a (token, head) pair). State 0 lives at
// `v0` (strides v0_stride_token, v0_stride_head), states 1.. at `v1` + (i - 1) v_stride_state
// (strides v1_*): a dense stack passes v1 = v0 + one state, a two-way merge its two arrays, a
// ragged batch rows indptr[t] + i (token strides 0; the planner points v0/v1 at rows 0 and 1).
// The same for the LSEs (s0, s1), the value gradients (gv0, gv1) and the LSE gradients (gs0, gs1).
// Every gradient element is written: a ragged batch's rows before indptr[0], from
// indptr[num_tokens] on, and between the offsets of a token whose offsets are out of range get
// zeros; with offsets that decrease, every row is unspecified (tokens may claim the same rows).
// Gradients of the values are written in TIn, of the LSEs in float32; dV is read in TOut (the
// forward output's dtype), dS (grad_lse, may be null: 0) in float32.
//
// Launch: block (lanes, rows_y, groups), 128 threads: `lanes` (a power of two <= 32) threads share
// a row, striding over its packs; rows_y rows a block; a grid-stride loop over rows. Rows that are
// not short may split their states over `groups` (1, 2 or 4) groups of lanes x rows_y threads, one
// warp or more each: group g takes the chunks g, g + groups, ... of kChunk states (PACKS 0: states
// g, g + groups, ...), and the groups add their parts of <dV, V> through shared memory, so that
// rows of many states keep more of their loads in flight at once. Rows still too few for the GPU
// split their states over blocks too (gridDim.y splits, a share each): such a launch writes the
// value gradients and leaves w_i <dV, V_i> in the LSE gradients, and a second launch of the same
// kernel (finish = 1, one split, the same block shape, so that S is the same to the bit) sums
// those into <dV, V>, writes the LSE gradients and the sinks', and zeroes a ragged batch's rows
// no token owns. PACKS (1 or 2): every
// row is 1 to PACKS x `lanes` packs (rows of none, head_size 0, and of more than 64 packs take
// PACKS 0, which loops over the packs that exist), so each thread holds its packs of dV in registers across the states, which it
// takes a chunk at a time (kChunk). SHORT (2 or 4; 0 for longer rows): dense rows of exactly
// 2 or at most 4 states, kept whole in registers.
//
// On sm_90 and sm_100 (kStagingFits) a thread stages its chunks (rows that are not short) in shared
// memory through cp.async, two or more in flight, instead of holding one in registers (kBackwardStaged).
//
// Session 11 (benchmarks/PERF.md): the kernel was issue- and latency-bound, not memory-bound. Its
// loads are unconditional (addresses clamped into the arrays, results of states past a row's
// count unused), so that no value is zeroed or selected element by element.
#include "backward.cuh"
#include "grid.cuh"

#ifndef MERGE_CHUNK
#define MERGE_CHUNK 4
#endif
#ifndef MERGE_FOLD
#define MERGE_FOLD 8
#endif
// Staged dense rows (the tuning's backward_stages, backward_chunk): MERGE_BACKWARD_STAGES chunks
// of MERGE_BACKWARD_CHUNK states in flight a thread; ragged rows two of their held chunk's.
#ifndef MERGE_BACKWARD_CHUNK
#define MERGE_BACKWARD_CHUNK 2
#endif
#ifndef MERGE_BACKWARD_STAGES
#define MERGE_BACKWARD_STAGES 3
#endif
// Blocks a multiprocessor keeps of staged dense rows of two packs a lane (the tuning's
// backward_blocks; also bounded by their shared memory).
#ifndef MERGE_BACKWARD_BLOCKS
#define MERGE_BACKWARD_BLOCKS 5
#endif

namespace cupy_merge {

// The states a lane keeps in shared memory.
// With 32-bit offsets the kernel is held to 5 blocks' registers (the ragged rows took 102, which
// left room for 4; 64-bit offsets would spill); rows of two packs a lane whose chunks are held in
// registers to 4 where 5 spilled (dense: 280 bytes; ragged rows of 32-byte packs); short rows of 16-byte packs to 12 (2 states:
// 40 registers) and 8 (4 states: 56), which measured 2-5 points of the copy faster from 43 MB
// than 61 and 72 registers (session 12; wider packs spilled there).
constexpr int kBackwardSlots = 4;
// LSEs a lane loads at once while it folds its row's merged LSE (MERGE_FOLD, the tuning's
// backward_fold; rows of two packs a lane 2: their rows are short, and 8 spilled 56-88 bytes).
template <int PACKS>
constexpr int kFold = PACKS == 2 && MERGE_FOLD > 2 ? 2 : MERGE_FOLD;
// Whether a row's groups share the fold (each its part of the LSEs, then combined through shared
// memory) or each folds them all: sharing took rows of hundreds of states 2-13 points of the copy
// higher, but rows of two packs a lane spill with it and measured 1.5-5 points lower (session 14).
template <int PACKS>
constexpr bool kShareFold = PACKS != 2;
// States loaded together (MERGE_CHUNK; short rows all of theirs). Ragged rows of two packs a lane
// take 2: their rows are short and of uneven length, and 4 took 128 registers (session 12: 75-81 %
// of the copy against 74-78; staged, 4 measured no faster, session 16).
template <int PACKS, int SHORT, bool RAGGED>
constexpr int kHeldChunk = SHORT > MERGE_CHUNK ? SHORT : PACKS == 2 && RAGGED ? 2 : MERGE_CHUNK;
template <int PACKS, int SHORT, bool RAGGED>
constexpr int kStagedChunk = RAGGED ? kHeldChunk<PACKS, SHORT, RAGGED> : MERGE_BACKWARD_CHUNK;
template <bool RAGGED>
constexpr int kBackwardStages = RAGGED ? 2 : MERGE_BACKWARD_STAGES;
// Whether a row's chunks are staged in shared memory (kStaged, backward.cuh): rows that are not short.
template <typename TIn, int VEC, int PACKS, int SHORT, bool RAGGED>
constexpr bool kBackwardStaged = kStaged<MERGE_ASYNC && SHORT == 0, TIn, VEC, PACKS, kStagedChunk<PACKS, SHORT, RAGGED>,
                                         kBackwardStages<RAGGED>>;
template <typename TIn, int VEC, int PACKS, int SHORT, bool RAGGED>
constexpr int kBackwardChunk = kBackwardStaged<TIn, VEC, PACKS, SHORT, RAGGED> ? kStagedChunk<PACKS, SHORT, RAGGED>
                                                                                : kHeldChunk<PACKS, SHORT, RAGGED>;
// Staged, rows of two 16-byte packs a lane fit 5 blocks' registers without a spill (92 dense, 80
// ragged; 128 and 96 with 20 bytes spilled holding the chunk, session 16); dense ones 6 (80
// registers; 7 spilled 12 bytes, session 22).
template <typename Index, int PACKS, int SHORT, bool RAGGED, typename TIn, int VEC>
constexpr int kBackwardMinBlocks = sizeof(Index) != 4                                  ? 1
                                   : SHORT == 2 && sizeof(TIn) * VEC <= 16               ? 12
                                   : SHORT == 4 && sizeof(TIn) * VEC <= 16               ? 8
                                   : PACKS == 2 && (!RAGGED || sizeof(TIn) * VEC > 16) &&
                                         !kBackwardStaged<TIn, VEC, PACKS, SHORT, RAGGED> ? 4
                                   : PACKS == 2 && !RAGGED                              ? MERGE_BACKWARD_BLOCKS
                                                                                         : 5;

// A group's part of a row's merged LSE: the running maximum, the sum of exp(s - top), any NaN.
struct GroupFold {
  float top, total;
  bool broken;
};

// Index: the integer type of element offsets (int when the host found that every offset fits:
// 89 registers a thread with long long offsets held the kernel to 31 % occupancy, session 10).
// Pointers are __restrict__: the gradients are fresh arrays, so a state's loads may be issued
// before the previous state's stores (states 0 and 1.. of one array are disjoint regions).
template <typename TIn, typename TOut, int VEC, int PACKS, int SHORT, bool RAGGED, bool SINKS, typename Index>
__global__ void __launch_bounds__(kBackwardThreads, kBackwardMinBlocks<Index, PACKS, SHORT, RAGGED, TIn, VEC>) merge_states_backward(
    TIn* __restrict__ gv0, TIn* __restrict__ gv1, float* __restrict__ gs0, float* __restrict__ gs1,
    float* sink_terms,
    const TIn* __restrict__ v0, const TIn* __restrict__ v1, const float* __restrict__ s0, const float* __restrict__ s1,
    const TOut* __restrict__ grad_out, const float* __restrict__ grad_lse, const float* __restrict__ sinks,
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
    long long sinks_stride, long long lanes, long long lse_base_2, long long head_multiplier, long long head_shift,
    long long finish) {
  static_assert(SHORT == 0 || (PACKS > 0 && !RAGGED), "short rows are dense, their packs held in registers");
  constexpr int kHeld = PACKS > 0 ? PACKS : 1;  // the packs a lane holds (PACKS 0: its first, unused)
  constexpr int kChunk = kBackwardChunk<TIn, VEC, PACKS, SHORT, RAGGED>;
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  // State i's share w_i <dV, V_i> of <dV, V> and its weight, kept (until <dV, V> is known) by
  // lane i % lanes in its slot i / lanes: a thread's own slots, so no barrier; a row's states past
  // its lanes x kBackwardSlots go through the LSE gradient in memory instead.
  __shared__ float saved_terms[SHORT ? 1 : kBackwardSlots][kBackwardThreads];
  __shared__ float saved_weights[SHORT ? 1 : kBackwardSlots][kBackwardThreads];
  // Each group's part of its rows' merged LSE (where they share the fold) and <dV, V>, by (group,
  // row): two sets, alternate rows of the grid-stride loop, so that a barrier after each write
  // suffices (a group writes a row's part only after every group has passed a barrier of the
  // previous row, which follows their reads of the row before). Split and finishing launches
  // pass only the merged LSE's barrier, and use no shared memory where groups fold alone.
  __shared__ GroupFold group_folds[2][SHORT ? 1 : kBackwardThreads];
  __shared__ float group_dots[2][SHORT ? 1 : kBackwardThreads];
  // Rows that are not short: their chunks staged in shared memory, kStages in flight a thread.
  constexpr bool kAsync = kBackwardStaged<TIn, VEC, PACKS, SHORT, RAGGED>;
  constexpr int kStages = kBackwardStages<RAGGED>;
  static_assert(kStages >= 2, "two chunks in flight at least");
  using Stages = StagedChunks<InPack, kChunk, kHeld, kStages>;
  __shared__ __align__(16) unsigned char staged_values[kAsync ? Stages::kValueBytes : 16];
  __shared__ float staged_lses[kAsync ? Stages::kLses : 1];
  launch_dependents();
  const int lane = threadIdx.x;
  const int group = threadIdx.z, groups = blockDim.z;
  const int group_row = threadIdx.z * blockDim.y + threadIdx.y;  // this thread's row among the block's groups
  const int thread = group_row * blockDim.x + threadIdx.x;
  float* const my_terms = &saved_terms[0][thread];  // this thread's slots (addressed once, not a state)
  float* const my_weights = &saved_weights[0][thread];
  // The states of a row group g takes, in its order: the k-th is state_of(k).
  constexpr int kSpan = PACKS > 0 ? kChunk : 1;
  auto state_of = [&](Index k) -> Index { return (k / kSpan) * groups * kSpan + group * kSpan + k % kSpan; };
  int parity = 0;
  // Split launches (gridDim.y > 1: rows too few for the GPU) take a share of each row's states a
  // block and leave w_i <dV, V_i> in the LSE gradients; a finishing launch (finish, one split)
  // then sums them into <dV, V> and writes the LSE gradients and the sinks'.
  const Index split = static_cast<Index>(blockIdx.y), splits = static_cast<Index>(gridDim.y);
  const bool splitting = SHORT == 0 && splits > 1;  // short rows never split
  const Index packs = static_cast<Index>(head_size / VEC);
  const int row_lanes = static_cast<int>(lanes);
  bool has_pack[kHeld];
  Index pack[kHeld];  // the packs this lane loads: lane, lane + lanes, ... (those past the row's: its first)
#pragma unroll
  for (int q = 0; q < kHeld; ++q) {
    has_pack[q] = lane + q * row_lanes < packs;
    pack[q] = has_pack[q] ? lane + q * row_lanes : 0;
  }
  const int lane_shift = __ffs(row_lanes) - 1;  // lanes is a power of two
  const float to_natural = lse_to_natural(lse_base_2);
  const float ln2_if_base_2 = lse_base_2 ? kLn2 : 1.0f;
  const float log2e_if_base_2 = lse_base_2 ? kLog2E : 1.0f;
  const Index heads = static_cast<Index>(num_heads);
  const Index rows = static_cast<Index>(num_tokens) * heads;
  const unsigned row_mask =  // this row's lanes among the warp's
      lanes == 32 ? kWarp : ((1u << lanes) - 1u) << ((threadIdx.y * static_cast<unsigned>(lanes)) & 31u);
  wait_for_inputs();
  // The block's rows advance together, so that a warp stays converged: a row past the last
  // (valid false) reads the last row, writes nothing and, ragged, has no states.
  for (Index block_row = static_cast<Index>(blockIdx.x) * blockDim.y; block_row < rows;
       block_row += static_cast<Index>(gridDim.x) * blockDim.y) {
    const bool valid = block_row + static_cast<Index>(threadIdx.y) < rows;
    const Index row = valid ? block_row + static_cast<Index>(threadIdx.y) : rows - 1;
    const BackwardRow<Index> at = backward_row<RAGGED>(row, valid, heads, head_multiplier, head_shift, indptr, indptr_bytes,
                                                       indptr_stride, num_states, static_cast<Index>(SHORT == 2 ? 2 : num_states));
    const Index token = at.token, head = at.head, first = at.first, count = at.count;
    const bool bad = at.bad;
    // The states whose values this block takes: all of the row's, or split blockIdx.y's share (a
    // multiple of the chunk), `taken` from `from` on. The value work numbers them 0 .. taken - 1
    // (only the merged LSE and the finishing launch need the row's first and count), and every
    // row of the warp loops over 0 .. loop_count - 1 (its own up to taken real).
    Index from = first, taken = count;
    if (splitting) {
      const Index share = ((count + splits - 1) / splits + kSpan - 1) / kSpan * kSpan;
      const Index lo = min(count, split * share);
      from = first + lo;
      taken = min(count - lo, share);
    }
    const Index loop_count = RAGGED ? warp_max(taken) : taken;
    // The token's states: in a ragged batch the token's own offset moves into the state index
    // (rows first .. first + count - 1).
    const Index t0 = RAGGED ? 0 : token;
    const auto lse_at = StatePointers<const float, Index>::of(s0, s1, t0, head, s0_stride_token, s0_stride_head,
                                                              s1_stride_token, s1_stride_head, s_stride_state);
    const auto v_at = StatePointers<const TIn, Index>::of(v0, v1, t0, head, v0_stride_token, v0_stride_head,
                                                          v1_stride_token, v1_stride_head, v_stride_state);
    const auto gv_at = StatePointers<TIn, Index>::of(gv0, gv1, t0, head, gv0_stride_token, gv0_stride_head,
                                                     gv1_stride_token, gv1_stride_head, gv_stride_state);
    const auto gs_at = StatePointers<float, Index>::of(gs0, gs1, t0, head, gs0_stride_token, gs0_stride_head,
                                                       gs1_stride_token, gs1_stride_head, gs_stride_state);
    // Taken state i (0 <= i < loop_count) as loaded: past the taken, the last of them (or the
    // batch's first, for none) stands in, and is not used.
    auto loaded = [&](Index i) { return taken == 0 ? 0 : from + min(i, taken - 1); };
    auto lse_natural = [&](float s) { return empty_if_inf(s) * to_natural; };  // an LSE as read, in natural log
    auto lse_at_index = [&](Index at) { return lse_natural(*lse_at.at(at)); };
    auto lse_of = [&](Index i) { return lse_at_index(loaded(i)); };
    auto v_pack = [&](Index i, int q) {
      return load_pack(reinterpret_cast<const InPack*>(v_at.at(loaded(i))) + pack[q]);
    };
    // Loads that need nothing of S are issued first, together, so that one memory round trip
    // serves them.
    const float dS = grad_lse == nullptr ? 0.0f
                     : grad_lse[head * static_cast<Index>(grad_lse_stride_head) + token * static_cast<Index>(grad_lse_stride_token)] * log2e_if_base_2;
    const OutPack* dV_row = grad_out == nullptr ? nullptr
                            : reinterpret_cast<const OutPack*>(grad_out + (token * static_cast<Index>(grad_out_stride_token) +
                                                                           head * static_cast<Index>(grad_out_stride_head)));
    float dV[kHeld][VEC] = {};  // PACKS: this lane's packs of dV, widened once for every state (zero past the row)
#pragma unroll
    for (int q = 0; q < kHeld; ++q) {
      if (PACKS && !finish && dV_row != nullptr && has_pack[q]) {
        const OutPack held = dV_row[pack[q]];
#pragma unroll
        for (int k = 0; k < VEC; ++k) dV[q][k] = to_float(held.v[k]);
      }
    }
    const float sink = sink_logit<SINKS>(sinks, static_cast<int>(sinks_stride), head);
    // PACKS: state i's value gradients from its packs as held, and this lane's part of <dV, V_i>.
    auto held_state_gradients = [&](Index i, float w, const InPack (&xi)[kHeld]) {
      float partial = 0.0f;
#pragma unroll
      for (int q = 0; q < kHeld; ++q) {
        float part = 0.0f;
        const InPack g = state_gradient<TIn, VEC>(w, xi[q], dV[q], part);
        partial += has_pack[q] ? part : 0.0f;  // a pack past the row's is its first: 0 x inf would be NaN
        InPack* const to = reinterpret_cast<InPack*>(gv_at.at(from + i)) + pack[q];  // outside the test: a predicated store
        if (valid && i < taken && has_pack[q]) store_pack(to, g);
      }
      return partial;
    };
    auto lse_gradient = [&](bool broken, float w, float term, float dot_v) {
      return broken ? quiet_nan() : (w == 0.0f ? 0.0f : term + w * (dS - dot_v)) * ln2_if_base_2;
    };
    auto add_sink_gradient = [&](bool broken, float S, float dot_v) {
      if constexpr (SINKS) {
        if (lane == 0 && group == 0 && valid) {  // every row's term is written: bad offsets add 0
          const float w_z = bad ? 0.0f : broken ? quiet_nan() : S == positive_infinity() ? 1.0f
                            : S == negative_infinity() ? 0.0f : backward_weight(sink - S);
          sink_terms[head * static_cast<Index>(num_tokens) + token] = w_z == 0.0f ? 0.0f : w_z * (dS - dot_v);
        }
      }
    };
    auto merged_lse = [&](float top, float total) {
      return sink == positive_infinity() ? positive_infinity()
             : top == negative_infinity() ? negative_infinity()
                                          : top + __logf(total);
    };
    auto weight = [](bool broken, float S, float s) {
      return broken ? quiet_nan() : (S == negative_infinity() || S == positive_infinity()) ? 0.0f : backward_weight(s - S);
    };
    // The chunk of states i0 .. i0 + kChunk - 1, loaded together (LSEs of states past the row's
    // count -inf).
    float lse[kChunk];
    InPack x[kChunk][kHeld];
    auto load_chunk = [&](Index i0) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (SHORT && j >= SHORT) break;
        const float s = lse_of(i0 + j);
        lse[j] = i0 + j < taken ? s : negative_infinity();
#pragma unroll
        for (int q = 0; q < kHeld; ++q) x[j][q] = v_pack(i0 + j, q);
      }
      if constexpr (MERGE_PREFETCH && SHORT == 0) {
        const Index next = i0 + groups * kChunk;  // the group's next chunk
        if (next < loop_count) {  // uniform across the warp
          prefetch_chunk<kChunk, InPack>([&](int j) { return loaded(next + j); }, v_at, pack);
        }
      }
    };
    const Index first_chunk = static_cast<Index>(group) * kSpan;  // 0 for short rows (one group)
    const Index chunk_step = static_cast<Index>(groups) * kSpan;
    const Stages staged{reinterpret_cast<InPack*>(staged_values), staged_lses, thread};
    auto stage_chunk = [&](Index i0, int stage) {  // kAsync: chunk i0 into `stage`
      if constexpr (kAsync) staged.copy(stage, i0 < loop_count, [&](int j) { return loaded(i0 + j); }, lse_at, v_at, pack);
    };
    if constexpr (kAsync) {
      if (!finish) {
#pragma unroll
        for (int stage = 0; stage < kStages; ++stage) stage_chunk(first_chunk + stage * chunk_step, stage);
      }
    } else if (PACKS && !finish && first_chunk < loop_count) {
      load_chunk(first_chunk);
    }

    if constexpr (SHORT > 0) {
      // The whole row in registers: S from its LSEs, every lane holding every state's
      // <dV, V_i> (row_sum is a butterfly), no shared memory.
      float top = sink == positive_infinity() ? negative_infinity() : sink;
      bool broken = bad || is_nan(sink);
#pragma unroll
      for (int j = 0; j < SHORT; ++j) {
        broken |= is_nan(lse[j]);
        top = fmaxf(top, lse[j]);
      }
      float total = 0.0f;
      if (top != negative_infinity()) {
#pragma unroll
        for (int j = 0; j < SHORT; ++j) total += backward_weight(lse[j] - top);
        if constexpr (SINKS) total += backward_weight(sink - top);
      }
      const float S = merged_lse(top, total);
      float w[SHORT], term[SHORT], dot_v = 0.0f;
#pragma unroll
      for (int j = 0; j < SHORT; ++j) {
        w[j] = j < count ? weight(broken, S, lse[j]) : 0.0f;
        term[j] = held_state_gradients(j, w[j], x[j]);  // this lane's part of <dV, V_j>, then the row's
      }
      row_sums(term, row_lanes);
#pragma unroll
      for (int j = 0; j < SHORT; ++j) {
        term[j] = w[j] == 0.0f ? 0.0f : w[j] * term[j];  // a zero-weight state's NaN values add nothing
        dot_v += term[j];
      }
#pragma unroll
      for (int j = 0; j < SHORT; ++j) {
        if (valid && j < count && (j & (row_lanes - 1)) == lane) *gs_at.at(j) = lse_gradient(broken, w[j], term[j], dot_v);
      }
      add_sink_gradient(broken, S, dot_v);
      continue;
    }

    // Rows of more states. S first (its loads in flight with the first chunk's): each lane folds
    // its share of the LSEs (kFold loaded together: a dependent load a state left rows of hundreds
    // of states waiting on memory, session 14) into a running maximum and sum, then the row's
    // lanes combine theirs. Where groups share the fold (kShareFold), a lane's share is states
    // lane + group x lanes, stepping by the row's threads of every group, and the groups then
    // combine theirs through shared memory; otherwise every group folds all of them.
    float top = negative_infinity(), total = 0.0f;
    bool broken = false;
    auto fold_in = [&](float other_top, float other_total) {  // (top, total) with another part's
      const float both = fmaxf(top, other_top);
      total = (top == negative_infinity() ? 0.0f : total * backward_weight(top - both)) +
              (other_top == negative_infinity() ? 0.0f : other_total * backward_weight(other_top - both));
      top = both;
    };
    const Index fold_step = static_cast<Index>(kShareFold<PACKS> ? groups : 1) * row_lanes;
    const Index fold_first = lane + static_cast<Index>(kShareFold<PACKS> ? group : 0) * row_lanes;
    for (Index i0 = fold_first; i0 < count; i0 += kFold<PACKS> * fold_step) {
      float s[kFold<PACKS>];
      float batch_top = negative_infinity();
#pragma unroll
      for (int j = 0; j < kFold<PACKS>; ++j) {
        const Index i = i0 + j * fold_step;
        const float loaded_s = lse_at_index(first + min(i, count - 1));  // clamped: unconditional loads
        s[j] = i < count ? loaded_s : negative_infinity();
        broken |= is_nan(s[j]);
        batch_top = fmaxf(batch_top, s[j]);
      }
      if (batch_top == negative_infinity()) continue;  // empty states (or NaNs: broken)
      float batch_total = 0.0f;
#pragma unroll
      for (int j = 0; j < kFold<PACKS>; ++j) {
        batch_total += s[j] == negative_infinity() ? 0.0f : backward_weight(s[j] - batch_top);
      }
      fold_in(batch_top, batch_total);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      if (offset >= row_lanes) continue;
      const float other_top = __shfl_xor_sync(kWarp, top, offset, row_lanes);
      const float other_total = __shfl_xor_sync(kWarp, total, offset, row_lanes);
      fold_in(other_top, other_total);
    }
    broken = (__ballot_sync(kWarp, broken) & row_mask) != 0;
    const int row_parity = parity;  // this row's set of the shared parts (group_folds, group_dots)
    parity ^= 1;
    if (kShareFold<PACKS> && groups > 1) {  // uniform across the block
      if (lane == 0) group_folds[row_parity][group_row] = {top, total, broken};
      __syncthreads();
      top = negative_infinity(), total = 0.0f, broken = false;
      for (int g = 0; g < groups; ++g) {  // every group in the same order: the same S
        const GroupFold part = group_folds[row_parity][g * blockDim.y + threadIdx.y];
        fold_in(part.top, part.total);
        broken |= part.broken;
      }
    }
    broken = broken || bad || is_nan(sink);
    if constexpr (SINKS) {
      if (sink != positive_infinity() && sink != negative_infinity()) fold_in(sink, 1.0f);
    }
    const float S = merged_lse(top, total);
    if (finish) {  // after a split launch: every state's w_i <dV, V_i> is in its LSE gradient (group 0 sums them)
      const bool mine = valid && group == 0;  // the row's lanes alike
      float part = 0.0f;
      for (Index i = lane; mine && i < count; i += row_lanes) part += *gs_at.at(first + i);
      const float dot_v = row_sum(part, row_lanes);
      for (Index i = lane; mine && i < count; i += row_lanes) {
        float* gsi = gs_at.at(first + i);
        *gsi = lse_gradient(broken, weight(broken, S, lse_of(i)), *gsi, dot_v);
      }
      add_sink_gradient(broken, S, dot_v);
      continue;
    }
    float dot_v = 0.0f;  // <dV, V>
    auto finish_state = [&](Index i, Index k, float w, float d_i) {  // i: the k-th state of the group's, d_i <dV, V_i>
      const float term = w == 0.0f ? 0.0f : w * d_i;
      dot_v += term;
      if (i < taken && (k & (row_lanes - 1)) == lane) {
        const Index slot = k >> lane_shift;
        if (slot < kBackwardSlots && !splitting) {
          my_terms[slot * kBackwardThreads] = term;
          my_weights[slot * kBackwardThreads] = w;
        } else if (valid) {
          *gs_at.at(from + i) = term;
        }
      }
    };
    if constexpr (PACKS > 0) {
      Index k0 = 0;
      int stage = 0;
#pragma unroll 1
      for (Index i0 = first_chunk; i0 < loop_count; i0 += chunk_step, k0 += kChunk, stage = next_stage<kStages>(stage)) {
        if constexpr (kAsync) {
          wait_async<kStages - 1>();  // this chunk's group (the next chunks' may still be out)
        } else if (i0 > first_chunk) {
          load_chunk(i0);
        }
        // Every state of the chunk, past the row too (weight 0, nothing stored): each one's value
        // gradients and this lane's part of <dV, V_i>, then the row's sums of all of them together.
        float w[kChunk], d[kChunk];
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const Index i = i0 + j;
          // past the taken states -inf: weight 0
          const float s_j = kAsync ? (i < taken ? lse_natural(staged.lse(stage, j)) : negative_infinity()) : lse[j];
          InPack x_j[kHeld];
#pragma unroll
          for (int q = 0; q < kHeld; ++q) x_j[q] = kAsync ? staged.value(stage, j, q) : x[j][q];
          w[j] = weight(broken, S, s_j);
          d[j] = held_state_gradients(i, w[j], x_j);
        }
        row_sums(d, row_lanes);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) finish_state(i0 + j, k0 + j, w[j], d[j]);
        if constexpr (kAsync) stage_chunk(i0 + kStages * chunk_step, stage);  // after this chunk's reads
      }
    } else {
      Index nth = 0;  // i is the group's nth state
#pragma unroll 4
      for (Index i = group; i < loop_count; i += groups, ++nth) {
        const bool real = i < taken;
        const float w = real ? weight(broken, S, lse_of(i)) : 0.0f;
        const InPack* vi = reinterpret_cast<const InPack*>(v_at.at(loaded(i)));
        float partial = 0.0f;
        for (Index p = lane; real && p < packs; p += row_lanes) {
          const OutPack dv = dV_row != nullptr ? dV_row[p] : OutPack{};
          float d[VEC];
#pragma unroll
          for (int k = 0; k < VEC; ++k) d[k] = to_float(dv.v[k]);
          const InPack g = state_gradient<TIn, VEC>(w, load_pack(vi + p), d, partial);
          if (valid) store_pack(reinterpret_cast<InPack*>(gv_at.at(from + i)) + p, g);
        }
        finish_state(i, nth, w, row_sum(partial, row_lanes));
      }
    }
    if (RAGGED && valid && bad && split == 0) {  // no token may own the rows between its offsets
      zero_bad_token_rows<VEC>(gv_at, gs_at, indptr, indptr_bytes, indptr_stride, token, num_states, lane, row_lanes,
                               packs, static_cast<Index>(group), static_cast<Index>(groups));
    }
    if (splitting) continue;  // the LSE gradients and the sinks' are the finishing launch's
    if (groups > 1) {  // uniform across the block
      if (lane == 0) group_dots[row_parity][group_row] = dot_v;
      __syncthreads();
      dot_v = 0.0f;
      for (int g = 0; g < groups; ++g) dot_v += group_dots[row_parity][g * blockDim.y + threadIdx.y];
    }
    // ds_i = w_i d_i + w_i (dS - <dV, V>), by the lane that kept state i's share (every state
    // taken: not splitting).
    Index slot = 0;
    for (Index k = lane; valid && state_of(k) < taken; k += row_lanes, ++slot) {
      const Index i = state_of(k);
      float* gsi = gs_at.at(from + i);
      const bool kept = slot < kBackwardSlots;
      const float w = kept ? my_weights[slot * kBackwardThreads] : weight(broken, S, lse_of(i));
      const float term = kept ? my_terms[slot * kBackwardThreads] : *gsi;
      *gsi = lse_gradient(broken, w, term, dot_v);
    }
    add_sink_gradient(broken, S, dot_v);
  }
  if (RAGGED && !splitting) {  // a split launch leaves this to its finishing launch
    const Index block_rows = static_cast<Index>(blockDim.y * blockDim.z);  // rows of threads, every group's
    zero_unowned_rows<VEC, TIn, Index>(gv0, gv1, gs0, gs1, indptr, indptr_bytes, indptr_stride, num_states, num_tokens, heads,
                           packs, gv0_stride_head, gv1_stride_head, gv_stride_state, gs0_stride_head, gs1_stride_head,
                           gs_stride_state, static_cast<Index>(blockIdx.x) * block_rows + group_row,
                           static_cast<Index>(gridDim.x) * block_rows, lane, row_lanes);
  }
}

}  // namespace cupy_merge
