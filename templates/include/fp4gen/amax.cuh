// The amax pass: per-row amax [M], per-column amax [K] and/or the tensor amax [1] of x [M, K], all from
// one read of x with coalesced 16-byte loads; and, when asked, the column sums [K] of x, summed in fp32 and
// written in fp32 or x's dtype (a gradient's bias gradient, from the read the gradient's quantization makes anyway).
//
// fp4gen's amaxes propagate NaN (unlike upstream: docs/numerics.md, deliberate differences). Maxima are
// taken on |x|'s bit patterns as unsigned integers, where NaN > Inf > every finite value, so the ordinary
// integer max (and atomicMax across CTAs) propagates NaN with no extra test. Indices are 64-bit.
#pragma once

#include <algorithm>

#include "fp4gen/abi.h"
#include "fp4gen/elements.cuh"

namespace fp4gen {

constexpr int kAmaxTileRows = 64, kAmaxThreads = 256, kAmaxWarps = kAmaxThreads / 32;

// Zeroes the amax outputs, into which the amax pass accumulates with atomicMax. The amax pass is launched
// as this grid's programmatic dependent: it reads its input while this runs and waits for it only before
// its first atomic (one small kernel instead of a memset per output, and no gap before the amax pass).
__global__ void __launch_bounds__(kAmaxThreads) amax_zero_kernel(float* row_amax, int64_t rows, float* col_amax,
                                                                 int64_t cols, float* tensor_amax) {
  asm volatile("griddepcontrol.launch_dependents;");
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < rows + cols + 1; i += stride) {
    float* out = i < rows ? (row_amax ? row_amax + i : nullptr)
                          : i < rows + cols ? (col_amax ? col_amax + (i - rows) : nullptr) : tensor_amax;
    if (out != nullptr) *out = 0.0f;
  }
}

// Column sums: an amax pass writes one fp32 partial sum per column for each of `parts` slices of the rows (each
// slice summed in a fixed order) to the workspace, [parts][cols], and this kernel adds the slices of a column in
// order, in kSumSegments runs of consecutive slices whose sums are then added in order: the result depends on
// the shape alone, never on timing, so repeated calls give the same bits. A programmatic dependent of the amax
// pass (whose partials it waits for) and the quantize kernel's programmatic predecessor.
constexpr int kSumColumns = 32, kSumSegments = 8;

// A column sum as col_sum holds it: fp32, or rounded once from its fp32 value to x's dtype (to nearest even, by
// the conversion instruction that torch's CUDA conversions use: the same bits, NaN's included, as the fp32 sums
// converted afterwards), so that a bias gradient comes out in the bias's dtype without another launch.
__device__ __forceinline__ void store_sum(float* out, float sum) { *out = sum; }
__device__ __forceinline__ void store_sum(__half* out, float sum) { *out = __float2half_rn(sum); }
__device__ __forceinline__ void store_sum(__nv_bfloat16* out, float sum) { *out = __float2bfloat16_rn(sum); }

template <class SumT>
__global__ void __launch_bounds__(kSumColumns * kSumSegments)
    column_sum_reduce_kernel(const float* __restrict__ partials, int64_t parts, int64_t cols, SumT* col_sum) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  __shared__ float segment_sum[kSumSegments][kSumColumns];
  const int c = threadIdx.x % kSumColumns, segment = threadIdx.x / kSumColumns;
  const int64_t col = int64_t{blockIdx.x} * kSumColumns + c;
  const int64_t per_segment = (parts + kSumSegments - 1) / kSumSegments;
  const int64_t first = segment * per_segment, end = std::min(parts, first + per_segment);
  float sum = 0.0f;
  if (col < cols) {
#pragma unroll 8
    for (int64_t p = first; p < end; ++p) sum += partials[p * cols + col];
  }
  segment_sum[segment][c] = sum;
  __syncthreads();
  if (segment == 0 && col < cols) {
#pragma unroll
    for (int i = 1; i < kSumSegments; ++i) sum += segment_sum[i][c];
    store_sum(col_sum + col, sum);
  }
}

// col_sum_in_x_dtype (a run-time argument of the amax families, 0 or 1): whether col_sum holds x's dtype (1) or
// fp32 (0). The element size and alignment col_sum needs for it.
template <class InT>
constexpr size_t column_sum_bytes(int64_t col_sum_in_x_dtype) {
  return col_sum_in_x_dtype ? sizeof(InT) : sizeof(float);
}

// Whether col_sum and the flag are valid: kOk, kInvalidProblem (a flag other than 0 or 1) or kMisaligned.
template <class InT>
int column_sum_can_implement(const void* col_sum, int64_t col_sum_in_x_dtype) {
  if (col_sum_in_x_dtype != 0 && col_sum_in_x_dtype != 1) return kInvalidProblem;
  return aligned(col_sum, column_sum_bytes<InT>(col_sum_in_x_dtype)) ? kOk : kMisaligned;
}

// Launches column_sum_reduce_kernel as the programmatic dependent of the amax pass just launched; an empty x's
// sums are zeros.
template <class InT>
int launch_column_sum_reduce(const float* partials, int64_t parts, int64_t cols, void* col_sum,
                             int64_t col_sum_in_x_dtype, cudaStream_t stream) {
  if (cols == 0) return kOk;
  if (parts == 0) {
    const cudaError_t err = cudaMemsetAsync(col_sum, 0, cols * column_sum_bytes<InT>(col_sum_in_x_dtype), stream);
    return err == cudaSuccess ? kOk : kCudaErrorBase + static_cast<int>(err);
  }
  const dim3 grid(static_cast<unsigned>((cols + kSumColumns - 1) / kSumColumns)), block(kSumColumns * kSumSegments);
  if (col_sum_in_x_dtype) {
    return launch_programmatic_dependent(column_sum_reduce_kernel<InT>, grid, block, 0, stream, partials, parts, cols,
                                         static_cast<InT*>(col_sum));
  }
  return launch_programmatic_dependent(column_sum_reduce_kernel<float>, grid, block, 0, stream, partials, parts, cols,
                                       static_cast<float*>(col_sum));
}

// kColumnSums: a variant of its own, so that the amaxes alone keep their registers (48 against 59 on sm_90a).
template <class InT, bool kColumnSums>
__global__ void __launch_bounds__(kAmaxThreads) amax_kernel(const InT* __restrict__ x, int64_t x_row_stride,
                                                            int64_t rows, int64_t cols, float* row_amax,
                                                            float* col_amax, float* tensor_amax,
                                                            float* __restrict__ col_sum_partials) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector, kPerWord = 4 / sizeof(InT);
  constexpr int kTileCols = 32 * kVec, kRowsPerWarp = kAmaxTileRows / kAmaxWarps;
  __shared__ uint32_t col_partial[kAmaxWarps][kTileCols];
  __shared__ uint32_t warp_max[kAmaxWarps];
  __shared__ float col_sum_stage[kColumnSums ? kAmaxWarps : 1][kColumnSums ? kTileCols : 1];  // the warps' column sums
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kAmaxTileRows + warp * kRowsPerWarp;
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kTileCols + lane * kVec;
  const bool col_ok = col < cols;

  uint4 vec[kRowsPerWarp];  // all loads in flight before any use
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = row0 + r;
    vec[r] = (col_ok && row < rows) ? *reinterpret_cast<const uint4*>(x + row * x_row_stride + col)
                                    : make_uint4(0, 0, 0, 0);
  }
  // The outputs are zeroed by amax_zero_kernel, which may still be running (see there): wait for it before
  // the first atomic; the loads above are already in flight.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  uint32_t col_max[4] = {0u, 0u, 0u, 0u};  // packed per word, like the input
  uint32_t thread_max = 0;                 // element |x| bits
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&vec[r]);
    uint32_t packed_row_max = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      col_max[w] = word_abs_max<InT>(col_max[w], words[w]);
      packed_row_max = word_abs_max<InT>(packed_row_max, words[w]);
    }
    uint32_t row_max = word_element<InT>(packed_row_max, 0);
    if constexpr (kPerWord == 2) row_max = max(row_max, word_element<InT>(packed_row_max, 1));
    thread_max = max(thread_max, row_max);
    if (row_amax != nullptr) {
      row_max = warp_max_bits(row_max);
      if (lane == 0 && row0 + r < rows)
        atomicMax(reinterpret_cast<unsigned int*>(row_amax + row0 + r), E::abs_bits_as_float_bits(row_max));
    }
  }
  if (col_amax != nullptr) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) col_partial[warp][lane * kVec + i] = word_element<InT>(col_max[i / kPerWord], i % kPerWord);
  }
  if (tensor_amax != nullptr) {
    thread_max = warp_max_bits(thread_max);
    if (lane == 0) warp_max[warp] = thread_max;
  }
  if constexpr (kColumnSums) {  // the lane's columns over the warp's rows, in row order (zeros outside x)
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) sum += E::word_element_to_float(reinterpret_cast<const uint32_t*>(&vec[r]), i);
      col_sum_stage[warp][lane * kVec + i] = sum;
    }
  }
  __syncthreads();
  if constexpr (kColumnSums) {  // the CTA's slice of rows: the warps' sums in warp order
    for (int c = threadIdx.x; c < kTileCols; c += kAmaxThreads) {
      const int64_t gcol = static_cast<int64_t>(blockIdx.y) * kTileCols + c;
      if (gcol >= cols) break;
      float sum = col_sum_stage[0][c];
#pragma unroll
      for (int w = 1; w < kAmaxWarps; ++w) sum += col_sum_stage[w][c];
      col_sum_partials[static_cast<int64_t>(blockIdx.x) * cols + gcol] = sum;
    }
  }
  if (col_amax != nullptr) {
    for (int c = threadIdx.x; c < kTileCols; c += kAmaxThreads) {
      const int64_t gcol = static_cast<int64_t>(blockIdx.y) * kTileCols + c;
      if (gcol >= cols) break;
      uint32_t m = 0;
#pragma unroll
      for (int w = 0; w < kAmaxWarps; ++w) m = max(m, col_partial[w][c]);
      atomicMax(reinterpret_cast<unsigned int*>(col_amax + gcol), E::abs_bits_as_float_bits(m));
    }
  }
  if (tensor_amax != nullptr && threadIdx.x == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kAmaxWarps; ++w) m = max(m, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned int*>(tensor_amax), E::abs_bits_as_float_bits(m));
  }
  // The quantize pass, this grid's programmatic dependent, may be launched once every CTA got here (it
  // still waits for this whole grid before it reads the amaxes): its launch overlaps this grid's last
  // CTAs. Triggered at the end, not earlier, so that its CTAs do not take SMs from this grid's later waves.
  asm volatile("griddepcontrol.launch_dependents;");
}

// The column sums' slices of rows: one a CTA row of the grid.
inline int64_t amax_sum_parts(int64_t rows) { return (rows + kAmaxTileRows - 1) / kAmaxTileRows; }

template <class InT>
size_t amax_workspace_size(const void*, int64_t, int64_t rows, int64_t cols, float*, float*, float*, void* col_sum,
                           int64_t, void*) {
  return col_sum == nullptr || rows <= 0 || cols <= 0 ? 0 : static_cast<size_t>(amax_sum_parts(rows) * cols) * sizeof(float);
}

template <class InT>
int amax_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                       float* col_amax, float* tensor_amax, void* col_sum, int64_t col_sum_in_x_dtype,
                       void* workspace) {
  constexpr int64_t kTileCols = 32 * Element<InT>::kPerVector;
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if (col_sum != nullptr && rows > 0 && cols > 0 && workspace == nullptr) return kInvalidProblem;
  if (const int sums = column_sum_can_implement<InT>(col_sum, col_sum_in_x_dtype); sums != kOk) return sums;
  if (!aligned(workspace, 4)) return kMisaligned;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if ((cols + kTileCols - 1) / kTileCols > 65535) return kInvalidProblem;  // gridDim.y
  if (row_amax == nullptr && col_amax == nullptr && tensor_amax == nullptr) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  return kOk;
}

template <class InT>
int amax_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax, float* col_amax,
             float* tensor_amax, void* col_sum, int64_t col_sum_in_x_dtype, void* workspace, cudaStream_t stream) {
  const int status = amax_can_implement<InT>(x, x_row_stride, rows, cols, row_amax, col_amax, tensor_amax, col_sum,
                                             col_sum_in_x_dtype, workspace);
  if (status != kOk) return status;
  // atomicMax accumulates into the outputs, so they start at +0 (also the amax of an empty extent)
  const int64_t zero_blocks = std::min<int64_t>((rows + cols + kAmaxThreads) / kAmaxThreads, 1024);
  amax_zero_kernel<<<static_cast<unsigned>(zero_blocks), kAmaxThreads, 0, stream>>>(row_amax, rows, col_amax, cols,
                                                                                   tensor_amax);
  if (const int zeroed = launch_status(); zeroed != kOk || rows == 0 || cols == 0) {
    if (zeroed != kOk || col_sum == nullptr) return zeroed;
    return launch_column_sum_reduce<InT>(nullptr, 0, cols, col_sum, col_sum_in_x_dtype, stream);
  }
  // the zeroing's programmatic dependent (amax_kernel waits for it before its atomics)
  constexpr int64_t kTileCols = 32 * Element<InT>::kPerVector;
  const dim3 grid(static_cast<unsigned>(amax_sum_parts(rows)), static_cast<unsigned>((cols + kTileCols - 1) / kTileCols));
  float* partials = col_sum != nullptr ? static_cast<float*>(workspace) : nullptr;
  const auto kernel = partials != nullptr ? amax_kernel<InT, true> : amax_kernel<InT, false>;
  const int launched = launch_programmatic_dependent(kernel, grid, dim3(kAmaxThreads), 0, stream,
                                                     static_cast<const InT*>(x), x_row_stride, rows, cols, row_amax,
                                                     col_amax, tensor_amax, partials);
  if (launched != kOk || col_sum == nullptr) return launched;
  return launch_column_sum_reduce<InT>(partials, amax_sum_parts(rows), cols, col_sum, col_sum_in_x_dtype, stream);
}

}  // namespace fp4gen
