// One-pass merge of any number of attention states (section 2.2 of arXiv 2501.01005):
//   lse = log(sum_i exp(lse_i))
//   out = sum_i exp(lse_i - lse) * v_i
//
// Dense (indptr == nullptr): token t merges states 0..num_states-1:
//   v    [num_states, num_tokens, num_heads, head_size]   TIn
//   lse  [num_states, num_heads, num_tokens]              float32
// Ragged (indptr given, int32 or int64, num_tokens + 1 entries): token t merges
// rows indptr[t] .. indptr[t+1]-1; the token strides are then 0 and
//   v    [total_states, num_heads, head_size],  lse [num_heads, total_states].
// Out-of-range indptr entries (negative, decreasing, past total_states, more than
// kMaxStatesPerToken states) give a NaN row; the host checks them first unless told not to.
// Output: out [num_tokens, num_heads, head_size] TOut, out_lse [num_heads, num_tokens].
// Sinks (SINKS): float32 [num_heads] natural-log logits, each a state of value 0 counted
// once in its head's denominator (split 0 folds it in after the states).
//
// Two kernels: merge_many_states_packed (at the end) for the common layouts,
// one thread a 16-byte pack of the output; merge_many_states for everything
// else (any strides, narrow packs, 64-bit offsets).
//
// merge_many_states launch: block (threads_x, rows_y, splits), a 1-D grid over work items (rows_y
// tokens of one head). Thread (x, y, z) takes pack x of token y's row over the
// states z, z + splits, ...: MERGE_CHUNK states at a time, all their LSEs and
// value packs loaded before any is used (fold_row), folded into a running maximum, weight
// sum and weighted sum (online softmax). With splits > 1 the partial results
// meet in shared memory and split 0 combines them: many states, or few tokens,
// still give every multiprocessor enough loads in flight.
#include "conversions.cuh"
#include "packs.cuh"
#include "grid.cuh"
#include "fp8.cuh"
#include "fp4.cuh"
#include "ragged.cuh"

#ifndef MERGE_CHUNK
#define MERGE_CHUNK 4
#endif

namespace cupy_merge {

template <int VEC>
struct Partial {
  float acc[VEC];
  float sum;      // sum of exp(lse_i - lse_max) over the states folded in so far
  float lse_max;  // natural log; -inf until a non-empty state is seen
  bool any_nan;

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    sum = 0.0f;
    lse_max = negative_infinity();
    any_nan = false;
  }

  // Moves the running sums to a new maximum (not below the old one) and returns the base that
  // incoming weights are taken against. While every state so far is empty the maximum is
  // -inf; 0 stands in for it then, so that no weight is exp(-inf - -inf) = NaN (the sums are
  // 0 and stay 0). States whose weight underflows to 0 against the new maximum are dropped,
  // not multiplied by 0: their values may be NaN (an empty split marked with a tiny LSE).
  __device__ __forceinline__ float rebase(float new_max) {
    const float base = new_max == negative_infinity() ? 0.0f : new_max;
    const float rescale = exp_weight(lse_max - base);  // exp(-inf) = 0 the first time
    sum *= rescale;
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = rescale == 0.0f ? 0.0f : acc[k] * rescale;
    lse_max = new_max;
    return base;
  }

  // Adds a chunk of states; those past the end of the row arrive with lse = -inf (weight zero).
  // Branch-free (selects, no early return): 0.3-2 points of copy speed faster than the same
  // fold with branches (benchmarks/PERF.md, session 7, run 5).
  template <typename TIn>
  __device__ __forceinline__ void fold(const float (&lse)[MERGE_CHUNK], const Pack<TIn, VEC> (&values)[MERGE_CHUNK]) {
    float new_max = lse_max;
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j) {
      any_nan |= is_nan(lse[j]);
      new_max = fmaxf(new_max, lse[j]);  // fmaxf ignores NaN
    }
    const float base = rebase(new_max);
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j) {
      const float weight = exp_weight(lse[j] - base);
      sum += weight;
      // A state of weight zero adds nothing, even if its values are NaN (an empty split).
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = weight == 0.0f ? acc[k] : fmaf(weight, to_float(values[j].v[k]), acc[k]);
    }
  }

  // Folds in one other partial (the block-wide tree of combine_splits takes them a pair at a time).
  __device__ __forceinline__ void merge(const Partial& other) {
    any_nan |= other.any_nan;
    const float base = rebase(fmaxf(lse_max, other.lse_max));
    const float weight = exp_weight(other.lse_max - base);  // 0 for an empty partial (its sums are 0)
    sum = fmaf(other.sum, weight, sum);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = weight == 0.0f ? acc[k] : fmaf(other.acc[k], weight, acc[k]);
  }

  // The partial `delta` lanes down the warp (lanes in `mask` only).
  __device__ __forceinline__ Partial shuffled_down(unsigned mask, int delta) const {
    Partial other;
#pragma unroll
    for (int k = 0; k < VEC; ++k) other.acc[k] = __shfl_down_sync(mask, acc[k], delta);
    other.sum = __shfl_down_sync(mask, sum, delta);
    other.lse_max = __shfl_down_sync(mask, lse_max, delta);
    other.any_nan = __shfl_down_sync(mask, static_cast<int>(any_nan), delta) != 0;
    return other;
  }

  // Folds in an attention sink: a state of value 0 and LSE `sink` (natural log). -inf is no
  // sink; NaN breaks the row; +inf takes all the weight (values 0, LSE +inf).
  __device__ __forceinline__ void add_sink(float sink) {
    const bool broken = any_nan || is_nan(sink);
    if (sink == positive_infinity()) {
      reset();
      lse_max = sink;
      sum = 1.0f;
    }
    any_nan = broken;
    if (sink == positive_infinity()) return;
    const float base = rebase(fmaxf(lse_max, sink));
    sum += exp_weight(sink - base);
  }

  // What multiplies acc into the merged values: 1 / sum, 0 for an empty row (no state, or
  // only empty ones), NaN for a broken one (a NaN LSE, bad offsets). The largest weight is
  // exp(0) = 1, so sum lies in [1, number of states], where the fast reciprocal and
  // logarithm are within a few ulp (and measured 0-3 points of copy speed faster, session 7).
  __device__ __forceinline__ float norm(bool broken) const {
    return broken ? quiet_nan() : lse_max == negative_infinity() ? 0.0f : __fdividef(1.0f, sum);
  }

  // The merged LSE in natural log (-inf for an empty row, NaN for a broken one).
  __device__ __forceinline__ float natural_lse(bool broken) const {
    return broken ? quiet_nan() : lse_max == negative_infinity() ? negative_infinity() : lse_max + __logf(sum);
  }
};

// The last state index of the chunk starting at i0 (a short chunk re-reads it).
template <typename Index>
__device__ __forceinline__ int chunk_last(Index i0, Index count) {
  return count - i0 < MERGE_CHUNK ? static_cast<int>(count - i0) - 1 : MERGE_CHUNK - 1;
}

// A chunk's LSEs in natural log; slots past `last` are -inf (weight zero).
__device__ __forceinline__ void natural_chunk_lse(const float (&raw)[MERGE_CHUNK], int last, float to_natural,
                                                  float (&lse)[MERGE_CHUNK]) {
#pragma unroll
  for (int j = 0; j < MERGE_CHUNK; ++j) lse[j] = j <= last ? empty_if_inf(raw[j]) * to_natural : negative_infinity();
}

// A chunk of MERGE_CHUNK states of a row as loaded: raw LSEs and value packs.
template <typename TIn, int VEC>
struct Chunk {
  float raw_lse[MERGE_CHUNK];
  Pack<TIn, VEC> values[MERGE_CHUNK];
};

// Loads the states i0 .. i0 + MERGE_CHUNK - 1 of a row (a short chunk re-reads its last
// state: no branch between the loads). `column`: the thread's pack in the row's first
// state; without `has_pack` only the LSEs are read.
template <typename TIn, int VEC, typename Index, typename LseStride>
__device__ __forceinline__ Chunk<TIn, VEC> load_chunk(const float* row_lse, const Pack<TIn, VEC>* column, Index i0,
                                                      Index count, LseStride lse_stride_state,
                                                      Index pack_stride_state, bool has_pack) {
  const int last = chunk_last(i0, count);
  Chunk<TIn, VEC> chunk = {};
#pragma unroll
  for (int j = 0; j < MERGE_CHUNK; ++j) chunk.raw_lse[j] = row_lse[(i0 + min(j, last)) * lse_stride_state];
  if (has_pack) {
#pragma unroll
    for (int j = 0; j < MERGE_CHUNK; ++j) chunk.values[j] = load_pack(column + (i0 + min(j, last)) * pack_stride_state);
  }
  // ptxas does not move memory operations across a warp barrier, so every load of the chunk
  // issues before the arithmetic that uses the LSEs. Without it, ptxas issued three of the
  // four value loads after that arithmetic whenever the kernel around it changed enough:
  // two round trips a chunk, 1-3 % slower (benchmarks/PERF.md, sessions 7 and 8). The threads
  // that reach this point together (a warp may split over rows of different lengths).
  __syncwarp(__activemask());
  return chunk;
}

// Folds a row's chunks starting at states first, first + step, ... (before `count`) into
// `part`, one memory round trip a chunk: a chunk is loaded at the bottom of the previous
// iteration (the first before the loop), its loads kept together by load_chunk's barrier.
// (Issuing the next chunk's loads before folding the current one took 97 registers
// instead of 48 and measured 3-20 % slower: benchmarks/PERF.md, session 8.)
template <typename TIn, int VEC, typename Index, typename LseStride>
__device__ __forceinline__ void fold_row(Partial<VEC>& part, const float* row_lse, const Pack<TIn, VEC>* column,
                                         Index first, Index step, Index count, LseStride lse_stride_state,
                                         Index pack_stride_state, float to_natural, bool has_pack) {
  if (first >= count) return;
  Index i0 = first;
  Chunk<TIn, VEC> chunk = load_chunk(row_lse, column, i0, count, lse_stride_state, pack_stride_state, has_pack);
#pragma unroll 1
  while (true) {
    float lse[MERGE_CHUNK];
    natural_chunk_lse(chunk.raw_lse, chunk_last(i0, count), to_natural, lse);
    part.template fold<TIn>(lse, chunk.values);
    i0 += step;
    if (i0 >= count) break;
    chunk = load_chunk(row_lse, column, i0, count, lse_stride_state, pack_stride_state, has_pack);
  }
}

// The partials of a block's `splits` groups of `lanes` threads (the group's lane: `lane`; the
// thread's index in the block is split x lanes + lane), combined lane by lane into split 0's, as
// a tree: at level h, split y with y % 2h == 0 folds in split y + h. Levels whose pairs lie within
// a warp (a power-of-two group of at most 16 threads) exchange by shuffles; the rest through
// `shared` ([splits - 1][lanes] partials), one barrier a level: a level's writers (y % 2h == h) are
// done after it, and the next level's (y % 4h == 2h) write slots no one reads before the next
// barrier. log2(splits) steps instead of the splits - 1 of a serial combine (with few rows a block
// holds up to 1024 / packs splits: benchmarks/PERF.md, session 10). Both N-way kernels combine
// this way, so that a row's association order (split y folds chunks y, y + splits, ..., then this
// tree) follows the number of splits alone, whichever kernel the planner picks: batch-invariant
// plans choose that number from the row's state count. Every thread of the block must call it.
template <int VEC>
__device__ __forceinline__ void combine_splits(Partial<VEC>& part, Partial<VEC>* shared, int split, int splits,
                                               int lanes, int lane) {
  int h = 1;
  if ((lanes & (lanes - 1)) == 0 && lanes <= 16) {
    const int thread = split * lanes + lane;
    const int active = min(32, splits * lanes - (thread & ~31));  // a block's last warp may be partial
    const unsigned mask = active == 32 ? 0xffffffffu : (1u << active) - 1u;
    for (; h < splits && 2 * h * lanes <= 32; h *= 2) {
      const Partial<VEC> other = part.shuffled_down(mask, h * lanes);
      if (split % (2 * h) == 0 && split + h < splits) part.merge(other);
    }
  }
  for (; h < splits; h *= 2) {
    if (split % (2 * h) == h) shared[(split - 1) * lanes + lane] = part;
    __syncthreads();
    if (split % (2 * h) == 0 && split + h < splits) part.merge(shared[(split + h - 1) * lanes + lane]);
  }
}

// SPLIT: whether the block's z threads share rows (the instantiation without it
// has no barrier or shared memory at all; blockDim.z is then 1). Index: the
// integer type of element offsets, int when the host found that every offset
// fits (fewer registers: more threads resident, more loads in flight), else long long.
template <typename TIn, typename TOut, int VEC, bool SPLIT, typename Index, bool SINKS>
__global__ void merge_many_states(
    TOut* out, float* out_lse, const float* output_scale, const TIn* v, const float* lse,
    const void* indptr, long long indptr_bytes, long long indptr_stride,
    long long num_states, long long num_tokens, long long num_heads, long long head_size,
    long long out_stride_token, long long out_stride_head,
    long long v_stride_state, long long v_stride_token, long long v_stride_head,
    long long out_lse_stride_head, long long out_lse_stride_token,
    long long lse_stride_state, long long lse_stride_head, long long lse_stride_token,
    long long lse_base_2, const float* sinks, int sinks_stride) {
  using InPack = Pack<TIn, VEC>;
  using OutPack = Pack<TOut, VEC>;
  launch_dependents();
  // Partials of splits 1.. for split 0 to combine: [splits - 1][rows_y][threads_x].
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  Partial<VEC>* shared_partials = reinterpret_cast<Partial<VEC>*>(shared_bytes);
  const int split = SPLIT ? threadIdx.z : 0, splits = SPLIT ? blockDim.z : 1;
  const Index num_packs = head_size / VEC;
  const Index pack_stride_state = v_stride_state / VEC;  // the host checks divisibility
  const float to_natural = lse_to_natural(lse_base_2);
  const float from_natural = lse_from_natural(lse_base_2);
  const Index work_items = (num_tokens + blockDim.y - 1) / blockDim.y * num_heads;
  // A thread covers packs x, x + threads_x, ...; with head_size 0 one pass still computes the LSE.
  const Index passes = num_packs == 0 ? 1 : (num_packs + blockDim.x - 1) / blockDim.x;
  wait_for_inputs();
  const float inverse_scale = output_inverse_scale<TOut>(output_scale);

  for (Index work = blockIdx.x; work < work_items; work += gridDim.x) {
    const Index head = block_head(work, num_heads);
    const Index token = block_token_block(work, num_heads) * blockDim.y + threadIdx.y;
    const bool token_valid = token < num_tokens;
    const float sink = sink_logit<SINKS>(sinks, sinks_stride, head);

    Index first = 0, count = token_valid ? num_states : 0;
    bool bad_indptr = false;
    if (indptr != nullptr && token_valid) {
      const RaggedRow row = ragged_row(indptr, indptr_bytes, indptr_stride, token, num_states);
      first = row.first;
      count = row.count;
      bad_indptr = row.bad;
    }
    const float* row_lse = lse + first * lse_stride_state + head * lse_stride_head + token * lse_stride_token;
    const InPack* column = reinterpret_cast<const InPack*>(v + first * v_stride_state + token * v_stride_token + head * v_stride_head);
    const Index chunk_step = static_cast<Index>(splits) * MERGE_CHUNK;

    for (Index pass = 0; pass < passes; ++pass) {
      const Index p = pass * blockDim.x + threadIdx.x;
      const bool has_pack = p < num_packs;
      Partial<VEC> part;
      part.reset();
      fold_row(part, row_lse, column + p, static_cast<Index>(split * MERGE_CHUNK), chunk_step, count, lse_stride_state,
               pack_stride_state, to_natural, has_pack);
      if constexpr (SPLIT) {
        // Uniform across the block: every thread reaches every barrier.
        combine_splits(part, shared_partials, split, splits, static_cast<int>(blockDim.x * blockDim.y),
                       static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x));
        __syncthreads();  // the slots are reused by the next pass
      }
      if (split != 0 || !token_valid) continue;
      if constexpr (SINKS) part.add_sink(sink);
      const bool broken = part.any_nan || bad_indptr;
      if (has_pack) {
        const float norm = part.norm(broken);
        OutPack merged;
#pragma unroll
        for (int k = 0; k < VEC; ++k) merged.v[k] = to_output<TOut>(part.acc[k] * norm, inverse_scale);
        store_pack(reinterpret_cast<OutPack*>(out + token * out_stride_token + head * out_stride_head) + p, merged);
      }
      if (out_lse != nullptr && pass == 0 && threadIdx.x == 0) {
        out_lse[head * out_lse_stride_head + token * out_lse_stride_token] = part.natural_lse(broken) * from_natural;
      }
    }
  }
}

}  // namespace cupy_merge

namespace cupy_merge {

// The lean variant, for the common layouts: v holds the heads of a token back
// to back (head stride = head_size) in rows that start on a pack, the output
// too, all offsets fit in 32 bits, and packs are 16 bytes. Thread x of the grid
// owns output pack x, numbered over (token, head, pack) with no gaps. One memory
// round trip a chunk of MERGE_CHUNK states (their LSEs and value packs together,
// fold_row), folded into a running maximum as in merge_many_states. (Session 4's
// two passes, the maxima first and then the values, took 1 register fewer but a
// round trip more a chunk, and measured 1-9 points of copy speed slower: session 6, run 2.)
//
// SPLIT: the block's y threads take every splits-th chunk of a row's states and
// combine their partial sums (combine_splits: many states, few rows).
// RAGGED: rows come from indptr (the dense instantiation never reads it).
// GROUPED: an FP8 or NVFP4 output with a scale per group of packs, as in
// merge_two_states_packed (the group maxima follow the partials in shared memory).
// Strides of v and out are in packs, of lse and group scales in elements. Dense
// and ragged as for merge_many_states (ragged: the token strides are 0).
//
// Parameter order: a parameter is read from the constant bank, and the first read of
// each 64-byte line misses the constant cache, the warp waiting out one miss after
// another (at one token, three misses before the first load took 175 of 1110 stall
// samples: benchmarks/PERF.md, session 8). So what a dense launch reads comes first, in
// 108 bytes: on Hopper parameters start at c[0x0][0x210], and these fill the rest of
// the line that also holds the memory descriptor (which the first load reads anyway)
// and the next line. The block's shape is among them (`block_packs` = blockDim.x,
// `block_splits` = blockDim.y): blockDim lives in yet another line. The FP8 scale, the
// ragged offsets and the group geometry follow.
template <typename TIn, typename TOut, int VEC, bool SPLIT, bool RAGGED, bool GROUPED, bool SINKS>
__global__ void merge_many_states_packed(
    const TIn* v, const float* lse,
    int num_states, int total_packs, int packs_per_token, unsigned token_multiplier, unsigned token_shift,
    unsigned head_multiplier, unsigned head_shift, int v_stride_state,
    TOut* out, float* out_lse,
    int v_stride_token, int lse_stride_state, int lse_stride_head, int lse_stride_token,
    int block_packs, int block_splits,
    int packs_per_row, int out_stride_token, int out_lse_stride_head, int out_lse_stride_token,
    int lse_base_2,
    const float* output_scale, const void* indptr, int indptr_bytes, int indptr_stride,
    void* output_block_scale, int block_scale_stride_token, int block_scale_stride_group,
    int packs_per_group, unsigned group_multiplier, unsigned group_shift, int scale_ue8m0,
    int block_scale_col_tiles, int block_scale_rows, int block_scale_padded_rows,
    const float* sinks, int sinks_stride) {
  using InPack = Pack<TIn, VEC>;
  using OutPack = OutputPack<TOut, VEC>;
  launch_dependents();
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  Partial<VEC>* shared_partials = reinterpret_cast<Partial<VEC>*>(shared_bytes);  // [splits - 1][block_packs]
  const int split = SPLIT ? threadIdx.y : 0, splits = SPLIT ? block_splits : 1;
  const float to_natural = lse_to_natural(lse_base_2);

  const int p = blockIdx.x * block_packs + threadIdx.x;
  const bool valid = p < total_packs;
  const PackPosition at =
      pack_position(p, valid, packs_per_token, token_multiplier, token_shift, head_multiplier, head_shift);
  const int token = at.token, within = at.within, head = at.head;
  wait_for_inputs();
  // Loaded now, used after the states: its round trip hides behind theirs.
  const float sink = valid && split == 0 ? sink_logit<SINKS>(sinks, sinks_stride, head) : negative_infinity();

  int first = 0, count = valid ? num_states : 0;
  bool bad_indptr = false;
  if constexpr (RAGGED) {
    if (valid) {
      const RaggedRow row = ragged_row(indptr, indptr_bytes, indptr_stride, token, num_states);
      first = static_cast<int>(row.first);  // within num_states, which fits in int here
      count = static_cast<int>(row.count);
      bad_indptr = row.bad;
    }
  }
  const float* row_lse = lse + first * lse_stride_state + head * lse_stride_head + token * lse_stride_token;
  const InPack* column = reinterpret_cast<const InPack*>(v) + first * v_stride_state + token * v_stride_token + within;

  Partial<VEC> part;
  part.reset();
  fold_row(part, row_lse, column, split * MERGE_CHUNK, splits * MERGE_CHUNK, count, lse_stride_state, v_stride_state,
           to_natural, true);
  if constexpr (SPLIT) {
    combine_splits(part, shared_partials, split, splits, block_packs, static_cast<int>(threadIdx.x));  // uniform
    if constexpr (!GROUPED) {
      if (split != 0) return;
    }
  }
  const bool writes = valid && split == 0;
  if constexpr (SINKS) part.add_sink(sink);
  const bool broken = part.any_nan || bad_indptr;
  const float norm = part.norm(broken);
  float merged[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) merged[k] = part.acc[k] * norm;
  float inverse_scale;
  if constexpr (GROUPED) {
    // Every thread reaches the group's barriers; only split 0's valid rows count.
    unsigned* group_max = reinterpret_cast<unsigned*>(shared_partials + (splits - 1) * block_packs);
    const BlockScales scales = {output_block_scale, block_scale_stride_token, block_scale_stride_group,
                                packs_per_group, group_multiplier, group_shift, scale_ue8m0,
                                block_scale_col_tiles, block_scale_rows, block_scale_padded_rows};
    if constexpr (kIsNvfp4<TOut>) {
      const Fp4Scale q =
          quantise_fp4_group(merged, scales, writes, writes, token, within, packs_per_token, output_scale);
      if (writes) zero_padding_rows(scales, p, total_packs);
      if (!writes) return;
      store_pack(reinterpret_cast<OutPack*>(out) + token * out_stride_token + within, fp4_pack(merged, q));
      inverse_scale = 0.0f;
    } else {
      inverse_scale = quantise_group(merged, scales, group_max, writes, split == 0, token, within);
      if (!writes) return;
    }
  } else {
    if (!writes) return;
    inverse_scale = output_inverse_scale<TOut>(output_scale);
  }
  if constexpr (!kIsNvfp4<TOut>) {
    store_pack(reinterpret_cast<OutPack*>(out) + token * out_stride_token + within,
               output_pack<TOut>(merged, inverse_scale));
  }
  if (out_lse != nullptr && within == head * packs_per_row) {
    out_lse[head * out_lse_stride_head + token * out_lse_stride_token] =
        part.natural_lse(broken) * lse_from_natural(lse_base_2);
  }
}

}  // namespace cupy_merge
