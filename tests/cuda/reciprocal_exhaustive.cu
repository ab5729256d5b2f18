// reciprocal_rn_in_range (nvfp4.cuh), the branch-free block-scale reciprocal of the sm_90a quantize kernels,
// against __frcp_rn for every float d in its range (+0 and the normal d below 2^126), both under the fminf
// with FLT_MAX that encode_block_scale applies; and, on the host, that block_reciprocals_in_range's bounds
// keep d = fl(sdec * S_dec) in that range for every E4M3 sdec. Needs a GPU; run by
// tests/gpu/test_reciprocal_gpu.py. Prints "<what>: <n> mismatches" lines; exits nonzero on any.
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cmath>

#include "fp4gen/nvfp4.cuh"

__global__ void compare_reciprocals(unsigned long long* mismatches, unsigned int* first_mismatch) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  // every pattern from 0x00000000 to 0x7E7FFFFF; the subnormal ones (exponent field 0, mantissa nonzero) are
  // outside the range and skipped
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; u < 0x7E800000u; u += stride) {
    if (u != 0 && u < 0x00800000u) continue;
    const float d = __uint_as_float(static_cast<uint32_t>(u));
    const float fast = fminf(fp4gen::reciprocal_rn_in_range(d), fp4gen::kFltMax);
    const float exact = fminf(__frcp_rn(d), fp4gen::kFltMax);
    if (__float_as_uint(fast) != __float_as_uint(exact)) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch, static_cast<unsigned int>(u));
    }
  }
}

static float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// The value of a non-negative E4M3 byte (0x00-0x7E).
static float e4m3_value(uint32_t byte) {
  const uint32_t exponent = (byte >> 3) & 0xFu, mantissa = byte & 7u;
  return exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                       : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, static_cast<int>(exponent) - 7);
}

int main() {
  unsigned long long* mismatches = nullptr;
  unsigned int* first = nullptr;
  cudaMallocManaged(&mismatches, sizeof(*mismatches));
  cudaMallocManaged(&first, sizeof(*first));
  *mismatches = 0;
  *first = 0xFFFFFFFFu;
  compare_reciprocals<<<132 * 16, 256>>>(mismatches, first);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  std::printf("reciprocal_rn_in_range vs __frcp_rn over [+0, 2^126): %llu mismatches (first 0x%08x)\n",
              *mismatches, *first);
  const bool device_ok = *mismatches == 0;

  // Host: d = fl(sdec * S_dec) for every E4M3 sdec and S_dec at and near the bounds and at every power of
  // two between them, with several mantissas: d must be +0 or normal with exponent field <= 252.
  unsigned long long out_of_range = 0;
  const float mantissas[] = {1.0f, 1.0000001f, 1.2345678f, 1.5f, 1.9999999f};
  for (int e = -117; e <= 116; ++e) {
    for (float m : mantissas) {
      const float s_dec = std::ldexp(m, e);
      if (!(s_dec >= 0x1p-117f && s_dec <= 0x1p116f)) continue;  // outside block_reciprocals_in_range
      for (uint32_t byte = 0; byte < 0x7F; ++byte) {
        const uint32_t u = float_to_bits(e4m3_value(byte) * s_dec);  // one IEEE fp32 multiply
        const uint32_t exponent = u >> 23;
        if (!(u == 0 || (exponent >= 1 && exponent <= 252))) ++out_of_range;
      }
    }
  }
  const float upper = bits_to_float(float_to_bits(0x1p116f));
  for (uint32_t byte = 0; byte < 0x7F; ++byte) {  // the largest S_dec exactly
    const uint32_t u = float_to_bits(e4m3_value(byte) * upper);
    if (!(u == 0 || ((u >> 23) >= 1 && (u >> 23) <= 252))) ++out_of_range;
  }
  std::printf("d = fl(sdec * S_dec) outside the range for S_dec in the bounds: %llu mismatches\n", out_of_range);
  return device_ok && out_of_range == 0 ? 0 : 1;
}
