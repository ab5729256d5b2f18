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

// What a row (or column) of blocks shares: S_enc = GES(amax), m = fl(S_enc * fl(1/6)), S_dec = fl(1/S_enc).
struct GlobalScale {
  float encode_times_one_sixth;
  float decode;
};

__device__ __forceinline__ GlobalScale global_scale(float amax) {
  const float s_enc = global_encode_scale(amax);
  return {__fmul_rn(s_enc, kOneSixth), __frcp_rn(s_enc)};  // __frcp_rn: IEEE 1/x, as 2.3 requires
}

struct BlockEncoding {
  uint32_t scale_byte;  // sdec_b, E4M3
  float inverse;        // r: what each element is multiplied by before E2M1 rounding
};

// 2.2-2.3 for one block: sdec = E4M3(min(bamax * m, FLT_MAX)), r = min(fl(1 / fl(sdec * S_dec)), FLT_MAX).
__device__ __forceinline__ BlockEncoding encode_block_scale(float block_amax, GlobalScale g) {
  const uint32_t byte = float_to_e4m3_satfinite(fminf(__fmul_rn(block_amax, g.encode_times_one_sixth), kFltMax));
  const float r = fminf(__frcp_rn(__fmul_rn(e4m3_to_float(byte), g.decode)), kFltMax);
  return {byte, r};
}

// E2M1_RN (1.1) in software, for GPUs without the e2m1 cvt (sm_90a), in FMA-pipe arithmetic.
//
// Adding kRoundMagic = 1.5 * 2^23 to a float in [0, 2^22) rounds it to an integer (to nearest, ties to
// even) held in the low mantissa bits of the sum. For a = |y| the code is rint(2a) on [0, 2),
// rint(a) + 2 on [2, 4) and rint(a / 2) + 4 above (saturated at 7); each candidate is at least the right
// code outside its own range, so the code is the minimum of the three and 7 (fminf also turns NaN into
// 7, the code the hardware gives NaN). Returns kRoundMagic + code.
constexpr float kRoundMagic = 12582912.0f;

__device__ __forceinline__ float e2m1_magnitude_code(float a) {
  const float c1 = __fmaf_rn(a, 2.0f, kRoundMagic);
  const float c2 = __fadd_rn(a, kRoundMagic + 2.0f);
  const float c3 = __fmaf_rn(a, 0.5f, kRoundMagic + 4.0f);
  return fminf(fminf(fminf(c1, c2), c3), kRoundMagic + 7.0f);
}

// 1.0 if y < 0 (however tiny), else 0.0 (also for -0.0 and NaN): two saturating multiplies, so that
// even the smallest subnormal reaches 1.
__device__ __forceinline__ float negative_flag(float y) {
  return __saturatef(__fmul_rn(__saturatef(__fmul_rn(y, -0x1p127f)), 0x1p127f));
}

// kRoundMagic + E2M1 code of fl(x * r): the sign bit (8) is set iff the product is < 0.
__device__ __forceinline__ float e2m1_code_software(float x, float r) {
  const float y = __fmul_rn(x, r);
  return __fmaf_rn(negative_flag(y), 8.0f, e2m1_magnitude_code(fabsf(y)));
}

// Eight codes of fl(v[i] * r) packed into a word, element 0 in the low nibble. Four codes are summed
// into one float (exact below 2^16), and the two 16-bit halves are merged with one byte permute.
__device__ __forceinline__ uint32_t e2m1_pack8_software(const float* v, float r) {
  uint32_t halves[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float* q = v + 4 * h;
    float sum = e2m1_code_software(q[0], r);
#pragma unroll
    for (int i = 1; i < 4; ++i) sum = __fmaf_rn(__fsub_rn(e2m1_code_software(q[i], r), kRoundMagic),
                                                static_cast<float>(1 << (4 * i)), sum);
    halves[h] = __float_as_uint(sum);
  }
  return __byte_perm(halves[0], halves[1], 0x5410);
}

// Two elements to one byte, `lo` (the even element) in the low nibble, with the sm_100a instruction.
// cvt.rn.satfinite.e2m1x2.f32 puts its first source in the high nibble. Inputs are made to agree with
// the software rule where the spec does not pin the hardware down: NaN becomes +6 explicitly, and
// -0.0 + 0.0 = +0.0 drops the sign of zero.
__device__ __forceinline__ uint32_t e2m1_encode_pair_hardware(float lo, float hi) {
  lo = isnan(lo) ? 6.0f : __fadd_rn(lo, 0.0f);
  hi = isnan(hi) ? 6.0f : __fadd_rn(hi, 0.0f);
  uint32_t out;
  asm("{\n .reg .b8 byte0;\n cvt.rn.satfinite.e2m1x2.f32 byte0, %2, %1;\n cvt.u32.u8 %0, byte0;\n}"
      : "=r"(out)
      : "f"(lo), "f"(hi));
  return out;
}

// The 16 codes of one block, elements multiplied by r and packed: element 2j in the low nibble of byte j.
template <bool kHardwareCvt>
__device__ __forceinline__ uint2 encode_block_codes(const float (&v)[16], float r) {
  if constexpr (kHardwareCvt) {
    uint32_t words[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j)
      words[j / 4] |= e2m1_encode_pair_hardware(__fmul_rn(v[2 * j], r), __fmul_rn(v[2 * j + 1], r))
                      << (8 * (j % 4));
    return make_uint2(words[0], words[1]);
  } else {
    return make_uint2(e2m1_pack8_software(v, r), e2m1_pack8_software(v + 8, r));
  }
}

// Block amax as upstream's kernels compute it: max |v| with NaN elements ignored (fmaxf).
__device__ __forceinline__ float block_abs_max(const float (&v)[16]) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[i]));
  return m;
}

}  // namespace fp4gen
