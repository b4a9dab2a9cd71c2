// A ragged batch's offsets as the kernels read them: token t owns rows indptr[t] .. indptr[t+1]-1.
#pragma once

namespace cupy_merge {

// The most states a token merges: float32 sums of more drift out of the inputs' range
// (a sum of 2^16 equal terms is off by up to 7e-4 of its value; the host refuses more,
// cupy_merge/_catalogue.py MAX_STATES_PER_TOKEN).
constexpr long long kMaxStatesPerToken = 65536;

// A ragged token's rows [first, first + count) from indptr (int32 or int64 entries).
// Read and checked at full width, so a huge offset cannot wrap into range;
// out-of-range offsets (negative, decreasing, past num_states, more than kMaxStatesPerToken
// rows) give no rows and `bad`.
struct RaggedRow {
  long long first, count;
  bool bad;
};

// Entry i of indptr, read at its own width.
__device__ __forceinline__ long long indptr_entry(const void* indptr, long long indptr_bytes, long long indptr_stride,
                                                  long long i) {
  return indptr_bytes == 8 ? static_cast<const long long*>(indptr)[i * indptr_stride]
                           : static_cast<const int*>(indptr)[i * indptr_stride];
}

__device__ __forceinline__ RaggedRow ragged_row(const void* indptr, long long indptr_bytes, long long indptr_stride,
                                                long long token, long long num_states) {
  const long long begin = indptr_entry(indptr, indptr_bytes, indptr_stride, token);
  const long long end = indptr_entry(indptr, indptr_bytes, indptr_stride, token + 1);
  const bool bad = begin < 0 || end < begin || end > num_states || end - begin > kMaxStatesPerToken;
  return {bad ? 0 : begin, bad ? 0 : end - begin, bad};
}

}  // namespace cupy_merge
