// Exhaustive CPU check of the sm_90a software E2M1 encode (fp4gen/nvfp4.cuh): the __host__ __device__
// helpers the kernel runs are run here on every fp32 bit pattern and compared with E2M1_RN written out
// as runtime/reference.py::e2m1_encode states it (spec 1.1); then the fast encode is compared with it for
// every bf16 and fp16 element and many inverse scales r that fast_encode_ok admits. Needs no GPU:
//   nvcc -std=c++17 -O2 --expt-relaxed-constexpr -Itemplates/include tests/cuda/e2m1_exhaustive.cu -o /tmp/e2m1_exhaustive && /tmp/e2m1_exhaustive
// (tests/test_e2m1_software.py does this.) The work is cut into fixed chunks, each with its own seed, which the
// CPU's threads share: the same cases are checked whatever the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fp4gen/elements.cuh"
#include "fp4gen/nvfp4.cuh"

namespace {

// The sum of check(c) over the chunks c in [0, chunks), the chunks taken in turn by every hardware thread.
template <class Check>
uint64_t sum_over_chunks(int chunks, Check check) {
  std::atomic<int> next{0};
  std::atomic<uint64_t> total{0};
  auto work = [&] {
    for (int c = next++; c < chunks; c = next++) total += check(c);
  };
  const int threads = static_cast<int>(std::max(1u, std::min(std::thread::hardware_concurrency(), 64u)));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();
  return total;
}

// Whether to print another mismatch: the first 20 of the program, whichever threads find them.
std::atomic<int> mismatches_printed{0};
bool print_mismatch() { return mismatches_printed++ < 20; }

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

// encode_codes_fast against the reference codes for one r: the mismatching words; adds the admitted elements.
template <int kMinSubnormalExponent>
uint64_t check_fast_encode_for(const char* name, float (*value)(uint32_t), float r, uint64_t* elements) {
  uint64_t mismatches = 0;
  for (uint32_t first = 0; first < 0x10000u; first += 8) {
    float v[8];
    uint32_t want = 0;
    for (int i = 0; i < 8; ++i) {
      const float x = value(first + i);
      v[i] = !std::isnan(x) && fp4gen::fast_encode_ok<kMinSubnormalExponent>(std::fabs(x), r) ? x : 0.0f;
      *elements += v[i] == x;
      want |= reference_code(v[i] * r) << (4 * i);
    }
    const uint32_t got = fp4gen::encode_codes_fast(v, r);
    if (got != want && ++mismatches && print_mismatch())
      std::printf("%s fast mismatch r=%a first=0x%04x got=0x%08x want=0x%08x\n", name, r, first, got, want);
  }
  return mismatches;
}

// encode_codes_fast against the reference codes of fl(x * r), for every non-NaN element of a 16-bit type
// (eight to a word, elements that fast_encode_ok refuses for r replaced by 0) and `trials` values of r
// from fast_encode_min_inverse up: random ones, and powers of two and their 1.5 multiples, which make
// ties (products exactly on an E2M1 rounding boundary) common. Chunk c of the trials draws from seed + c.
template <int kMinSubnormalExponent>
uint64_t check_fast_encode(const char* name, float (*value)(uint32_t), uint32_t seed, int trials) {
  const float r_min = fp4gen::fast_encode_min_inverse<kMinSubnormalExponent>();
  constexpr int kTrialsPerChunk = 25;
  std::atomic<uint64_t> admitted{0};
  const uint64_t mismatches = sum_over_chunks((trials + kTrialsPerChunk - 1) / kTrialsPerChunk, [&](int chunk) {
    std::mt19937 rng(seed + chunk);
    uint64_t chunk_mismatches = 0, elements = 0;
    for (int t = chunk * kTrialsPerChunk; t < std::min(trials, (chunk + 1) * kTrialsPerChunk); ++t) {
      float r;
      if (t == 0) {
        r = r_min;
      } else if (t % 4 == 0) {
        r = std::ldexp(t % 8 == 0 ? 1.0f : 1.5f, static_cast<int>(rng() % 160) - (149 - kMinSubnormalExponent));
      } else {
        r = from_bits(rng() & 0x7FFFFFFFu);
      }
      if (r >= r_min && !std::isinf(r))
        chunk_mismatches += check_fast_encode_for<kMinSubnormalExponent>(name, value, r, &elements);
    }
    admitted += elements;
    return chunk_mismatches;
  });
  std::printf("encode_codes_fast (%s): %llu mismatching words, %llu elements admitted, %d values of r\n", name,
              static_cast<unsigned long long>(mismatches), static_cast<unsigned long long>(admitted.load()), trials);
  return mismatches;
}

}  // namespace

int main() {
  // every fp32 pattern, in 256 chunks of 2^24
  const uint64_t mismatches = sum_over_chunks(256, [](int chunk) {
    uint64_t chunk_mismatches = 0;
    for (uint64_t u = uint64_t(chunk) << 24; u < (uint64_t(chunk) + 1) << 24; ++u) {
      const float y = from_bits(static_cast<uint32_t>(u));
      const uint32_t got = fp4gen::e2m1_code_bits(y);
      const uint32_t want = reference_code(y);
      if (((got & ~0xFu) != fp4gen::kRoundMagicBits || (got & 0xFu) != want) && ++chunk_mismatches &&
          print_mismatch())
        std::printf("mismatch y=0x%08x got=0x%08x want=%u\n", static_cast<uint32_t>(u), got, want);
    }
    return chunk_mismatches;
  });
  std::printf("e2m1_code_bits: %llu mismatches over all 2^32 fp32 patterns\n",
              static_cast<unsigned long long>(mismatches));

  // Packing: eight elements times r, element i in nibble i, against the reference codes of fl(v[i] * r).
  const int kTrials = 2000000, kPackChunks = 40;
  const uint64_t pack_mismatches = sum_over_chunks(kPackChunks, [](int chunk) {
    std::mt19937 rng(7 + chunk);
    uint64_t chunk_mismatches = 0;
    for (int t = 0; t < kTrials / kPackChunks; ++t) {
      float v[8];
      for (float& e : v) e = from_bits(rng());
      const float r = t % 2 ? from_bits(rng() & 0x7FFFFFFFu)
                            : std::ldexp(1.0f + (rng() % 1024) / 1024.0f, static_cast<int>(rng() % 16) - 8);
      uint32_t want = 0;
      for (int i = 0; i < 8; ++i) want |= reference_code(v[i] * r) << (4 * i);
      if (fp4gen::e2m1_pack8_software(v, r) != want) ++chunk_mismatches;
    }
    return chunk_mismatches;
  });
  std::printf("e2m1_pack8_software: %llu mismatches over %d random words\n",
              static_cast<unsigned long long>(pack_mismatches), kTrials);
  const uint64_t fast_mismatches =
      check_fast_encode<fp4gen::Element<__nv_bfloat16>::kMinSubnormalExponent>("bf16", bf16_value, 1000, 3000) +
      check_fast_encode<fp4gen::Element<__half>::kMinSubnormalExponent>("fp16", fp16_value, 2000, 3000);
  return mismatches == 0 && pack_mismatches == 0 && fast_mismatches == 0 ? 0 : 1;
}
