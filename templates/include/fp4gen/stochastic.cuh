// Stochastic rounding to E2M1 (docs/numerics.md, "Stochastic rounding"): the random bits and the rule, the
// same as runtime/stochastic.py's.
//
// Bits: a copy's block b (its flat element index / 16) takes the 16 bytes of Philox4x32-10 with
// key = (seed lo, seed hi) and counter = (b lo, b hi, offset lo, offset hi); its element k takes byte k % 4
// of word k / 4. So the bytes depend on (seed, offset, element) alone, never on the kernel's tiling.
//
// Rule (TransformerEngine's software fallback): a = |y|, step(v) = 2 if v >= 4, 1 if v >= 2, else 0.5,
// t = fl(a + u * step(a)) with u = byte / 256, q = min(floor(t / step(t)) * step(t), 6); the code is q's,
// its sign bit set iff y < 0. The sm_100a instruction cvt.rs.satfinite.e2m1x4.f32 is not used: how it maps
// its random bits to elements and rounds is not documented, and no Blackwell GPU was available to pin it
// down, so every arch takes this rule and gives these bytes.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace fp4gen {

// Philox4x32-10 (Random123's philox4x32, curand's Philox4_32_10).
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    if (i) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;  // the key advances between rounds
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

// The 16 random bytes of block `block` of a copy drawn with (seed, offset): word w holds elements 4w..4w+3.
__device__ __forceinline__ uint4 block_random_bits(uint64_t seed, uint64_t offset, uint64_t block) {
  return philox4x32_10(make_uint4(static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                  static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

__device__ __forceinline__ float e2m1_step(float v) { return v >= 4.0f ? 2.0f : (v >= 2.0f ? 1.0f : 0.5f); }

// The E2M1 code of y rounded stochastically with random byte `byte`. NaN gives 0x7 (+6) and -0.0 gives 0,
// as round-to-nearest does.
__device__ __forceinline__ uint32_t e2m1_code_stochastic(float y, uint32_t byte) {
  const float a = fabsf(y);
  const float u = static_cast<float>(byte) * 0.00390625f;  // byte / 256, exact
  const float t = __fadd_rn(a, __fmul_rn(u, e2m1_step(a)));  // u * step is exact
  const float step_t = e2m1_step(t);
  // t / step_t and the product are exact (powers of two); fminf turns NaN into 6
  const float q = fminf(__fmul_rn(floorf(__fdiv_rn(t, step_t)), step_t), 6.0f);
  // q on the grid -> code: [0, 2) -> 2q, [2, 4) -> q + 2, 4 -> 6, 6 -> 7
  const uint32_t magnitude = q < 2.0f ? static_cast<uint32_t>(2.0f * q)
                                      : (q < 4.0f ? static_cast<uint32_t>(q) + 2u : (q == 4.0f ? 6u : 7u));
  return magnitude | (y < 0.0f ? 8u : 0u);
}

}  // namespace fp4gen
