// NVFP4 dequantization (docs/numerics.md): out = OutT(fl(e2m1 * fl(fl(sdec * amax) * fl(1/2688)))), upstream's
// order; fl(1/2688) is the run-time argument inverse_decode_numerator = fl(1 / (6 * e4m3_max)), fl(1/1536) for
// a 4over6 operand. Where fl(sdec * amax) overflows for a finite amax, that order gives inf although the true value (at
// most amax) is finite, so such a block takes the factor in the other order, fl(fl(amax * fl(1/2688)) * sdec),
// which stays finite (docs/numerics.md, deliberate differences), as the reference backend does. With a null
// amax it writes the block-scaled values e2m1 * sdec (the GEMM's operands) instead.
//
// Each thread decodes the elements of one 16-byte output vector (8 for 16-bit outputs, 4 for fp32), so
// consecutive threads write consecutive 16-byte vectors: fully coalesced stores, which dominate the
// traffic. Indices are 64-bit so tensors of 2^31 elements and more work.
#pragma once

#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4gen/abi.h"
#include "fp4gen/nvfp4.cuh"

namespace fp4gen {

template <class OutT>
constexpr int kElemsPerThread = 16 / static_cast<int>(sizeof(OutT));

// The packed codes of kElemsPerThread elements: 4 bytes for 8 elements, 2 bytes for 4.
template <class OutT>
using CodeWord = std::conditional_t<kElemsPerThread<OutT> == 8, uint32_t, uint16_t>;

// The value of code i (nibble i, element i) of `codes`, exactly: its magnitude bits placed at fp32 bits
// 22-24 and its sign at bit 31 make an fp32 equal to e2m1 * 2^-126 (the e2m1 exponent lands in the fp32
// exponent's low bits, its subnormal 0.5 in fp32's subnormal range), and multiplying by 2^-126's inverse is
// exact. A few integer operations and one multiplication, where decoding the fields took about ten.
__device__ __forceinline__ float e2m1_code_value(uint32_t codes, int i) {
  const uint32_t code = codes >> (4 * i);
  return __fmul_rn(__uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)), 0x1p126f);
}

template <class OutT>
__device__ __forceinline__ uint4 convert_vector(const float (&v)[kElemsPerThread<OutT>]) {
  uint4 packed;
  uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
  if constexpr (std::is_same_v<OutT, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) words[i] = __float_as_uint(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // round to nearest even, element 2i in the low half
      if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      } else {
        const __half2 pair = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    }
  }
  return packed;
}

// Grid: y walks 16-byte output vectors along a row, x walks rows. Each thread decodes kRowsPerIter rows
// per iteration with all loads issued before any use (memory-level parallelism), and the grid is sized to
// a couple of waves so threads loop instead of launching one short-lived CTA per few bytes.
constexpr int kRowsPerIter = 4;

template <class OutT>
__global__ void dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                  const float* __restrict__ amax, OutT* __restrict__ out, int64_t rows,
                                  int64_t cols, int64_t data_row_stride, int64_t scale_row_stride,
                                  int64_t amax_stride, int64_t out_row_stride, float inverse_decode_numerator) {
  constexpr int kElems = kElemsPerThread<OutT>;
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kElems;
  if (col >= cols) return;
  const int64_t row_step = blockDim.y, iter_step = static_cast<int64_t>(gridDim.x) * blockDim.y * kRowsPerIter;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y * kRowsPerIter + threadIdx.y; first < rows;
       first += iter_step) {
    uint32_t codes[kRowsPerIter];
    float sdec[kRowsPerIter], row_amax[kRowsPerIter];
#pragma unroll
    for (int r = 0; r < kRowsPerIter; ++r) {
      const int64_t row = first + r * row_step;
      if (row < rows) {
        codes[r] = *reinterpret_cast<const CodeWord<OutT>*>(data + row * data_row_stride + col / 2);
        sdec[r] = e4m3_to_float(scale[row * scale_row_stride + col / 16]);
        row_amax[r] = amax != nullptr ? amax[row * amax_stride] : 1.0f;
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerIter; ++r) {
      const int64_t row = first + r * row_step;
      if (row >= rows) break;
      // without an amax (GEMM operands) the factor is the block scale alone: e2m1 * sdec is exact in bf16
      float factor = sdec[r];
      if (amax != nullptr) {
        const float scaled_amax = __fmul_rn(sdec[r], row_amax[r]);
        factor = isinf(scaled_amax) && isfinite(row_amax[r])  // amax within a factor 448 of FLT_MAX
                     ? __fmul_rn(__fmul_rn(row_amax[r], inverse_decode_numerator), sdec[r])
                     : __fmul_rn(scaled_amax, inverse_decode_numerator);
      }
      float v[kElems];
#pragma unroll
      for (int i = 0; i < kElems; ++i)  // element 2j is the low nibble of byte j
        v[i] = __fmul_rn(e2m1_code_value(codes[r], i), factor);
      *reinterpret_cast<uint4*>(out + row * out_row_stride + col) = convert_vector<OutT>(v);
    }
  }
}

template <class OutT>
int dequantize_can_implement(const uint8_t* data, const uint8_t* scale, const float* amax, void* out,
                             int64_t rows, int64_t cols, int64_t data_row_stride, int64_t scale_row_stride,
                             int64_t amax_stride, int64_t out_row_stride, float inverse_decode_numerator) {
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if (amax_stride != 0 && amax_stride != 1) return kInvalidProblem;
  if (cols / kElemsPerThread<OutT> > int64_t(65535) * 256) return kInvalidProblem;  // gridDim.y covers a row
  if (rows > 1 && (data_row_stride < cols / 2 || scale_row_stride < cols / 16 || out_row_stride < cols))
    return kInvalidProblem;
  if (!aligned(data, 4) || data_row_stride % 4 != 0) return kMisaligned;
  if (!aligned(out, 16) || (out_row_stride * static_cast<int64_t>(sizeof(OutT))) % 16 != 0) return kMisaligned;
  if (!(inverse_decode_numerator > 0.0f)) return kInvalidProblem;
  (void)scale;
  (void)amax;
  return kOk;
}

template <class OutT>
int dequantize_run(const uint8_t* data, const uint8_t* scale, const float* amax, void* out, int64_t rows,
                   int64_t cols, int64_t data_row_stride, int64_t scale_row_stride, int64_t amax_stride,
                   int64_t out_row_stride, float inverse_decode_numerator, cudaStream_t stream) {
  const int status = dequantize_can_implement<OutT>(data, scale, amax, out, rows, cols, data_row_stride,
                                                    scale_row_stride, amax_stride, out_row_stride,
                                                    inverse_decode_numerator);
  if (status != kOk) return status;
  const int64_t vectors_per_row = cols / kElemsPerThread<OutT>;
  if (rows == 0 || vectors_per_row == 0) return kOk;
  // 256 threads: as many along the row as it has vectors (a multiple of 32, at most 256), the rest on rows
  constexpr int64_t kThreads = 256, kCtasPerSm = 8, kWaves = 2;
  const int64_t threads_x = std::min<int64_t>(kThreads, (vectors_per_row + 31) / 32 * 32);
  const int64_t threads_y = kThreads / threads_x;
  const int64_t col_blocks = (vectors_per_row + threads_x - 1) / threads_x;
  int device = 0, sms = 0;
  if (!current_device_multiprocessors(&device, &sms)) return launch_status();
  const int64_t row_blocks_needed = (rows + threads_y * kRowsPerIter - 1) / (threads_y * kRowsPerIter);
  const int64_t row_blocks_wanted = std::max<int64_t>(1, sms * kCtasPerSm * kWaves / col_blocks);
  const dim3 block(static_cast<unsigned>(threads_x), static_cast<unsigned>(threads_y));
  const dim3 grid(static_cast<unsigned>(std::min(row_blocks_needed, row_blocks_wanted)),
                  static_cast<unsigned>(col_blocks));
  dequantize_kernel<OutT><<<grid, block, 0, stream>>>(
      data, scale, amax, static_cast<OutT*>(out), rows, cols, data_row_stride, scale_row_stride, amax_stride,
      out_row_stride, inverse_decode_numerator);
  return launch_status();
}

}  // namespace fp4gen
