// NVFP4 dequantization (spec/nvfp4-numerics.md 2.4): out = OutT(fl(e2m1 * fl(fl(sdec * amax) * fl(1/2688)))).
//
// One thread decodes one 16-element block: one 8-byte load of codes, one scale byte, one amax, then
// 16 outputs in 16-byte stores. Indices are 64-bit so tensors of 2^31 elements and more work.
#pragma once

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4gen/abi.h"
#include "fp4gen/nvfp4.cuh"

namespace fp4gen {

template <class OutT>
struct BlockStore;

template <>
struct BlockStore<float> {
  static __device__ __forceinline__ void store(float* dst, const float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      reinterpret_cast<float4*>(dst)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  }
};

template <class Pair, Pair (*Convert)(float, float)>
__device__ __forceinline__ void store_pairs(void* dst, const float (&v)[16]) {
  Pair pairs[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) pairs[i] = Convert(v[2 * i], v[2 * i + 1]);  // round to nearest even
  reinterpret_cast<uint4*>(dst)[0] = *reinterpret_cast<const uint4*>(&pairs[0]);
  reinterpret_cast<uint4*>(dst)[1] = *reinterpret_cast<const uint4*>(&pairs[4]);
}

template <>
struct BlockStore<__nv_bfloat16> {
  static __device__ __forceinline__ void store(__nv_bfloat16* dst, const float (&v)[16]) {
    store_pairs<__nv_bfloat162, __floats2bfloat162_rn>(dst, v);
  }
};

template <>
struct BlockStore<__half> {
  static __device__ __forceinline__ void store(__half* dst, const float (&v)[16]) {
    store_pairs<__half2, __floats2half2_rn>(dst, v);
  }
};

template <class OutT>
__global__ void dequantize_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                  const float* __restrict__ amax, OutT* __restrict__ out, int64_t rows,
                                  int64_t blocks_per_row, int64_t data_row_stride, int64_t scale_row_stride,
                                  int64_t amax_stride, int64_t out_row_stride) {
  const int64_t total = rows * blocks_per_row;
  for (int64_t block = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; block < total;
       block += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = block / blocks_per_row, col_block = block - row * blocks_per_row;
    const uint2 codes = *reinterpret_cast<const uint2*>(data + row * data_row_stride + col_block * 8);
    const float sdec = e4m3_to_float(scale[row * scale_row_stride + col_block]);
    const float factor = __fmul_rn(__fmul_rn(sdec, amax[row * amax_stride]), kInvGlobalEncodeNumerator);
    float v[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t byte = ((i < 4 ? codes.x : codes.y) >> (8 * (i % 4))) & 0xFFu;
      v[2 * i] = __fmul_rn(e2m1_to_float(byte & 0xFu), factor);  // element 2j: low nibble
      v[2 * i + 1] = __fmul_rn(e2m1_to_float(byte >> 4), factor);
    }
    BlockStore<OutT>::store(out + row * out_row_stride + col_block * 16, v);
  }
}

template <class OutT>
int dequantize_can_implement(const uint8_t* data, const uint8_t* scale, const float* amax, void* out,
                             int64_t rows, int64_t cols, int64_t data_row_stride, int64_t scale_row_stride,
                             int64_t amax_stride, int64_t out_row_stride) {
  if (rows < 0 || cols < 0 || cols % 16 != 0) return kInvalidProblem;
  if (amax_stride != 0 && amax_stride != 1) return kInvalidProblem;
  if (rows > 1 && (data_row_stride < cols / 2 || scale_row_stride < cols / 16 || out_row_stride < cols))
    return kInvalidProblem;
  if (!aligned(data, 8) || data_row_stride % 8 != 0) return kMisaligned;
  if (!aligned(out, 16) || (out_row_stride * static_cast<int64_t>(sizeof(OutT))) % 16 != 0) return kMisaligned;
  (void)scale;
  (void)amax;
  return kOk;
}

template <class OutT>
int dequantize_run(const uint8_t* data, const uint8_t* scale, const float* amax, void* out, int64_t rows,
                   int64_t cols, int64_t data_row_stride, int64_t scale_row_stride, int64_t amax_stride,
                   int64_t out_row_stride, cudaStream_t stream) {
  const int status = dequantize_can_implement<OutT>(data, scale, amax, out, rows, cols, data_row_stride,
                                                    scale_row_stride, amax_stride, out_row_stride);
  if (status != kOk) return status;
  const int64_t blocks = rows * (cols / 16);
  if (blocks == 0) return kOk;
  constexpr int kThreads = 256;
  constexpr int64_t kMaxGrid = int64_t(1) << 20;  // grid-stride beyond this
  const int64_t grid = std::min<int64_t>((blocks + kThreads - 1) / kThreads, kMaxGrid);
  dequantize_kernel<OutT><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      data, scale, amax, static_cast<OutT*>(out), rows, cols / 16, data_row_stride, scale_row_stride,
      amax_stride, out_row_stride);
  return launch_status();
}

}  // namespace fp4gen
