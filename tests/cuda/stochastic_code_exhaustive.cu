// encode_codes_stochastic (stochastic.cuh), the kernels' stochastic E2M1 step, against the rule as defined
// (with its division, floor and grid lookup) for every float y (both signs, every NaN, both infinities) and
// every random byte, in each of the eight element positions of a code word (r = 1, so fl(y * r) = y). Needs a
// GPU; run by tests/gpu/test_reciprocal_gpu.py. Prints a "<what>: <n> mismatches" line; exits nonzero on any.
#include <cstdio>
#include <cstdint>

#include "fp4gen/stochastic.cuh"

// The rule (runtime/stochastic.py): a = |y|, step(v) = 2 if v >= 4, 1 if v >= 2, else 0.5, u = byte / 256,
// t = fl(a + u * step(a)), q = min(floor(t / step(t)) * step(t), 6); the code of q, sign bit iff y < 0.
__device__ uint32_t rule_code(float y, uint32_t byte) {
  auto step_of = [](float v) { return v >= 4.0f ? 2.0f : (v >= 2.0f ? 1.0f : 0.5f); };
  const float a = fabsf(y);
  const float u = static_cast<float>(byte) / 256.0f;
  const float t = __fadd_rn(a, __fmul_rn(u, step_of(a)));
  const float step_t = step_of(t);
  const float q = fminf(__fmul_rn(floorf(__fdiv_rn(t, step_t)), step_t), 6.0f);  // fminf: NaN gives 6
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  uint32_t code = 0;
  for (uint32_t c = 0; c < 8; ++c)
    if (grid[c] == q) code = c;
  return code | (y < 0.0f ? 8u : 0u);
}

__global__ void compare_codes(unsigned long long* mismatches, unsigned long long* first_mismatch) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t u = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; u <= 0xFFFFFFFFull; u += stride) {
    const float y = __uint_as_float(static_cast<uint32_t>(u));
    const float v[8] = {y, y, y, y, y, y, y, y};
    for (uint32_t byte = 0; byte < 256; ++byte) {
      const uint32_t want = rule_code(y, byte), word = byte * 0x01010101u;
      const uint32_t codes = fp4gen::encode_codes_stochastic(v, 1.0f, make_uint2(word, word));
      if (codes != want * 0x11111111u) {
        atomicAdd(mismatches, 1ull);
        atomicMin(first_mismatch, (u << 8) | byte);
      }
    }
  }
}

int main() {
  unsigned long long *mismatches = nullptr, *first = nullptr;
  cudaMallocManaged(&mismatches, sizeof(*mismatches));
  cudaMallocManaged(&first, sizeof(*first));
  *mismatches = 0;
  *first = ~0ull;
  compare_codes<<<132 * 16, 256>>>(mismatches, first);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  std::printf("encode_codes_stochastic vs the rule over every float and byte: %llu mismatches (first y 0x%08llx, "
              "byte %llu)\n", *mismatches, *first >> 8, *first & 0xFF);
  return *mismatches == 0 ? 0 : 1;
}
