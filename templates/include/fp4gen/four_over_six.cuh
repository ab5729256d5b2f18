// 4over6 adaptive block scaling (docs/numerics.md, "4over6"), as runtime/four_over_six.py defines it: a
// block (1x16, or a whole 16x16 tile) is encoded with the scale that maps its maximum to 6 and with the one
// that maps it to 4, and keeps the candidate whose reconstruction errs less (strictly; ties and NaN errors
// keep map-to-6). 4over6 tensors use Emax = 256, so the map-to-4 scale (1.5x) still fits E4M3.
#pragma once

#include "fp4gen/nvfp4.cuh"

namespace fp4gen {

constexpr float kFourOverSixNumerator = 6.0f * 256.0f;  // fl(6 * Emax), exact

// GES with Emax 256: fl(1536 / amax), capped at FLT_MAX (NaN -> FLT_MAX), 1 for amax 0 or a zero quotient.
__device__ __forceinline__ float global_encode_scale_4over6(float amax) {
  const float s = fminf(__fdiv_rn(kFourOverSixNumerator, amax), kFltMax);
  return (amax == 0.0f || s == 0.0f) ? 1.0f : s;
}

struct ScaleCandidate {
  uint32_t scale_byte;  // E4M3
  float scale;          // its value
  float inverse;        // min(fl(1 / fl(scale * S_dec)), FLT_MAX)
};

__device__ __forceinline__ ScaleCandidate scale_candidate(float v, float s_dec) {
  uint16_t pair;  // the E4M3 byte in the low half
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
  const float scale = e4m3_to_float(pair & 0xFFu);
  return {static_cast<uint32_t>(pair & 0xFFu), scale, fminf(__frcp_rn(__fmul_rn(scale, s_dec)), kFltMax)};
}

// The two candidates of a block of amax `block_amax` (NaN ignored) under second-level amax `amax`:
// base = fl(fl(block_amax / 6) * S_enc) (a true division, unlike the standard scale), map-to-4 = E4M3(1.5
// base), map-to-6 = E4M3(base).
__device__ __forceinline__ void four_over_six_candidates(float block_amax, float amax, ScaleCandidate& map4,
                                                         ScaleCandidate& map6) {
  const float s_enc = global_encode_scale_4over6(amax);
  const float base = __fmul_rn(__fdiv_rn(block_amax, 6.0f), s_enc);
  const float s_dec = __frcp_rn(s_enc);
  map4 = scale_candidate(__fmul_rn(base, 1.5f), s_dec);
  map6 = scale_candidate(base, s_dec);
}

// fl(p / 1536), the division of the error's dequantization, without __fdiv_rn where that is exact: q = fl(p * y)
// with y = fl(1/1536), then one correction step, fl(q + fl(p - q * 1536) * y) (both FMAs), is the correctly
// rounded quotient for every |p| in [2^-100, 2^120] (tests/cuda/four_over_six_division_exhaustive.cu compares
// it with __fdiv_rn for every float on the GPU; the step fails only where the quotient is subnormal), and 0
// for p = 0 (whose sign the error ignores). Other p (tiny, huge, Inf, NaN) divide.
__device__ __forceinline__ float divide_by_four_over_six_numerator(float p) {
  constexpr float kInverse = 1.0f / kFourOverSixNumerator;  // fl(1/1536)
  const float a = fabsf(p);
  if ((a >= 0x1p-100f && a <= 0x1p120f) || a == 0.0f) {
    const float q = __fmul_rn(p, kInverse);
    return __fmaf_rn(__fmaf_rn(-q, kFourOverSixNumerator, p), kInverse, q);
  }
  return __fdiv_rn(p, kFourOverSixNumerator);
}

// The error of 16 elements x (one block row) encoded as `codes` (element k in nibble k) with scale `scale`:
// v = fl(fl(fl(e2m1 * scale) * amax) / 1536), summed left to right from 0 as |v - x| (MAE) or (v - x)^2
// (MSE). v depends on the code alone, and a negative code's v is the positive one's negated (every step
// rounds symmetrically), so the eight magnitudes' v are computed once and each element looks its up, in
// `column`: this thread's entries of a shared-memory table, entry m at column[m * kStride]. With the threads'
// entries of one m side by side (kStride = the CTA's threads), each lane of a lookup reads its own bank, one
// shared-memory wavefront a lookup; an array in registers indexed by the code lives in local memory instead,
// where the lanes' different entries fall in up to eight 128-byte lines a load. On an H100 (8192 x 8192 bf16,
// both copies, bench/RESULTS.md, 2026-12-06) the shared table with the two-division values below (and, for
// 16x16 tiles, which computed every element's v before, their errors' tree sum kept out of local memory) took
// row-scaled 1x16 4over6 from 416 to 361 us and 16x16 tiles from 491 to 309 us.
template <int kStride>
__device__ __forceinline__ float four_over_six_row_error(const float (&x)[16], uint64_t codes, float scale,
                                                         float amax, bool mse, float* column) {
  // Each magnitude is 2^j or 1.5 * 2^j (j = -1 .. 2), and its product with the scale is exact, so where
  // fl(scale * amax) and fl(1.5 * scale * amax) keep every v normal and finite their v are those two products'
  // quotients times 2^j (scaling by a power of two commutes with each rounding there): two divisions instead of
  // eight. Elsewhere (tiny, huge, Inf, NaN) each v is computed as written.
  const float unit = __fmul_rn(scale, amax), unit_and_half = __fmul_rn(__fmul_rn(scale, 1.5f), amax);
  if (unit >= 0x1p-114f && unit_and_half <= 0x1p125f) {
    const float v1 = divide_by_four_over_six_numerator(unit);
    const float v15 = divide_by_four_over_six_numerator(unit_and_half);
    column[0] = 0.0f;
    column[1 * kStride] = __fmul_rn(v1, 0.5f);
    column[2 * kStride] = v1;
    column[3 * kStride] = v15;
    column[4 * kStride] = __fmul_rn(v1, 2.0f);
    column[5 * kStride] = __fmul_rn(v15, 2.0f);
    column[6 * kStride] = __fmul_rn(v1, 4.0f);
    column[7 * kStride] = __fmul_rn(v15, 4.0f);
  } else {
#pragma unroll
    for (uint32_t m = 0; m < 8; ++m)
      column[m * kStride] = divide_by_four_over_six_numerator(__fmul_rn(__fmul_rn(e2m1_to_float(m), scale), amax));
  }
  float err = 0.0f;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t code = static_cast<uint32_t>(codes >> (4 * k)) & 0xFu;
    const float v = __uint_as_float(__float_as_uint(column[(code & 7u) * kStride]) ^ ((code & 8u) << 28));
    const float d = __fsub_rn(v, x[k]);
    err = __fadd_rn(err, mse ? __fmul_rn(d, d) : fabsf(d));
  }
  return err;
}

}  // namespace fp4gen
