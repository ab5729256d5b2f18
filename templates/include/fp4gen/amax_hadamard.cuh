// The amax pass before a quantization whose columnwise copy takes the random Hadamard transform: from one
// read of x [M, K], the amaxes of the rowwise copy (of x itself: per row, and/or of the tensor) and of the
// columnwise copy (of the transformed x.T, hadamard.cuh: per column, and/or of the tensor). NaN propagates,
// as in amax.cuh: maxima are taken on |v|'s fp32 bit patterns, where NaN > Inf > every finite value.
//
// A CTA reads a 64 x 64 tile into shared memory (widened to fp32); thread t takes 16 elements of tile row
// t / 4 and the 16-row group t / 64 of tile column t % 64, which it transforms.
//
// With tensor amaxes alone, the pass can also give the column sums of x (untransformed: a gradient's bias
// gradient) as amax.cuh does, in fp32 or x's dtype: partial sums of fixed slices of rows to the workspace, added in order by
// column_sum_reduce_kernel (amax_hadamard_tensor_sum_kernel below). Per-row or per-column amaxes with column
// sums are refused: no caller asks for them (fp4gen sums only tensor-scaled gradients).
#pragma once

#include <algorithm>

#include "fp4gen/abi.h"
#include "fp4gen/amax.cuh"  // column_sum_reduce_kernel
#include "fp4gen/elements.cuh"
#include "fp4gen/hadamard.cuh"
#include "fp4gen/quantize.cuh"  // load_streaming

namespace fp4gen {

constexpr int kHadamardAmaxTile = 64, kHadamardAmaxThreads = 256;

// |v|'s bits by clearing the sign bit: fabsf (abs.f32) may return another NaN than its input's.
__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// The NaN-propagating maximum over the CTA of each thread's `bits`, by thread 0 (shuffles, then warp maxima).
__device__ __forceinline__ uint32_t cta_max_bits(uint32_t bits, uint32_t* warp_max) {
  bits = warp_max_bits(bits);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  uint32_t m = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kHadamardAmaxThreads / 32; ++w) m = max(m, warp_max[w]);
  }
  return m;
}

template <class InT>
__global__ void __launch_bounds__(kHadamardAmaxThreads)
    amax_hadamard_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                         float* row_amax, float* col_amax, float* row_tensor_amax, float* col_tensor_amax) {
  __shared__ float tile[kHadamardAmaxTile][kHadamardAmaxTile + 1];
  __shared__ uint32_t col_partial[kHadamardAmaxThreads / kHadamardAmaxTile][kHadamardAmaxTile];
  __shared__ uint32_t warp_max[2][kHadamardAmaxThreads / 32];
  const int64_t row0 = int64_t{blockIdx.x} * kHadamardAmaxTile, col0 = int64_t{blockIdx.y} * kHadamardAmaxTile;
  stage_tile_fp32<InT, kHadamardAmaxTile, kHadamardAmaxThreads>(x, x_row_stride, rows, cols, row0, col0, tile);
  __syncthreads();  // (zeros outside the tensor change no maximum)
  // rows, untransformed: four threads a row
  const int r = threadIdx.x / 4, part = threadIdx.x % 4;
  uint32_t row_bits = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) row_bits = max(row_bits, abs_bits(tile[r][16 * part + k]));
  row_bits = max(row_bits, __shfl_xor_sync(0xFFFFFFFFu, row_bits, 1));
  row_bits = max(row_bits, __shfl_xor_sync(0xFFFFFFFFu, row_bits, 2));
  if (row_amax != nullptr && part == 0 && row0 + r < rows)
    atomicMax(reinterpret_cast<unsigned int*>(row_amax + row0 + r), row_bits);
  // columns, transformed: one 16-row group of one column a thread
  const int c = threadIdx.x % kHadamardAmaxTile, g = threadIdx.x / kHadamardAmaxTile;
  float v[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) v[k] = tile[16 * g + k][c];
  hadamard16_to_bf16<InT>(v);
  uint32_t col_bits = 0;
#pragma unroll
  for (int k = 0; k < 16; ++k) col_bits = max(col_bits, abs_bits(v[k]));
  col_partial[g][c] = col_bits;
  __syncthreads();
  if (col_amax != nullptr && threadIdx.x < kHadamardAmaxTile && col0 + threadIdx.x < cols) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < kHadamardAmaxThreads / kHadamardAmaxTile; ++i) m = max(m, col_partial[i][threadIdx.x]);
    atomicMax(reinterpret_cast<unsigned int*>(col_amax + col0 + threadIdx.x), m);
  }
  if (row_tensor_amax != nullptr) {
    const uint32_t m = cta_max_bits(row_bits, warp_max[0]);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(row_tensor_amax), m);
  }
  if (col_tensor_amax != nullptr) {
    const uint32_t m = cta_max_bits(col_bits, warp_max[1]);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(col_tensor_amax), m);
  }
}

// Tensor amaxes only (the per-tensor quantization of a gradient): no per-row or per-column output, so no
// tile needs sharing, and a thread takes a patch of 16 rows x one 16-byte vector straight into registers
// (as quantize.cuh's lanes do), transforms its columns in place (hadamard_patch) and keeps two maxima. On
// 8192 x 8192 bf16 on the H200 it took 37 us where the tiled kernel above took 75 (bench/RESULTS.md, d03c121).
constexpr int kTensorAmaxThreads = 256;

// A loaded patch's maxima, into the thread's running ones: of |x| (raw_bits) and, after transforming the patch in
// place, of the transformed values (transformed_bits); with kColumnSums, its columns added to `sum` row by row
// first (beside the maxima: in a loop of their own the sum kernel spilled twice as much).
template <class InT, bool kColumnSums = false>
__device__ __forceinline__ void take_patch_maxima(uint4 (&patch)[16], uint32_t& raw_bits, uint32_t& transformed_bits,
                                                  float* sum = nullptr) {
  using E = Element<InT>;
  uint32_t m = 0u;  // NaN-propagating |x| maximum, packed like the input
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    m = vector_abs_max<InT>(m, patch[i]);
    if constexpr (kColumnSums) {
#pragma unroll
      for (int e = 0; e < E::kPerVector; ++e) sum[e] += E::word_element_to_float(&patch[i].x, e);
    }
  }
  raw_bits = max(raw_bits, E::abs_bits_as_float_bits(word_element<InT>(m, 0)));
  if constexpr (sizeof(InT) == 2) raw_bits = max(raw_bits, E::abs_bits_as_float_bits(word_element<InT>(m, 1)));
  hadamard_patch<InT>(patch);
  transformed_bits = max(transformed_bits, transformed_patch_abs_max_bits<InT>(patch));
}

template <class InT>
__global__ void __launch_bounds__(kTensorAmaxThreads)
    amax_hadamard_tensor_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                                float* row_tensor_amax, float* col_tensor_amax) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector;
  __shared__ uint32_t warp_max[2][kTensorAmaxThreads / 32];
  const int64_t vectors = cols / kVec, patches = rows / 16 * vectors;  // cols % 16 == 0, rows % 16 == 0
  uint32_t raw_bits = 0u, transformed_bits = 0u;
  for (int64_t p = int64_t{blockIdx.x} * kTensorAmaxThreads + threadIdx.x; p < patches;
       p += int64_t{gridDim.x} * kTensorAmaxThreads) {
    const InT* src = x + p / vectors * 16 * x_row_stride + p % vectors * kVec;  // consecutive threads: along a row
    uint4 patch[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) patch[i] = load_streaming<false>(src + i * x_row_stride);
    take_patch_maxima<InT>(patch, raw_bits, transformed_bits);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {  // both maxima side by side (warp_max_bits twice compiles otherwise)
    raw_bits = max(raw_bits, __shfl_xor_sync(0xFFFFFFFFu, raw_bits, offset));
    transformed_bits = max(transformed_bits, __shfl_xor_sync(0xFFFFFFFFu, transformed_bits, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[0][threadIdx.x / 32] = raw_bits, warp_max[1][threadIdx.x / 32] = transformed_bits;
  __syncthreads();
  if (threadIdx.x < 2) {
    uint32_t m = 0u;
#pragma unroll
    for (int w = 0; w < kTensorAmaxThreads / 32; ++w) m = max(m, warp_max[threadIdx.x][w]);
    float* out = threadIdx.x == 0 ? row_tensor_amax : col_tensor_amax;
    if (out != nullptr) atomicMax(reinterpret_cast<unsigned int*>(out), m);
  }
}

// With column sums (a gradient's bias gradient as well): a CTA takes 32 vectors of each row (a vector block)
// and its warps chains of 16-row groups: warp w of chain group cg takes groups cg * 8 + w, then every
// `chains` = 8 * chain groups further on, summing its columns in row order; the CTA then adds its warps' sums
// in warp order, one partial a chain group (tensor_amax_sum_chain_groups: a function of the shape alone).
// Two CTAs a multiprocessor, as above (a few registers spill).
constexpr int kTensorAmaxWarps = kTensorAmaxThreads / 32;
constexpr int64_t kTensorAmaxSumCtas = 1024;  // about 8 CTAs a multiprocessor of an H200

template <class InT>
__host__ __device__ int64_t tensor_amax_vector_blocks(int64_t cols) {
  return (cols / Element<InT>::kPerVector + 31) / 32;
}
template <class InT>
int64_t tensor_amax_sum_chain_groups(int64_t rows, int64_t cols) {
  const int64_t by_rows = (rows / 16 + kTensorAmaxWarps - 1) / kTensorAmaxWarps;
  return std::max<int64_t>(1, std::min(by_rows, kTensorAmaxSumCtas / tensor_amax_vector_blocks<InT>(cols)));
}

template <class InT>
__global__ void __launch_bounds__(kTensorAmaxThreads, 2)
    amax_hadamard_tensor_sum_kernel(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows, int64_t cols,
                                    float* row_tensor_amax, float* col_tensor_amax, float* __restrict__ col_sum_partials) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector;
  __shared__ uint32_t warp_max[2][kTensorAmaxWarps];
  __shared__ float col_sum_stage[kTensorAmaxWarps][32 * kVec];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t vectors = cols / kVec, groups = rows / 16;  // cols % 16 == 0, rows % 16 == 0
  const int64_t vector_blocks = tensor_amax_vector_blocks<InT>(cols);
  const int64_t chain_group = blockIdx.x / vector_blocks, chains = gridDim.x / vector_blocks * kTensorAmaxWarps;
  const int64_t vector = blockIdx.x % vector_blocks * 32 + lane;
  uint32_t raw_bits = 0u, transformed_bits = 0u;
  float sum[kVec] = {};
  for (int64_t g = chain_group * kTensorAmaxWarps + warp; vector < vectors && g < groups; g += chains) {
    const InT* src = x + g * 16 * x_row_stride + vector * kVec;
    uint4 patch[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) patch[i] = load_streaming<false>(src + i * x_row_stride);
    take_patch_maxima<InT, true>(patch, raw_bits, transformed_bits, sum);
  }
#pragma unroll
  for (int e = 0; e < kVec; ++e) col_sum_stage[warp][lane * kVec + e] = sum[e];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {  // both maxima side by side (warp_max_bits twice compiles otherwise)
    raw_bits = max(raw_bits, __shfl_xor_sync(0xFFFFFFFFu, raw_bits, offset));
    transformed_bits = max(transformed_bits, __shfl_xor_sync(0xFFFFFFFFu, transformed_bits, offset));
  }
  if (lane == 0) warp_max[0][warp] = raw_bits, warp_max[1][warp] = transformed_bits;
  __syncthreads();
  const int64_t col0 = blockIdx.x % vector_blocks * 32 * kVec;
  for (int c = threadIdx.x; c < 32 * kVec && col0 + c < cols; c += kTensorAmaxThreads) {
    float total = col_sum_stage[0][c];
#pragma unroll
    for (int w = 1; w < kTensorAmaxWarps; ++w) total += col_sum_stage[w][c];
    col_sum_partials[chain_group * cols + col0 + c] = total;
  }
  if (threadIdx.x < 2) {
    uint32_t m = 0u;
#pragma unroll
    for (int w = 0; w < kTensorAmaxWarps; ++w) m = max(m, warp_max[threadIdx.x][w]);
    float* out = threadIdx.x == 0 ? row_tensor_amax : col_tensor_amax;
    if (out != nullptr) atomicMax(reinterpret_cast<unsigned int*>(out), m);
  }
}

// The column sums' workspace: one partial a column for each chain group of the tensor kernel.
template <class InT>
size_t amax_hadamard_workspace_size(const void*, int64_t, int64_t rows, int64_t cols, float* row_amax,
                                    float* col_amax, float*, float*, void* col_sum, int64_t, void*) {
  if (col_sum == nullptr || row_amax != nullptr || col_amax != nullptr || rows <= 0 || cols <= 0) return 0;
  return static_cast<size_t>(tensor_amax_sum_chain_groups<InT>(rows, cols) * cols) * sizeof(float);
}

template <class InT>
int amax_hadamard_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                                float* col_amax, float* row_tensor_amax, float* col_tensor_amax, void* col_sum,
                                int64_t col_sum_in_x_dtype, void* workspace) {
  if (rows < 0 || cols < 0 || cols % 16 != 0 || rows % 16 != 0) return kInvalidProblem;  // 16-row groups
  if (col_sum != nullptr && (row_amax != nullptr || col_amax != nullptr)) return kInvalidProblem;  // tensor only
  if (col_sum != nullptr && rows > 0 && cols > 0 && workspace == nullptr) return kInvalidProblem;
  if (const int sums = column_sum_can_implement<InT>(col_sum, col_sum_in_x_dtype); sums != kOk) return sums;
  if (!aligned(workspace, 4)) return kMisaligned;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if ((cols + kHadamardAmaxTile - 1) / kHadamardAmaxTile > 65535) return kInvalidProblem;  // gridDim.y
  if (row_amax == nullptr && col_amax == nullptr && row_tensor_amax == nullptr && col_tensor_amax == nullptr)
    return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  return kOk;
}

template <class InT>
int amax_hadamard_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                      float* col_amax, float* row_tensor_amax, float* col_tensor_amax, void* col_sum,
                      int64_t col_sum_in_x_dtype, void* workspace, cudaStream_t stream) {
  const int status = amax_hadamard_can_implement<InT>(x, x_row_stride, rows, cols, row_amax, col_amax,
                                                      row_tensor_amax, col_tensor_amax, col_sum, col_sum_in_x_dtype,
                                                      workspace);
  if (status != kOk) return status;
  // atomicMax accumulates into the outputs, so they start at +0 (also the amax of an empty extent)
  const struct { float* ptr; int64_t count; } outputs[] = {
      {row_amax, rows}, {col_amax, cols}, {row_tensor_amax, 1}, {col_tensor_amax, 1}};
  for (const auto& out : outputs) {
    if (out.ptr == nullptr || out.count == 0) continue;
    const cudaError_t err = cudaMemsetAsync(out.ptr, 0, out.count * sizeof(float), stream);
    if (err != cudaSuccess) return kCudaErrorBase + static_cast<int>(err);
  }
  if (rows == 0 || cols == 0) {
    if (col_sum == nullptr) return kOk;
    return launch_column_sum_reduce<InT>(nullptr, 0, cols, col_sum, col_sum_in_x_dtype, stream);
  }
  float* partials = col_sum != nullptr ? static_cast<float*>(workspace) : nullptr;  // (tensor amaxes only)
  if (row_amax == nullptr && col_amax == nullptr) {
    const int64_t patches = rows / 16 * (cols / Element<InT>::kPerVector);
    const int64_t grid = partials != nullptr
                             ? tensor_amax_sum_chain_groups<InT>(rows, cols) * tensor_amax_vector_blocks<InT>(cols)
                             : std::min<int64_t>((patches + kTensorAmaxThreads - 1) / kTensorAmaxThreads, int64_t{1} << 20);
    if (partials != nullptr) {
      amax_hadamard_tensor_sum_kernel<InT><<<static_cast<unsigned>(grid), kTensorAmaxThreads, 0, stream>>>(
          static_cast<const InT*>(x), x_row_stride, rows, cols, row_tensor_amax, col_tensor_amax, partials);
    } else {
      amax_hadamard_tensor_kernel<InT><<<static_cast<unsigned>(grid), kTensorAmaxThreads, 0, stream>>>(
          static_cast<const InT*>(x), x_row_stride, rows, cols, row_tensor_amax, col_tensor_amax);
    }
  } else {
    const dim3 grid(static_cast<unsigned>((rows + kHadamardAmaxTile - 1) / kHadamardAmaxTile),
                    static_cast<unsigned>((cols + kHadamardAmaxTile - 1) / kHadamardAmaxTile));
    amax_hadamard_kernel<InT><<<grid, kHadamardAmaxThreads, 0, stream>>>(static_cast<const InT*>(x), x_row_stride,
                                                                         rows, cols, row_amax, col_amax,
                                                                         row_tensor_amax, col_tensor_amax);
  }
  const int launched = launch_status();
  if (launched != kOk || partials == nullptr) return launched;
  return launch_column_sum_reduce<InT>(partials, tensor_amax_sum_chain_groups<InT>(rows, cols), cols, col_sum,
                                       col_sum_in_x_dtype, stream);
}

}  // namespace fp4gen
