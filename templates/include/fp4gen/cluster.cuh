// Thread block cluster helpers (sm_90 and later): the CTA's rank in its cluster and the cluster's size, a word
// of another CTA's shared memory (distributed shared memory), and the cluster barrier's two halves.
#pragma once

#include <cstdint>

namespace fp4gen {

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ uint32_t cluster_ctas() {
  uint32_t ctas;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(ctas));
  return ctas;
}

// The word of CTA `rank`'s shared memory at the address `local` has in this CTA (ld.shared::cluster at the
// mapped address).
__device__ __forceinline__ uint32_t load_cluster_shared(const uint32_t* local, uint32_t rank) {
  uint32_t address, value;
  const uint32_t shared = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(address) : "r"(shared), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(value) : "r"(address) : "memory");
  return value;
}
__device__ __forceinline__ float load_cluster_shared(const float* local, uint32_t rank) {
  return __uint_as_float(load_cluster_shared(reinterpret_cast<const uint32_t*>(local), rank));
}

// arrive releases this thread's earlier shared-memory writes to the cluster; wait acquires every CTA's.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

}  // namespace fp4gen
