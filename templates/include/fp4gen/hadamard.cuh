// The 16-point random Hadamard transform of one group of 16 values (docs/numerics.md, "Random Hadamard
// transform"), in the order runtime/hadamard.py defines, so both backends give the same bytes:
//   u_j = fl(g_j * s_j / 4), s_j = -1 where bit j of 0xD7E8 is set;
//   for h = 1, 2, 4, 8 and every j with bit h clear: (u_j, u_{j+h}) <- (fl(u_j + u_{j+h}), fl(u_j - u_{j+h}));
//   g'_k = bf16_RNE(u_k), and a NaN u_k (a NaN input, or +Inf meeting -Inf) is the quiet NaN 0x7FC0 whatever
//   its payload, so that the amaxes' bit patterns agree across backends.
// Every input dtype ends in bf16 values.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

#include "fp4gen/elements.cuh"
#include "fp4gen/nvfp4.cuh"

namespace fp4gen {

constexpr uint32_t kRhtSignMask = 0xD7E8u;

// The transform in fp32 (u after the four butterfly stages), before the rounding to bf16. __host__ too, so that
// tests/cuda/hadamard_exhaustive.cu runs this very code on the CPU.
// kExactQuarters: every v[j] is a 16-bit value widened, so u_j = v[j] * (+-1/4) is exact in fp32 (bf16's least
// subnormal, 2^-133, gives 2^-135). Then the first stage takes u_j as the product of an fma, u_j + u_{j+1} =
// fma(v[j], +-1/4, u_{j+1}) and u_j - u_{j+1} = fma(v[j], +-1/4, -u_{j+1}): rounded once, as the sum of the exact
// u_j, so the same values with half the multiplies. (An fp32 input's quarter may round, in the subnormal range.)
template <bool kExactQuarters = false>
__host__ __device__ __forceinline__ void hadamard16_fp32(float (&v)[16]) {
  auto quarter = [](int j) { return ((kRhtSignMask >> j) & 1u) ? -0.25f : 0.25f; };
  if constexpr (kExactQuarters) {
#pragma unroll
    for (int j = 0; j < 16; j += 2) {
      const float low = v[j], high = mul_rn(v[j + 1], quarter(j + 1));
      v[j] = fma_rn(low, quarter(j), high), v[j + 1] = fma_rn(low, quarter(j), -high);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = mul_rn(v[j], quarter(j));
  }
#pragma unroll
  for (int h = kExactQuarters ? 2 : 1; h < 16; h *= 2) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (!(j & h)) {
        const float low = v[j], high = v[j + h];
        v[j] = add_rn(low, high), v[j + h] = sub_rn(low, high);
      }
    }
  }
}

// The transform of values of an InT input widened to fp32, each returned as its bf16 widened to fp32 (exactly),
// NaN as 0x7FC00000. A 16-bit InT takes the fused first stage (kExactQuarters).
template <class InT>
__device__ __forceinline__ void hadamard16_to_bf16(float (&v)[16]) {
  hadamard16_fp32<sizeof(InT) == 2>(v);
#pragma unroll
  for (int j = 0; j < 16; ++j)
    v[j] = isnan(v[j]) ? __uint_as_float(0x7FC00000u) : __bfloat162float(__float2bfloat16_rn(v[j]));
}

// Per-half unsigned maximum of two words of 16-bit patterns (one instruction on sm_90).
__device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
  uint32_t m;
  asm("max.u16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  return m;
}

// Word w (0-3) of a 16-byte vector.
__device__ __forceinline__ uint32_t& vector_word(uint4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }
__device__ __forceinline__ uint32_t vector_word(const uint4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }

// Two fp32 values rounded to bf16 (RNE) and packed, `low` in the low half: one conversion instruction. A NaN
// becomes some bf16 NaN (the hardware's; callers that store NaN bits canonicalize them).
__device__ __forceinline__ uint32_t pack_bf16x2(float low, float high) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(low, high);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The transform of the two 16-bit columns in word w of a patch (16 rows x one 16-byte vector: patch[i] is row
// i), side by side, packed as bf16 pairs by one cvt each: f(k, word) gets row k's transformed word.
template <class InT, class F>
__device__ __forceinline__ void hadamard_column_pair(const uint4 (&patch)[16], int w, F&& f) {
  static_assert(sizeof(InT) == 2, "two 16-bit columns a word");
  float low[16], high[16];
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const uint32_t word = vector_word(patch[k], w);
    low[k] = Element<InT>::word_element_to_float(&word, 0), high[k] = Element<InT>::word_element_to_float(&word, 1);
  }
  hadamard16_fp32<true>(low), hadamard16_fp32<true>(high);
#pragma unroll
  for (int k = 0; k < 16; ++k) f(k, pack_bf16x2(low[k], high[k]));
}

// The transform of every column of a quantize lane's patch, in place. 16-bit inputs are left as bf16 pairs
// (two columns a word, as the input was packed), fp32 inputs as fp32 words holding bf16 values;
// HadamardPatchElement names the type. NaN is left as whatever NaN the conversion gives: the codes and block
// scales do not depend on a NaN's bits.
template <class InT>
using HadamardPatchElement = std::conditional_t<sizeof(InT) == 2, __nv_bfloat16, float>;

template <class InT>
__device__ __forceinline__ void hadamard_patch(uint4 (&patch)[16]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (sizeof(InT) == 2) {
      hadamard_column_pair<InT>(patch, w, [&](int k, uint32_t word) { vector_word(patch[k], w) = word; });
    } else {
      float v[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) v[k] = __uint_as_float(vector_word(patch[k], w));
      hadamard16_fp32(v);
#pragma unroll
      for (int k = 0; k < 16; ++k) vector_word(patch[k], w) = __float_as_uint(__bfloat162float(__float2bfloat16_rn(v[k])));
    }
  }
}

// The largest |v| of a patch that hadamard_patch<InT> transformed, as fp32 bits (NaN > Inf > finite under
// integer max), any NaN as 0x7FC00000.
template <class InT>
__device__ __forceinline__ uint32_t transformed_patch_abs_max_bits(const uint4 (&patch)[16]) {
  uint32_t m = 0u;
#pragma unroll
  for (int k = 0; k < 16; ++k) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (sizeof(InT) == 2) {
        m = max_u16x2(m, vector_word(patch[k], w) & 0x7FFF7FFFu);  // bf16 pairs
      } else {
        m = max(m, vector_word(patch[k], w) & 0x7FFFFFFFu);
      }
    }
  }
  if constexpr (sizeof(InT) == 2) m = max(m & 0xFFFFu, m >> 16) << 16;
  return m > 0x7F800000u ? 0x7FC00000u : m;
}

}  // namespace fp4gen
