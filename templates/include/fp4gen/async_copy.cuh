// cp.async (sm_80+) helpers: global -> shared copies that complete in the background, so a CTA can
// load its next tile while it encodes the current one.
#pragma once

#include <cstdint>

namespace fp4gen {

// 16 bytes; when `valid` is false nothing is read and the destination is zero-filled.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 16 : 0)
               : "memory");
}

// cp_async_16 for a streamed input; kEvictFirst: with an evict_first L2 cache policy, as load_streaming's
// (quantize.cuh), so that lines another kernel left in L2 stay there until this one reads them.
template <bool kEvictFirst>
__device__ __forceinline__ void cp_async_16_streaming(void* smem_dst, const void* gmem_src, bool valid) {
  if constexpr (kEvictFirst) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
    asm volatile(
        "{\n .reg .b64 policy;\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        " cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, policy;\n}\n" ::"r"(dst),
        "l"(gmem_src), "r"(valid ? 16 : 0)
        : "memory");
  } else {
    cp_async_16(smem_dst, gmem_src, valid);
  }
}

// 4 bytes, through L1 (cp.async.cg only moves 16); `valid` false zero-fills.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace fp4gen
