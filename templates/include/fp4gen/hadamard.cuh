// The 16-point random Hadamard transform of one group of 16 values (docs/numerics.md, "Random Hadamard
// transform"), in the order runtime/hadamard.py defines, so both backends give the same bytes:
//   u_j = fl(g_j * s_j / 4), s_j = -1 where bit j of 0xD7E8 is set;
//   for h = 1, 2, 4, 8 and every j with bit h clear: (u_j, u_{j+h}) <- (fl(u_j + u_{j+h}), fl(u_j - u_{j+h}));
//   g'_k = bf16_RNE(u_k), and a NaN u_k (a NaN input, or +Inf meeting -Inf) is the quiet NaN 0x7FC0 whatever
//   its payload, so that the amaxes' bit patterns agree across backends.
// Every input dtype ends in bf16 values (returned widened to fp32, exactly).
#pragma once

#include <cuda_bf16.h>

namespace fp4gen {

constexpr uint32_t kRhtSignMask = 0xD7E8u;

__device__ __forceinline__ void hadamard16_to_bf16(float (&v)[16]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) v[j] = __fmul_rn(v[j], ((kRhtSignMask >> j) & 1u) ? -0.25f : 0.25f);
#pragma unroll
  for (int h = 1; h < 16; h *= 2) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (!(j & h)) {
        const float low = v[j], high = v[j + h];
        v[j] = __fadd_rn(low, high), v[j + h] = __fsub_rn(low, high);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j)
    v[j] = isnan(v[j]) ? __uint_as_float(0x7FC00000u) : __bfloat162float(__float2bfloat16_rn(v[j]));
}

}  // namespace fp4gen
