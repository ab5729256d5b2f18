// Stochastic rounding to E2M1 (docs/numerics.md, "Stochastic rounding"): the random bits and the rule, the
// same as runtime/stochastic.py's.
//
// Bits: a copy's block b (its flat element index / 16) takes the 16 bytes of Philox4x32-10 with
// key = (seed lo, seed hi) and counter = (b lo, b hi, offset lo, offset hi); its element k takes byte k % 4
// of word k / 4. So the bytes depend on (seed, offset, element) alone, never on the kernel's tiling.
//
// Rule (TransformerEngine's software fallback): a = |y|, step(v) = 2 if v >= 4, 1 if v >= 2, else 0.5,
// t = fl(a + u * step(a)) with u = byte / 256, q = min(floor(t / step(t)) * step(t), 6); the code is q's,
// its sign bit set iff y < 0 (encode_codes_stochastic computes it in fewer steps). The sm_100a instruction
// cvt.rs.satfinite.e2m1x4.f32 is not used: how it maps its random bits to elements and rounds is not
// documented, and no Blackwell GPU was available to pin it down, so every arch takes this rule and gives
// these bytes.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "fp4gen/nvfp4.cuh"

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

// The stochastic step, as the bits of t for y with byte k of `word` (k is a constant wherever this is inlined in
// an unrolled loop, and the byte permute's selector with it). Computed without the rule's division, floor and
// grid lookup, to the same codes (tests/cuda/stochastic_code_exhaustive.cu compares encode_codes_stochastic with
// the rule for every float and every byte):
//  - t = fma(u, step, a) as the rule's (u * step is exact, so the same rounding), with u * step taken as
//    (byte * 2^-133) * (step * 2^125): one byte permute puts the byte into bits 16-23 of an otherwise zero word,
//    the subnormal float byte * 2^-133 (fma.rn.f32 keeps subnormal operands; the build does not flush them).
//  - step * 2^125: the float of exponent field f + 124, f being a = |y|'s field, and at least 2^124 (step 0.5):
//    one add and signed maximum on the masked bits. That is the rule's step(a) = 2^(f - 128) for a in [1, 8) and
//    0.5 below. For a >= 8, which saturates to 6 whatever the step, the result is 2^127 (t >= 8), infinity
//    (t infinite, or NaN when the byte is 0: both read as 7 below) or, from f = 132 on, a field past 255 that
//    wraps the sign bit and loses to the maximum (2^124; t >= a >= 32).
__device__ __forceinline__ uint32_t stochastic_sum_bits(float y, uint32_t word, int k) {
  const float scaled_byte = __uint_as_float(__byte_perm(word, 0u, 0x4044 | (k << 8)));  // byte k to byte 2
  const float scaled_step = __uint_as_float(__viaddmax_s32(__float_as_uint(y) & 0x7F800000u, 0x3E000000, 0x7D800000));
  return __float_as_uint(__fmaf_rn(scaled_byte, scaled_step, fabsf(y)));
}

// Two codes' magnitude bits at once from their t bits (t >= 0, or a NaN with the sign bit clear), in 16-bit lanes:
// X = t's top half, so that d = X >> 6 is t's exponent field and first mantissa bit. On [1, 8) the grid is a
// float with one mantissa bit, so floor(t / step(t)) * step(t) has code d - 252 (254 for 1.0 ... 259 for 6);
// below 1 the grid step is 0.5, so the code is 1 on [0.5, 1) (d 252 and 253) and 0 below; at most 7 (6), which
// also takes t >= 8, infinity and NaN (d above 259). Computed on X itself, code * 64 plus X's low 6 bits:
// min(max(X - 252 * 64, min(X - 251 * 64, 64), 0), 7 * 64 + 63), whose bits 6-8 are the code (X is at most
// 0x7FFF, so the lanes never overflow). The shift leaves t0's code in byte 0 and t1's in byte 2 (bytes 1 and 3
// hold X's low bits and zeros: callers take bytes 0 and 2).
__device__ __forceinline__ uint32_t e2m1_magnitude_pair(uint32_t t0, uint32_t t1) {
  const uint32_t x = __byte_perm(t0, t1, 0x7632);                            // t0's top half low, t1's high
  const uint32_t from_half = __viaddmin_s16x2(x, 0xC140C140u, 0x00400040u);  // min(X - 251 * 64, 64)
  const uint32_t m = __vimin_s16x2_relu(__viaddmax_s16x2_relu(x, 0xC100C100u, from_half), 0x01FF01FFu);
  return m >> 6;
}

// The stochastically rounded codes of fl(v[k] * r), k < 8, element k in nibble k, with random bytes `bits`
// (element k takes byte k % 4 of word k / 4: bits.x, then bits.y). The sign bit is y's: y is fl(v * r) + 0,
// which makes -0.0 (a zero, or a negative product that underflows) +0.0, whose code is 0 as the rule's y < 0
// test gives. The magnitudes come two at a time from e2m1_magnitude_pair and are packed with byte
// permutes: [c0, c1, c2, c3] as bytes, each byte ORed with the next one's nibble, then bytes 0 and 2 kept.
__device__ __forceinline__ uint32_t encode_codes_stochastic(const float (&v)[8], float r, uint2 bits) {
  uint32_t t[8], signs = 0u;
#pragma unroll
  for (int k = 7; k >= 0; --k) {  // from the top element, whose sign nibble is pushed first
    const float y = __fadd_rn(__fmul_rn(v[k], r), 0.0f);
    t[k] = stochastic_sum_bits(y, k < 4 ? bits.x : bits.y, k % 4);
    signs = push_sign_nibble(signs, y);
  }
  uint32_t packed[2];  // two codes a byte: bytes 0 and 2 of each word
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t bytes = __byte_perm(e2m1_magnitude_pair(t[4 * w], t[4 * w + 1]),
                                       e2m1_magnitude_pair(t[4 * w + 2], t[4 * w + 3]), 0x6420);
    packed[w] = (bytes | (bytes >> 4)) & 0x00FF00FFu;
  }
  return __byte_perm(packed[0], packed[1], 0x6420) | (signs & kSignNibbleBits);
}

}  // namespace fp4gen
