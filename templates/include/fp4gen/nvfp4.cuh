// NVFP4 element and scale arithmetic shared by the device kernels (spec/nvfp4-numerics.md 1-2): exact
// decoding, and encoding bit for bit as the spec orders it.
#pragma once

#include <cstdint>

#include <cuda_fp8.h>
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


// ---- Encoding (spec sections 2.1-2.3). Every step is one IEEE fp32 operation in the spec's order; the
// explicit __f*_rn intrinsics keep nvcc from contracting or reassociating them.

constexpr float kFltMax = 3.402823466e38f;
constexpr float kOneSixth = 1.0f / 6.0f;  // fl(1/6) = 0x3E2AAAAB

// GES (2.1): fl(2688 / amax) capped at FLT_MAX by fminf (a NaN quotient gives FLT_MAX, as in C);
// 1 when amax is 0 or the quotient is 0 (amax = +Inf).
__device__ __forceinline__ float global_encode_scale(float amax) {
  const float s = fminf(__fdiv_rn(6.0f * 448.0f, amax), kFltMax);
  return (amax == 0.0f || s == 0.0f) ? 1.0f : s;
}

// OCP E4M3 (fn) with round-to-nearest-even and saturation to 448 (NaN stays NaN): the stored scale byte.
__device__ __forceinline__ uint32_t float_to_e4m3_satfinite(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

struct BlockEncoding {
  uint32_t scale_byte;  // sdec_b, E4M3
  float inverse;        // r: what each element is multiplied by before E2M1 rounding
};

// 2.2-2.3 for one block: sdec = E4M3(min(bamax * fl(S_enc * fl(1/6)), FLT_MAX)),
// r = min(fl(1 / fl(sdec * fl(1 / S_enc))), FLT_MAX).
__device__ __forceinline__ BlockEncoding encode_block_scale(float block_amax, float s_enc) {
  const float m = __fmul_rn(s_enc, kOneSixth);
  const uint32_t byte = float_to_e4m3_satfinite(fminf(__fmul_rn(block_amax, m), kFltMax));
  const float s_dec = __fdiv_rn(1.0f, s_enc);
  const float r = fminf(__fdiv_rn(1.0f, __fmul_rn(e4m3_to_float(byte), s_dec)), kFltMax);
  return {byte, r};
}

// E2M1_RN (1.1) in software, for GPUs without the e2m1 cvt (sm_90a): the spec's decision intervals
// [0,.25] (.25,.75) [.75,1.25] (1.25,1.75) [1.75,2.5] (2.5,3.5) [3.5,5] (5,inf) counted directly, so ties
// go to the even code and everything above 5 saturates to 6. The sign bit is set iff y < 0 (so -0.0
// gives +0); NaN gives 0x7 (+6), what the hardware's satfinite conversion gives.
__device__ __forceinline__ uint32_t e2m1_encode_software(float y) {
  const float a = fabsf(y);
  const uint32_t magnitude = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                             (a >= 3.5f) + (a > 5.0f);
  return isnan(y) ? 0x7u : (magnitude | (y < 0.0f ? 0x8u : 0u));
}

// Two elements to one byte, `lo` (the even element) in the low nibble.
template <bool kHardwareCvt>
__device__ __forceinline__ uint32_t e2m1_encode_pair(float lo, float hi) {
  if constexpr (kHardwareCvt) {
    // cvt.rn.satfinite.e2m1x2.f32 (sm_100a): its first source goes to the high nibble. Inputs are made
    // to agree with the software rule at the two points where the hardware's behaviour is not pinned
    // down by the spec: NaN becomes +6 explicitly, and -0.0 + 0.0 = +0.0 drops the sign of zero.
    lo = isnan(lo) ? 6.0f : __fadd_rn(lo, 0.0f);
    hi = isnan(hi) ? 6.0f : __fadd_rn(hi, 0.0f);
    uint32_t out;
    asm("{\n .reg .b8 byte0;\n cvt.rn.satfinite.e2m1x2.f32 byte0, %2, %1;\n cvt.u32.u8 %0, byte0;\n}"
        : "=r"(out)
        : "f"(lo), "f"(hi));
    return out;
  } else {
    return e2m1_encode_software(lo) | (e2m1_encode_software(hi) << 4);
  }
}

// The 16 codes of one block, multiplied by r and packed: element 2j in the low nibble of byte j.
template <bool kHardwareCvt>
__device__ __forceinline__ uint2 encode_block_codes(const float (&v)[16], float r) {
  uint32_t words[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    words[j / 4] |= e2m1_encode_pair<kHardwareCvt>(__fmul_rn(v[2 * j], r), __fmul_rn(v[2 * j + 1], r))
                    << (8 * (j % 4));
  return make_uint2(words[0], words[1]);
}

// Block amax as upstream's kernels compute it: max |v| with NaN elements ignored (fmaxf).
__device__ __forceinline__ float block_abs_max(const float (&v)[16]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[i]));
  return m;
}

}  // namespace fp4gen
