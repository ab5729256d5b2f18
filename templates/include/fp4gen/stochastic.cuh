// Stochastic rounding to E2M1 (docs/numerics.md, "Stochastic rounding"): the random bits and the rule, the
// same as runtime/stochastic.py's.
//
// Bits: a copy's block b (its flat element index / 16) takes the 16 bytes of Philox4x32-10 with
// key = (seed lo, seed hi) and counter = (b lo, b hi, offset lo, offset hi); its element k takes byte k % 4
// of word k / 4. So the bytes depend on (seed, offset, element) alone, never on the kernel's tiling.
//
// Rule (TransformerEngine's software fallback): a = |y|, step(v) = 2 if v >= 4, 1 if v >= 2, else 0.5,
// t = fl(a + u * step(a)) with u = byte / 256, q = min(floor(t / step(t)) * step(t), 6); the code is q's,
// its sign bit set iff y < 0 (e2m1_code_stochastic computes it in fewer steps). The sm_100a instruction
// cvt.rs.satfinite.e2m1x4.f32 is not used: how it maps its random bits to elements and rounds is not
// documented, and no Blackwell GPU was available to pin it down, so every arch takes this rule and gives
// these bytes.
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

// The E2M1 code of y rounded stochastically with random byte `byte`. NaN gives 0x7 (+6) and -0.0 gives 0,
// as round-to-nearest does. Computed without the rule's division, floor and grid mapping, to the same codes
// (tests/cuda/stochastic_code_exhaustive.cu compares it with the rule for every float and every byte):
//  - step: 2^(e - 1) from a = |y|'s exponent e, at least 0.5. That is the rule's step(a) below 8; above,
//    t >= a >= 8 saturates to 6 whatever the step.
//  - t = fma(u, step, a) as the rule's (u * step is exact, so the same rounding).
//  - code from t's bits: d = t's exponent and first mantissa bit (bits >> 22). On [1, 8) the grid is a float
//    with one mantissa bit, so floor(t / step(t)) * step(t) has code d - 252 (254 for 1.0 ... 259 for 6);
//    below 1 the grid step is 0.5, so the code is 1 on [0.5, 1) (where d - 252 is 0 or 1) and 0 below;
//    at most 7 (6), which also takes t >= 8, infinity and NaN (whose d is above 259).
// (The rule's definition, with its division, is runtime/stochastic.py's; tests/gpu/test_quantize_options_gpu.py
// compares the kernels' codes with it byte for byte.)
__device__ __forceinline__ uint32_t e2m1_code_stochastic(float y, uint32_t byte) {
  const uint32_t a_bits = __float_as_uint(y) & 0x7FFFFFFFu;
  const float step = __uint_as_float(max(a_bits & 0x7F800000u, 0x3F800000u) - 0x00800000u);
  const float u = __uint_as_float(0x3F800000u | (byte << 15)) - 1.0f;  // byte / 256, exactly
  const float t = __fmaf_rn(u, step, __uint_as_float(a_bits));
  const int d = static_cast<int>(__float_as_uint(t) >> 22);
  const int code = min(max(d - 252, t >= 0.5f ? 1 : 0), 7);
  return static_cast<uint32_t>(code) | (y < 0.0f ? 8u : 0u);
}

// The stochastically rounded codes of fl(v[k] * r), k < kCodes (at most 8), element k in nibble k, with
// random bytes `bits` (element k takes byte k % 4 of word k / 4: bits.x, then bits.y).
template <int kCodes>
__device__ __forceinline__ uint32_t encode_codes_stochastic(const float (&v)[kCodes], float r, uint2 bits) {
  static_assert(kCodes <= 8, "two words of random bytes: at most 8 codes");
  uint32_t codes = 0u;
#pragma unroll
  for (int k = 0; k < kCodes; ++k) {
    const uint32_t word = k < 4 ? bits.x : bits.y;
    codes |= e2m1_code_stochastic(__fmul_rn(v[k], r), (word >> (8 * (k % 4))) & 0xFFu) << (4 * k);
  }
  return codes;
}

}  // namespace fp4gen
