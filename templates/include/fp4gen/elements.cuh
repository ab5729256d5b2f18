// Input elements of the quantize-side kernels (bf16, fp16, fp32), read as 16-byte vectors.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fp4gen {

template <class InT>
struct Element;

template <>
struct Element<__nv_bfloat16> {
  static constexpr int kPerVector = 8;
  static constexpr uint32_t kAbsMask = 0x7FFFu;
  static constexpr int kMinSubnormalExponent = 133;  // the least nonzero |x| is 2^-133
  // element i of 16-bit elements packed in words: the odd one is its word with the low half cleared (one
  // LOP3, where nvcc otherwise extracts the half with PRMT and then shifts it)
  static __device__ __forceinline__ float word_element_to_float(const uint32_t* words, int i) {
    const uint32_t w = words[i / 2];
    return __uint_as_float(i % 2 ? w & 0xFFFF0000u : w << 16);
  }
  // |x| bits, widened to fp32 bits: order-preserving, so NaN > Inf > finite under integer max
  static __device__ __forceinline__ uint32_t abs_bits_as_float_bits(uint32_t abs_bits) { return abs_bits << 16; }
};

template <>
struct Element<__half> {
  static constexpr int kPerVector = 8;
  static constexpr uint32_t kAbsMask = 0x7FFFu;
  static constexpr int kMinSubnormalExponent = 24;
  static __device__ __forceinline__ float word_element_to_float(const uint32_t* words, int i) {
    return __half2float(reinterpret_cast<const __half*>(words)[i]);
  }
  static __device__ __forceinline__ uint32_t abs_bits_as_float_bits(uint32_t abs_bits) {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(abs_bits))));
  }
};

template <>
struct Element<float> {
  static constexpr int kPerVector = 4;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
  static constexpr int kMinSubnormalExponent = 149;
  static __device__ __forceinline__ float word_element_to_float(const uint32_t* words, int i) {
    return __uint_as_float(words[i]);
  }
  static __device__ __forceinline__ uint32_t abs_bits_as_float_bits(uint32_t abs_bits) { return abs_bits; }
};

// A load with acquire semantics at GPU scope: what the writer of *p wrote before releasing it (a fence, then its
// write of *p) is visible to the loads that follow.
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// |v|'s bit pattern (an unsigned maximum of these is a NaN-propagating maximum of |v|, see warp_max_bits)
__device__ __forceinline__ uint32_t float_abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// The maximum of `bits` over the warp's 32 lanes, in every lane (unsigned: on |x| bit patterns NaN > Inf >
// every finite value, so the maximum propagates NaN).
__device__ __forceinline__ uint32_t warp_max_bits(uint32_t bits) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) bits = max(bits, __shfl_xor_sync(0xFFFFFFFFu, bits, offset));
  return bits;
}

// The NaN-propagating max of two words of |x| values (sign bits clear), packed as the input: two 16-bit
// elements per word (one packed bf16x2/f16x2 max with .NaN, so NaN wins) or one fp32 (an integer max of the
// bit patterns, where NaN > Inf > every finite value).
template <class InT>
__device__ __forceinline__ uint32_t abs_word_max(uint32_t a, uint32_t b) {
  if constexpr (std::is_same_v<InT, float>) {
    return max(a, b);
  } else {
    using Pair = std::conditional_t<std::is_same_v<InT, __half>, __half2, __nv_bfloat162>;
    const Pair m = __hmax2_nan(*reinterpret_cast<const Pair*>(&a), *reinterpret_cast<const Pair*>(&b));
    return *reinterpret_cast<const uint32_t*>(&m);
  }
}

// NaN-propagating max of |x| over the elements packed in 32-bit words: abs_word_max with `word`'s sign bits
// cleared.
template <class InT>
__device__ __forceinline__ uint32_t word_abs_max(uint32_t acc, uint32_t word) {
  constexpr uint32_t kWordAbsMask = sizeof(InT) == 2 ? 0x7FFF7FFFu : Element<InT>::kAbsMask;
  return abs_word_max<InT>(acc, word & kWordAbsMask);
}

// word_abs_max over the four words of a 16-byte vector.
template <class InT>
__device__ __forceinline__ uint32_t vector_abs_max(uint32_t acc, const uint4& v) {
  return word_abs_max<InT>(word_abs_max<InT>(word_abs_max<InT>(word_abs_max<InT>(acc, v.x), v.y), v.z), v.w);
}

// The |x| bits of element i (0 or 1) of an accumulator word.
template <class InT>
__device__ __forceinline__ uint32_t word_element(uint32_t word, int i) {
  return sizeof(InT) == 2 ? (word >> (16 * i)) & 0xFFFFu : word;
}

// max.xorsign.abs on two 16-bit elements at once (HMNMX2 with |a|, |b| and no .NaN): each half is the
// larger magnitude of its lane, the non-NaN operand where one is NaN; its sign bit is garbage.
template <class InT>
__device__ __forceinline__ uint32_t abs_max_xorsign(uint32_t a, uint32_t b) {
  static_assert(sizeof(InT) == 2, "packed max is for 16-bit elements");
  uint32_t m;
  if constexpr (std::is_same_v<InT, __half>) {
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  } else {
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  }
  return m;
}

// Half i of an abs_max_xorsign result as the amax of the elements that went into it: the mask drops the
// garbage sign, and fmaxf with 0 turns the NaN left where every element was NaN into 0. i may differ
// between lanes, so the half is selected by a shift (indexing the halves would go through local memory).
template <class InT>
__device__ __forceinline__ float xorsign_half_to_amax(uint32_t m, int i) {
  const uint32_t abs_bits = (m >> (16 * i)) & Element<InT>::kAbsMask;
  return fmaxf(__uint_as_float(Element<InT>::abs_bits_as_float_bits(abs_bits)), 0.0f);
}

// The amax of both halves of an abs_max_xorsign result, as xorsign_half_to_amax makes each: one more packed
// max with the halves swapped leaves their maximum in both (a NaN half loses to the other), then one half
// is read. Two instructions fewer than reading both halves and taking the float maximum.
template <class InT>
__device__ __forceinline__ float xorsign_pair_to_amax(uint32_t m) {
  return xorsign_half_to_amax<InT>(abs_max_xorsign<InT>(m, __byte_perm(m, 0, 0x1032)), 1);
}

// A kTile x kTile tile of x from (row0, col0), widened to fp32 into shared memory by a CTA of kThreads
// threads (16-byte vector loads; cols % 16 == 0, so a vector is wholly inside or outside; outside reads as 0).
// Callers synchronize before reading it.
template <class InT, int kTile, int kThreads>
__device__ __forceinline__ void stage_tile_fp32(const InT* __restrict__ x, int64_t x_row_stride, int64_t rows,
                                                int64_t cols, int64_t row0, int64_t col0, float (*tile)[kTile + 1]) {
  constexpr int kVec = Element<InT>::kPerVector, kVecsPerRow = kTile / kVec;
  for (int i = threadIdx.x; i < kTile * kVecsPerRow; i += kThreads) {
    const int r = i / kVecsPerRow, cv = i % kVecsPerRow;
    const int64_t row = row0 + r, col = col0 + cv * kVec;
    const uint4 vec = (row < rows && col < cols) ? *reinterpret_cast<const uint4*>(x + row * x_row_stride + col)
                                                 : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int e = 0; e < kVec; ++e) tile[r][cv * kVec + e] = Element<InT>::word_element_to_float(&vec.x, e);
  }
}

}  // namespace fp4gen
