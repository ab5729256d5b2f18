// Exhaustive CPU check of the sm_90a software E2M1 encode (fp4gen/nvfp4.cuh): the __host__ __device__
// helpers the kernel runs are run here on every fp32 bit pattern and compared with E2M1_RN written out
// as runtime/reference.py::e2m1_encode states it (spec 1.1). Needs no GPU:
//   nvcc -std=c++17 -O2 -Itemplates/include tests/cuda/e2m1_exhaustive.cu -o /tmp/e2m1_exhaustive && /tmp/e2m1_exhaustive
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "fp4gen/nvfp4.cuh"

namespace {

float from_bits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// reference.py::e2m1_encode, element by element: the step of the binade, round half to even, clamp to 6,
// value -> code, NaN -> 7, sign bit iff y < 0.
uint32_t reference_code(float y) {
  if (std::isnan(y)) return 7u;
  const float a = std::fabs(y);
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float v = std::fmin(std::nearbyint(a / step) * step, 6.0f);  // default rounding mode: to nearest even
  const uint32_t code = v < 2.0f ? static_cast<uint32_t>(v * 2.0f)
                        : v < 4.0f ? static_cast<uint32_t>(v + 2.0f)
                        : v == 4.0f ? 6u : 7u;
  return code | (y < 0.0f ? 8u : 0u);
}

}  // namespace

int main() {
  uint64_t mismatches = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; ++u) {
    const float y = from_bits(static_cast<uint32_t>(u));
    const uint32_t got = fp4gen::e2m1_code_bits(y);
    const uint32_t want = reference_code(y);
    if ((got & ~0xFu) != fp4gen::kRoundMagicBits || (got & 0xFu) != want) {
      if (++mismatches <= 10) std::printf("mismatch y=0x%08x got=0x%08x want=%u\n", static_cast<uint32_t>(u), got, want);
    }
  }
  std::printf("e2m1_code_bits: %llu mismatches over all 2^32 fp32 patterns\n",
              static_cast<unsigned long long>(mismatches));

  // Packing: eight elements times r, element i in nibble i, against the reference codes of fl(v[i] * r).
  std::mt19937 rng(7);
  uint64_t pack_mismatches = 0;
  const int kTrials = 2000000;
  for (int t = 0; t < kTrials; ++t) {
    float v[8];
    for (float& e : v) e = from_bits(rng());
    const float r = t % 2 ? from_bits(rng() & 0x7FFFFFFFu) : std::ldexp(1.0f + (rng() % 1024) / 1024.0f, static_cast<int>(rng() % 16) - 8);
    uint32_t want = 0;
    for (int i = 0; i < 8; ++i) want |= reference_code(v[i] * r) << (4 * i);
    if (fp4gen::e2m1_pack8_software(v, r) != want) ++pack_mismatches;
  }
  std::printf("e2m1_pack8_software: %llu mismatches over %d random words\n",
              static_cast<unsigned long long>(pack_mismatches), kTrials);
  return mismatches == 0 && pack_mismatches == 0 ? 0 : 1;
}
