// The amax pass: per-row amax [M], per-column amax [K] and/or the tensor amax [1] of x [M, K], all from
// one read of x with coalesced 16-byte loads.
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

template <class InT>
__global__ void __launch_bounds__(kAmaxThreads) amax_kernel(const InT* __restrict__ x, int64_t x_row_stride,
                                                            int64_t rows, int64_t cols, float* row_amax,
                                                            float* col_amax, float* tensor_amax) {
  using E = Element<InT>;
  constexpr int kVec = E::kPerVector, kPerWord = 4 / sizeof(InT);
  constexpr int kTileCols = 32 * kVec, kRowsPerWarp = kAmaxTileRows / kAmaxWarps;
  __shared__ uint32_t col_partial[kAmaxWarps][kTileCols];
  __shared__ uint32_t warp_max[kAmaxWarps];
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
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) row_max = max(row_max, __shfl_xor_sync(0xFFFFFFFFu, row_max, offset));
      if (lane == 0 && row0 + r < rows)
        atomicMax(reinterpret_cast<unsigned int*>(row_amax + row0 + r), E::abs_bits_as_float_bits(row_max));
    }
  }
  if (col_amax != nullptr) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) col_partial[warp][lane * kVec + i] = word_element<InT>(col_max[i / kPerWord], i % kPerWord);
  }
  if (tensor_amax != nullptr) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) thread_max = max(thread_max, __shfl_xor_sync(0xFFFFFFFFu, thread_max, offset));
    if (lane == 0) warp_max[warp] = thread_max;
  }
  __syncthreads();
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

template <class InT>
int amax_can_implement(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax,
                       float* col_amax, float* tensor_amax) {
  constexpr int64_t kTileCols = 32 * Element<InT>::kPerVector;
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if (rows > 1 && x_row_stride < cols) return kInvalidProblem;
  if ((cols + kTileCols - 1) / kTileCols > 65535) return kInvalidProblem;  // gridDim.y
  if (row_amax == nullptr && col_amax == nullptr && tensor_amax == nullptr) return kInvalidProblem;
  if (!aligned(x, 16) || (rows > 1 && (x_row_stride * static_cast<int64_t>(sizeof(InT))) % 16 != 0))
    return kMisaligned;
  return kOk;
}

template <class InT>
int amax_run(const void* x, int64_t x_row_stride, int64_t rows, int64_t cols, float* row_amax, float* col_amax,
             float* tensor_amax, cudaStream_t stream) {
  const int status = amax_can_implement<InT>(x, x_row_stride, rows, cols, row_amax, col_amax, tensor_amax);
  if (status != kOk) return status;
  // atomicMax accumulates into the outputs, so they start at +0 (also the amax of an empty extent)
  const int64_t zero_blocks = std::min<int64_t>((rows + cols + kAmaxThreads) / kAmaxThreads, 1024);
  amax_zero_kernel<<<static_cast<unsigned>(zero_blocks), kAmaxThreads, 0, stream>>>(row_amax, rows, col_amax, cols,
                                                                                   tensor_amax);
  if (const int zeroed = launch_status(); zeroed != kOk || rows == 0 || cols == 0) return zeroed;
  // the zeroing's programmatic dependent (amax_kernel waits for it before its atomics)
  constexpr int64_t kTileCols = 32 * Element<InT>::kPerVector;
  const dim3 grid(static_cast<unsigned>((rows + kAmaxTileRows - 1) / kAmaxTileRows),
                  static_cast<unsigned>((cols + kTileCols - 1) / kTileCols));
  return launch_programmatic_dependent(amax_kernel<InT>, grid, dim3(kAmaxThreads), 0, stream,
                                       static_cast<const InT*>(x), x_row_stride, rows, cols, row_amax, col_amax,
                                       tensor_amax);
}

}  // namespace fp4gen
