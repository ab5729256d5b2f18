// Input elements of the quantize-side kernels (bf16, fp16, fp32), read as 16-byte vectors.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fp4gen {

template <class InT>
struct Element;

template <>
struct Element<__nv_bfloat16> {
  static constexpr int kPerVector = 8;
  static constexpr uint32_t kAbsMask = 0x7FFFu;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  // |x| bits, widened to fp32 bits: order-preserving, so NaN > Inf > finite under integer max
  static __device__ __forceinline__ uint32_t abs_bits_as_float_bits(uint32_t abs_bits) { return abs_bits << 16; }
};

template <>
struct Element<__half> {
  static constexpr int kPerVector = 8;
  static constexpr uint32_t kAbsMask = 0x7FFFu;
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ uint32_t abs_bits_as_float_bits(uint32_t abs_bits) {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(abs_bits))));
  }
};

template <>
struct Element<float> {
  static constexpr int kPerVector = 4;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ uint32_t abs_bits_as_float_bits(uint32_t abs_bits) { return abs_bits; }
};

// |x| bits of element i of a 16-byte vector, in the element's own width.
template <class InT>
__device__ __forceinline__ uint32_t abs_bits(const uint4& vec, int i) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&vec);
  if constexpr (sizeof(InT) == 2) {
    return (words[i / 2] >> (16 * (i % 2))) & Element<InT>::kAbsMask;
  } else {
    return words[i] & Element<InT>::kAbsMask;
  }
}

}  // namespace fp4gen
