// Exact NVFP4 element and scale decoding shared by the device kernels (spec/nvfp4-numerics.md 1.1-1.2).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fp4gen {

// fl(1 / fl(6 * 448)): the global decode factor of spec 2.4 (a compile-time IEEE division).
constexpr float kInvGlobalEncodeNumerator = 1.0f / (6.0f * 448.0f);

// E2M1 code (low 4 bits) -> its exact value. Bit 3 is the sign, so code 0x8 is -0.0.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t exponent = (code >> 1) & 3u, mantissa = code & 1u;
  // exponent 0 is subnormal (0 or 0.5); otherwise 2^(exponent-1) * (1 + mantissa/2)
  const float magnitude = exponent == 0 ? 0.5f * static_cast<float>(mantissa)
                                        : __uint_as_float(((exponent + 126u) << 23) | (mantissa << 22));
  return (code & 8u) ? -magnitude : magnitude;
}

// OCP E4M3 (fn) byte -> its exact value; 0x7F/0xFF are NaN. Written out rather than using the fp8
// intrinsics so sm_90a and sm_100a decode through the same instructions.
__device__ __forceinline__ float e4m3_to_float(uint32_t byte) {
  const uint32_t sign = (byte & 0x80u) << 24, exponent = (byte >> 3) & 0xFu, mantissa = byte & 7u;
  if (exponent == 0xFu && mantissa == 7u) return __uint_as_float(0x7FC00000u | sign);
  const float magnitude = exponent == 0 ? static_cast<float>(mantissa) * 0x1p-9f  // subnormal: m * 2^-9
                                        : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
  return __uint_as_float(__float_as_uint(magnitude) | sign);
}

}  // namespace fp4gen
