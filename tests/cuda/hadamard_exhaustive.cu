// hadamard16_fp32<true> (hadamard.cuh: the first butterfly stage as fused multiply-adds, for values widened from
// bf16 or fp16) against hadamard16_fp32<false> (every value quartered first, then the four stages: the order the
// reference defines), run on the CPU with the very header code. Every bf16 and every fp16 bit pattern (NaN,
// infinities, zeros of both signs, subnormals) takes each of a vector's 16 places, beside partners drawn from all
// patterns, from a narrow exponent range (sums that cancel) and from the extremes; the outputs must be the same
// bits (any NaN matching any NaN). Then a control that the comparison can fail: fp32 values whose quarter rounds
// (fp32 subnormals) must give some differing outputs, which is why fp32 inputs keep the quartering first. Prints
// one "<what>: <n> mismatches" line each; exits nonzero unless the 16-bit lines are 0 and the control's is not.
#include <cstdint>
#include <cstdio>
#include <random>

#include "fp4gen/hadamard.cuh"

namespace {

using fp4gen::bits_float;
using fp4gen::float_bits;

float bf16_value(uint32_t pattern) { return bits_float(pattern << 16); }

float fp16_value(uint32_t pattern) {
  __half_raw raw;
  raw.x = static_cast<unsigned short>(pattern);
  return __half2float(__half(raw));
}

bool same(float a, float b) { return (a != a && b != b) || float_bits(a) == float_bits(b); }

// A partner pattern: any 16 bits, or one near `pattern`'s magnitude (cancellation), or an extreme.
uint32_t partner(std::mt19937& rng, uint32_t pattern) {
  static const uint32_t kExtremes[] = {0x0000u, 0x8000u, 0x0001u, 0x8001u, 0x7F7Fu, 0xFF7Fu, 0x7BFFu, 0xFBFFu,
                                       0x7C00u, 0xFC00u, 0x7F80u, 0xFF80u, 0x7FC0u, 0x03FFu, 0x0080u, 0x8080u};
  switch (rng() % 4) {
    case 0: return rng() & 0xFFFFu;
    case 1: return (pattern & 0xFF00u) | (rng() & 0xFFu);
    case 2: return (pattern ^ 0x8000u) & 0xFFFFu;
    default: return kExtremes[rng() % 16];
  }
}

template <class Value>
uint64_t compare_16_bit(const char* name, Value value) {
  std::mt19937 rng(2026);
  uint64_t mismatches = 0, vectors = 0;
  for (uint32_t pattern = 0; pattern <= 0xFFFFu; ++pattern) {
    for (int trial = 0; trial < 16; ++trial) {  // the pattern in place `trial`, partners everywhere else
      float a[16], b[16];
      for (int j = 0; j < 16; ++j) a[j] = b[j] = value(j == trial ? pattern : partner(rng, pattern));
      fp4gen::hadamard16_fp32<true>(a);
      fp4gen::hadamard16_fp32<false>(b);
      for (int j = 0; j < 16; ++j) mismatches += same(a[j], b[j]) ? 0 : 1;
      ++vectors;
    }
  }
  std::printf("%s: %llu vectors, %llu mismatches\n", name, static_cast<unsigned long long>(vectors),
              static_cast<unsigned long long>(mismatches));
  return mismatches;
}

}  // namespace

int main() {
  const uint64_t bf16 = compare_16_bit("bf16", bf16_value);
  const uint64_t fp16 = compare_16_bit("fp16", fp16_value);
  // control: fp32 subnormals, those of the even places with quarters that are ties (mantissa 2 mod 4): rounded
  // before the first sum (to even), they can differ from the sum rounded once (to even of the sum) when the odd
  // place's quarter rounds to an odd multiple of 2^-149
  std::mt19937 rng(7);
  uint64_t control = 0;
  for (int trial = 0; trial < 100000; ++trial) {
    float a[16], b[16];
    for (int j = 0; j < 16; ++j) a[j] = b[j] = bits_float(j % 2 ? rng() & 0x807FFFFFu : (rng() & 0x807FFFFCu) | 2u);
    fp4gen::hadamard16_fp32<true>(a);
    fp4gen::hadamard16_fp32<false>(b);
    for (int j = 0; j < 16; ++j) control += same(a[j], b[j]) ? 0 : 1;
  }
  std::printf("fp32 subnormals (control, expected to differ): %llu mismatches\n",
              static_cast<unsigned long long>(control));
  return bf16 == 0 && fp16 == 0 && control > 0 ? 0 : 1;
}
