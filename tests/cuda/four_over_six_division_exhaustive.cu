// divide_by_four_over_six_numerator (four_over_six.cuh), the division in 4over6's error, against __fdiv_rn(p,
// 1536) for every float p (both signs, every NaN, both infinities), compared as values (a zero's sign aside:
// the error takes |v - x| or (v - x)^2, which a zero's sign does not change) and as NaN-ness. Needs a GPU; run
// by tests/gpu/test_reciprocal_gpu.py. Prints a "<what>: <n> mismatches" line; exits nonzero on any.
#include <cstdio>
#include <cstdint>

#include "fp4gen/four_over_six.cuh"

__global__ void compare_divisions(unsigned long long* mismatches, unsigned int* first_mismatch) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; u <= 0xFFFFFFFFull; u += stride) {
    const float p = __uint_as_float(static_cast<uint32_t>(u));
    const float fast = fp4gen::divide_by_four_over_six_numerator(p);
    const float exact = __fdiv_rn(p, fp4gen::kFourOverSixNumerator);
    const bool same = isnan(exact) ? isnan(fast) : fast == exact;
    if (!same) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_mismatch, static_cast<unsigned int>(u));
    }
  }
}

int main() {
  unsigned long long* mismatches = nullptr;
  unsigned int* first = nullptr;
  cudaMallocManaged(&mismatches, sizeof(*mismatches));
  cudaMallocManaged(&first, sizeof(*first));
  *mismatches = 0;
  *first = 0xFFFFFFFFu;
  compare_divisions<<<132 * 16, 256>>>(mismatches, first);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  std::printf("divide_by_four_over_six_numerator vs __fdiv_rn over every float: %llu mismatches (first 0x%08x)\n",
              *mismatches, *first);
  return *mismatches == 0 ? 0 : 1;
}
