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
// as round-to-nearest does. Computed without the rule's division and final grid mapping, to the same codes:
//  - step(t) may be replaced by step(a): t < a + step(a), so t crosses into the next binade only below
//    2.5 (from a < 2) or 5 (from a < 4), where floor(t / step(a)) * step(a) and floor(t / step(t)) * step(t)
//    are both 2, or both 4;
//  - with n = floor(t / step(a)) (a multiplication: step(a) is a power of two), the code is n on [0, 2),
//    n + 2 on [2, 4) and n + 4 above, at most 7; fminf makes a NaN n 7.
// (The rule's definition, with its division, is runtime/stochastic.py's; tests/gpu/test_quantize_options_gpu.py
// compares the kernels' codes with it byte for byte.)
__device__ __forceinline__ uint32_t e2m1_code_stochastic(float y, uint32_t byte) {
  const float a = fabsf(y);
  const bool two = a >= 2.0f, four = a >= 4.0f;
  const float step = four ? 2.0f : (two ? 1.0f : 0.5f), inverse_step = four ? 0.5f : (two ? 1.0f : 2.0f);
  const float base = four ? 4.0f : (two ? 2.0f : 0.0f);
  const float u = __uint_as_float(0x3F800000u | (byte << 15)) - 1.0f;  // byte / 256, exactly
  const float t = __fmaf_rn(u, step, a);  // fl(a + u * step): the product is exact
  const float code = fminf(floorf(__fmul_rn(t, inverse_step)) + base, 7.0f);
  return static_cast<uint32_t>(code) | (y < 0.0f ? 8u : 0u);
}

}  // namespace fp4gen
