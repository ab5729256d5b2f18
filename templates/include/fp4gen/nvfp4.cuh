// NVFP4 element and scale arithmetic shared by the device kernels: exact decoding, and encoding bit for
// bit in upstream's operation order (docs/numerics.md, the format and quantization).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace fp4gen {

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

// fl(1 / d), IEEE round to nearest, with no branch, for d = +0 or a normal d below 2^126: the approximate
// reciprocal and one Newton step, which is what __frcp_rn computes for that range (it branches to a slow
// path for the others: subnormal, huge, Inf, NaN). d = +0 gives NaN here instead of +Inf; both become
// FLT_MAX under encode_block_scale's fminf. tests/gpu/test_reciprocal_gpu.py compares it with __frcp_rn for
// every float in the range on the GPU (sm_90a).
__device__ __forceinline__ float reciprocal_rn_in_range(float d) {
  float approx;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(approx) : "f"(d));
  const float error = __fmaf_rn(d, approx, -1.0f);
  return __fmaf_rn(approx, -error, approx);
}

// Whether every block of a row (column) with global scale g has d = fl(sdec * S_dec) inside
// reciprocal_rn_in_range's range: sdec is 0 or in [2^-9, 448], so S_dec in [2^-117, 2^116] keeps d = 0 or
// in [2^-126, 2^125). False for the S_dec of a NaN or huge amax, or of an amax below about 2^-105.
__device__ __forceinline__ bool block_reciprocals_in_range(GlobalScale g) {
  return g.decode >= 0x1p-117f && g.decode <= 0x1p116f;
}

// 2.2-2.3 for one block: sdec = E4M3(min(bamax * m, FLT_MAX)), r = min(fl(1 / fl(sdec * S_dec)), FLT_MAX).
// The min with FLT_MAX is left to the conversion: satfinite sends +Inf to 448 as it does FLT_MAX, and the
// product is never NaN (bamax ignores NaN and is finite or +Inf; m is finite and positive).
// sdec is read back through the fp8 -> f16x2 conversion (exact: every E4M3 value is an f16), two
// instructions instead of decoding the byte's fields. kInRange: g meets block_reciprocals_in_range, so the
// reciprocal needs no branch, and a tile's blocks can be computed side by side.
template <bool kInRange = false>
__device__ __forceinline__ BlockEncoding encode_block_scale(float block_amax, GlobalScale g) {
  const float v = __fmul_rn(block_amax, g.encode_times_one_sixth);
  uint16_t pair;  // the E4M3 byte in the low half (cvt puts its second source there), 0 above
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(v));
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  const float sdec = __half2float(__ushort_as_half(static_cast<unsigned short>(halves & 0xFFFFu)));
  const float d = __fmul_rn(sdec, g.decode);
  const float r = fminf(kInRange ? reciprocal_rn_in_range(d) : __frcp_rn(d), kFltMax);
  return {static_cast<uint32_t>(pair), r};
}

// E2M1_RN (1.1) in software, for GPUs without the e2m1 cvt (sm_90a). These helpers are __host__ __device__
// so that tests/cuda/e2m1_exhaustive.cu can run the very same code over every fp32 bit pattern on the CPU.
//
// Adding kRoundMagic = 1.5 * 2^23 to a float in [0, 2^22) rounds it to an integer (to nearest, ties to
// even) held in the low mantissa bits of the sum. For a = |y| the code is rint(2a) on [0, 2),
// rint(a) + 2 on [2, 4) and rint(a / 2) + 4 above (saturated at 7); each candidate is at least the right
// code outside its own range, so the code is the minimum of the three and 7. The candidates are positive
// floats, whose order is that of their bit patterns, so one three-way integer minimum (VIMNMX3 on sm_90)
// and one more minimum replace three float minima; a NaN candidate has the largest pattern, so NaN gets 7,
// the code the hardware gives NaN.
constexpr float kRoundMagic = 12582912.0f;
constexpr uint32_t kRoundMagicBits = 0x4B400000u;  // its low 4 bits are 0: code and sign bit land there

__host__ __device__ __forceinline__ float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);  // no contraction or reassociation by nvcc
#else
  return std::fma(a, b, c);
#endif
}

__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

__host__ __device__ __forceinline__ float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

__host__ __device__ __forceinline__ uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

__host__ __device__ __forceinline__ float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// 1.0 if y < 0 (however tiny), else 0.0 (also for -0.0 and NaN): one FSET.BF on the device.
__host__ __device__ __forceinline__ float negative_flag(float y) {
#ifdef __CUDA_ARCH__
  float flag;
  asm("set.lt.f32.f32 %0, %1, 0f00000000;" : "=f"(flag) : "f"(y));
  return flag;
#else
  return y < 0.0f ? 1.0f : 0.0f;
#endif
}

// kRoundMagicBits + the E2M1 code of |y| before saturation: correct for |y| < 7, where the third candidate
// is at most 7.
__host__ __device__ __forceinline__ uint32_t e2m1_unsaturated_magnitude_bits(float y) {
  const float a = fabsf(y);
  const uint32_t c1 = float_bits(fma_rn(a, 2.0f, kRoundMagic));
  const uint32_t c2 = float_bits(fma_rn(a, 1.0f, kRoundMagic + 2.0f));
  const uint32_t c3 = float_bits(fma_rn(a, 0.5f, kRoundMagic + 4.0f));
  return __vimin3_u32(c1, c2, c3);
}

// kRoundMagicBits + the E2M1 code of y, the sign in bit 3 (set iff y < 0). The sign is added as the float
// 8 (exact: the sum stays below 2^24 + 2^23, where the spacing is 1).
__host__ __device__ __forceinline__ uint32_t e2m1_code_bits(float y) {
  const uint32_t magnitude = min(e2m1_unsaturated_magnitude_bits(y), kRoundMagicBits + 7u);
  return float_bits(fma_rn(negative_flag(y), 8.0f, bits_float(magnitude)));
}

// Codes are packed into words by adding each element's kRoundMagicBits + code in at its nibble (one
// IMAD); the magic's shifted copies sum to a constant that a word's start value cancels (modulo 2^32).
template <int kCodes>
constexpr uint32_t software_code_word_start() {
  uint32_t magics = 0u;
  for (int i = 0; i < kCodes; ++i) magics += kRoundMagicBits << (4 * i);
  return 0u - magics;
}

// The byte of two codes, `lo` in the low nibble, with both codes' magic: what the kernels add into a word
// at a byte position (e2m1_byte<false>).
__host__ __device__ __forceinline__ uint32_t e2m1_byte_software(float lo, float hi) {
  return e2m1_code_bits(lo) + (e2m1_code_bits(hi) << 4);
}

// Eight codes of fl(v[i] * r) packed into a word, element 0 in the low nibble, built the way the kernels
// build theirs (a byte of two codes at a time), so that tests/cuda/e2m1_exhaustive.cu checks that path.
__host__ __device__ __forceinline__ uint32_t e2m1_pack8_software(const float* v, float r) {
  uint32_t word = software_code_word_start<8>();
#pragma unroll
  for (int j = 0; j < 4; ++j) word += e2m1_byte_software(mul_rn(v[2 * j], r), mul_rn(v[2 * j + 1], r)) << (8 * j);
  return word;
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

// The byte of two codes, `lo` in the low nibble, to be added into a word at a byte position. The software
// byte carries the magic of both codes; a word of n codes starts at code_word_start<kHardwareCvt, n>().
template <bool kHardwareCvt>
__device__ __forceinline__ uint32_t e2m1_byte(float lo, float hi) {
  if constexpr (kHardwareCvt) {
    return e2m1_encode_pair_hardware(lo, hi);
  } else {
    return e2m1_byte_software(lo, hi);
  }
}

template <bool kHardwareCvt, int kCodes>
constexpr uint32_t code_word_start() {
  return kHardwareCvt ? 0u : software_code_word_start<kCodes>();
}

// kCodes (2, 4 or 8) codes of fl(v[i] * r) packed into the low bits of a word, element 2j in the low nibble
// of byte j.
template <bool kHardwareCvt, int kCodes>
__device__ __forceinline__ uint32_t encode_codes(const float* v, float r) {
  uint32_t word = code_word_start<kHardwareCvt, kCodes>();
#pragma unroll
  for (int j = 0; j < kCodes / 2; ++j)
    word += e2m1_byte<kHardwareCvt>(__fmul_rn(v[2 * j], r), __fmul_rn(v[2 * j + 1], r)) << (8 * j);
  return word;
}

// ---- The fast software encode (sm_90a, 16-bit inputs). Where a block meets fast_encode_ok (no element of
// |fl(x * r)| reaches 7, and no nonzero product can round to zero), three steps of e2m1_code_bits drop out:
//  - saturation, by the bound above;
//  - the sign flag: y = fma(x, r, +0) is fl(x * r) except that an exact zero product becomes +0, so its
//    sign bit is set exactly when fl(x * r) < 0 (no underflow to -0 by the bound on r), and the sign bits
//    of eight elements gather into one word by funnel shifts, one per element, applied with one LOP3;
//  - NaN never reaches it: a tile with a NaN amax is encoded by the exact path.
// tests/cuda/e2m1_exhaustive.cu compares encode_codes_fast with the exact encode on the CPU.

// The least r for which no nonzero element of InT times r rounds to zero: its smallest subnormal times r
// must exceed 2^-150 (bf16: 2^-133, fp16: 2^-24).
template <int kMinSubnormalExponent>
constexpr float fast_encode_min_inverse() {
  float r = 1.0f;
  for (int e = 0; e < 149 - kMinSubnormalExponent; ++e) r *= 0.5f;
  return r;
}

// Whether a block of amax `block_amax` and inverse scale r may take the fast encode. `&`, not `&&`: no
// branch, so that the kernels compute a tile's blocks side by side.
template <int kMinSubnormalExponent>
__host__ __device__ __forceinline__ bool fast_encode_ok(float block_amax, float r) {
  return (r >= fast_encode_min_inverse<kMinSubnormalExponent>()) & (mul_rn(block_amax, r) < 7.0f);
}

__host__ __device__ __forceinline__ float fast_encode_product(float x, float r) { return fma_rn(x, r, 0.0f); }

// Shifts `signs` up a nibble and brings in y's top four bits (its sign in bit 3): one SHF.
__host__ __device__ __forceinline__ uint32_t push_sign_nibble(uint32_t signs, float y) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(float_bits(y), signs, 4);
#else
  return (signs << 4) | (float_bits(y) >> 28);
#endif
}

constexpr uint32_t kSignNibbleBits = 0x88888888u;

// Eight codes of fl(v[i] * r) packed into a word, element 0 in the low nibble, for a block that meets
// fast_encode_ok.
__host__ __device__ __forceinline__ uint32_t encode_codes_fast(const float* v, float r) {
  uint32_t word = software_code_word_start<8>(), signs = 0u;
#pragma unroll
  for (int i = 7; i >= 0; --i) {  // from the top element, whose sign nibble is pushed first
    const float y = fast_encode_product(v[i], r);
    word += e2m1_unsaturated_magnitude_bits(y) << (4 * i);
    signs = push_sign_nibble(signs, y);
  }
  return word | (signs & kSignNibbleBits);
}

}  // namespace fp4gen
