// Exhaustive CPU check of the sm_90a software E2M1 encode (fp4gen/nvfp4.cuh): the __host__ __device__
// helpers the kernel runs are run here on every fp32 bit pattern and compared with E2M1_RN written out
// as runtime/reference.py::e2m1_encode states it (spec 1.1); then the fast encode is compared with it for
// every bf16 and fp16 element and many inverse scales r that fast_encode_ok admits. Needs no GPU:
//   nvcc -std=c++17 -O2 --expt-relaxed-constexpr -Itemplates/include tests/cuda/e2m1_exhaustive.cu -o /tmp/e2m1_exhaustive && /tmp/e2m1_exhaustive
// (tests/test_e2m1_software.py does this.)
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4gen/elements.cuh"
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

// The value of a 16-bit element: bf16 is the top half of an fp32; fp16 is decoded field by field.
float bf16_value(uint32_t bits) { return from_bits(bits << 16); }
float fp16_value(uint32_t bits) {
  const uint32_t exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -24)
                          : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                           : std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  return bits & 0x8000u ? -magnitude : magnitude;
}

// encode_codes_fast against the reference codes of fl(x * r), for every non-NaN element of a 16-bit type
// (eight to a word, elements that fast_encode_ok refuses for r replaced by 0) and `trials` values of r
// from fast_encode_min_inverse up: random ones, and powers of two and their 1.5 multiples, which make
// ties (products exactly on an E2M1 rounding boundary) common.
template <int kMinSubnormalExponent>
uint64_t check_fast_encode(const char* name, float (*value)(uint32_t), std::mt19937& rng, int trials) {
  const float r_min = fp4gen::fast_encode_min_inverse<kMinSubnormalExponent>();
  uint64_t mismatches = 0, elements = 0;
  for (int t = 0; t < trials; ++t) {
    float r;
    if (t == 0) {
      r = r_min;
    } else if (t % 4 == 0) {
      r = std::ldexp(t % 8 == 0 ? 1.0f : 1.5f, static_cast<int>(rng() % 160) - (149 - kMinSubnormalExponent));
    } else {
      r = from_bits(rng() & 0x7FFFFFFFu);
    }
    if (!(r >= r_min) || std::isinf(r)) continue;
    for (uint32_t first = 0; first < 0x10000u; first += 8) {
      float v[8];
      uint32_t want = 0;
      for (int i = 0; i < 8; ++i) {
        const float x = value(first + i);
        v[i] = !std::isnan(x) && fp4gen::fast_encode_ok<kMinSubnormalExponent>(std::fabs(x), r) ? x : 0.0f;
        elements += v[i] == x;
        want |= reference_code(v[i] * r) << (4 * i);
      }
      const uint32_t got = fp4gen::encode_codes_fast(v, r);
      if (got != want && ++mismatches <= 10)
        std::printf("%s fast mismatch r=%a first=0x%04x got=0x%08x want=0x%08x\n", name, r, first, got, want);
    }
  }
  std::printf("encode_codes_fast (%s): %llu mismatching words, %llu elements admitted, %d values of r\n", name,
              static_cast<unsigned long long>(mismatches), static_cast<unsigned long long>(elements), trials);
  return mismatches;
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
  const uint64_t fast_mismatches =
      check_fast_encode<fp4gen::Element<__nv_bfloat16>::kMinSubnormalExponent>("bf16", bf16_value, rng, 3000) +
      check_fast_encode<fp4gen::Element<__half>::kMinSubnormalExponent>("fp16", fp16_value, rng, 3000);
  return mismatches == 0 && pack_mismatches == 0 && fast_mismatches == 0 ? 0 : 1;
}
