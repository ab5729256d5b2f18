// Hopper NVFP4 GEMM over scratch operands (docs/numerics.md, how Hopper runs NVFP4): one library call
// dequantizes both packed operands to their block-scaled values (E2M1 * E4M3, without the second-level amax)
// times 2^-14, exact in fp16, into fp16 scratch in the caller's workspace (fused_wgmma::dequantize_rows: both
// operands in the same order within each 16-element block, so every dot product is unchanged), then a CUTLASS
// SM90 fp16 TMA warp-specialized GEMM accumulates in fp32, and the bilateral epilogue (bilateral_epilogue.hpp)
// applies alpha * row_amax[i] * col_amax[j], alpha = fl(1 / 2688^2) from the caller times 2^28 (the operands'
// two 2^-14 factors: an exact power of two), plus beta * C. (The copies in the same call, not two calls of
// the dequantize library before it: each library call costs host time.)
// Why fp16 rather than bf16 copies: the fp16 bits of e2m1 * 2^-14 are the code's bits moved into place, and one
// fp16 multiplication by the scale finishes the value, where a bf16 copy needs fp32 arithmetic an element (see
// dequantize.cuh). The GEMM itself runs at the same rate in either type.
#pragma once

// CUTLASS's SM90 GEMM kernels wait for the kernel before them (griddepcontrol.wait, before their first load of
// what it wrote) only when built with this: here the GEMM launches as the programmatic dependent of the
// operands' copy, so its launch and prologue overlap the copy's end. It must come before any CUTLASS header.
#ifndef CUTLASS_ENABLE_GDC_FOR_SM90
#define CUTLASS_ENABLE_GDC_FOR_SM90 1
#endif

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "fp4gen/abi.h"
#include "fp4gen/cutlass_run.hpp"
#include "fp4gen/bilateral_epilogue.hpp"
#include "fp4gen/gemm_fused_wgmma.cuh"  // fused_wgmma::dequantize_two_operands

#if defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "the GEMM launches as a programmatic dependent: its kernel must wait for the copy (CUTLASS_GDC_ENABLED)"
#endif

namespace fp4gen {

template <class ElementD_, int kTileM, int kTileN, int kTileK, bool kPingpong, int kClusterM, int kClusterN>
struct Sm90BilateralGemm {
  using ElementAB = cutlass::half_t;
  using ElementD = ElementD_;
  using ElementC = ElementD_;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  // CTAs of a cluster along M share B's tile, along N A's: TMA multicasts it to all of them from one L2 read
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using KernelSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB), kAlignCD = 16 / sizeof(ElementD);
  // 2^28: the two fp16 operands' 2^-14 factors (fused_gemm::decode8), undone through alpha
  static constexpr float kAlphaUnscale = 268435456.0f;

  using Epilogue = BilateralEpilogue<TileShape, ElementD>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor, kAlignCD,
      ElementD, cutlass::layout::RowMajor, kAlignCD, EpilogueSchedule, typename Epilogue::Tree>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cutlass::layout::RowMajor, kAlignAB, ElementAB,
      cutlass::layout::ColumnMajor, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // A [M, K] and B [N, K]: the contiguous fp16 scratch copies (a stand-in address where only the shape matters);
  // C, D [M, N] row-major (ldc, ldd).
  static typename Gemm::Arguments arguments(const void* a, const void* b, const void* c, void* d,
                                            const float* row_amax, const float* col_amax, const float* bias,
                                            float alpha, float beta, int64_t m, int64_t n, int64_t k, int64_t ldc,
                                            int64_t ldd, int64_t row_is_vector, int64_t col_is_vector) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideC = typename Gemm::GemmKernel::StrideC;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    StrideA stride_a{k, cute::_1{}, int64_t(0)};
    StrideB stride_b{k, cute::_1{}, int64_t(0)};
    StrideC stride_c{ldc, cute::_1{}, int64_t(0)};
    StrideD stride_d{ldd, cute::_1{}, int64_t(0)};
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1},
        {static_cast<const ElementAB*>(a), stride_a, static_cast<const ElementAB*>(b), stride_b},
        {{}, static_cast<const ElementC*>(c), stride_c, static_cast<ElementD*>(d), stride_d}};
    Epilogue::set_arguments(args.epilogue.thread, row_amax, col_amax, bias, alpha * kAlphaUnscale, beta,
                            row_is_vector, col_is_vector);
    return args;
  }
};

// The C ABI's parameters (codegen/families.py, gemm_sm90), shared by the three entry points below: the packed
// operands (codes and E4M3 scales, row strides in bytes), B's rows (those of N past b_rows multiply as zeros: the
// caller rounds N up for D's TMA store), the epilogue's and the workspace.
#define FP4GEN_SM90_GEMM_PARAMS                                                                                   \
  const uint8_t *a_codes, const uint8_t *a_scale, const uint8_t *b_codes, const uint8_t *b_scale, const void *c,  \
      void *d, const float *row_amax, const float *col_amax, const float *bias, float alpha, float beta, int64_t m, \
      int64_t n, int64_t k, int64_t lda, int64_t lda_scale, int64_t ldb, int64_t ldb_scale, int64_t b_rows,        \
      int64_t ldc, int64_t ldd, int64_t row_is_vector, int64_t col_is_vector, void *workspace

// The workspace: A's fp16 copy [M, K], then B's [N, K], then CUTLASS's, each at a 256-byte boundary.
struct Sm90Scratch {
  static constexpr int64_t kAlign = 256;
  size_t a_bytes, b_bytes;
  Sm90Scratch(int64_t m, int64_t n, int64_t k)
      : a_bytes(round_to_256(static_cast<size_t>(m * k) * 2)), b_bytes(round_to_256(static_cast<size_t>(n * k) * 2)) {}
  uint8_t* a(void* workspace) const { return static_cast<uint8_t*>(workspace); }
  uint8_t* b(void* workspace) const { return static_cast<uint8_t*>(workspace) + a_bytes; }
  uint8_t* gemm(void* workspace) const { return static_cast<uint8_t*>(workspace) + a_bytes + b_bytes; }
};

constexpr uintptr_t kShapeOnlyAddress = 256;  // an aligned stand-in for a scratch copy not allocated yet

// What fused_wgmma::dequantize_rows takes of an operand of `rows` rows of k elements: 4-byte loads of codes
// (rows ld bytes apart), byte loads of scales (ld_scale apart).
inline int half_copy_can_implement(const uint8_t* codes, int64_t ld, int64_t ld_scale, int64_t rows, int64_t k) {
  if (rows > 1 && (ld < k / 2 || ld_scale < k / 16)) return kInvalidProblem;
  if (!aligned(codes, 4) || ld % 4 != 0) return kMisaligned;
  return kOk;
}

template <class G>
int gemm_can_implement(FP4GEN_SM90_GEMM_PARAMS) {
  if (m < 0 || n < 0 || k <= 0 || k % 16 != 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    return kInvalidProblem;
  if (b_rows < 0 || b_rows > n) return kInvalidProblem;
  if (row_amax == nullptr || col_amax == nullptr) return kInvalidProblem;
  // TMA and the broadcast nodes' vector loads
  for (const void* p : {c, static_cast<const void*>(d), static_cast<const void*>(bias)})
    if (!aligned(p, 16)) return kMisaligned;
  for (int64_t ld : {ldc, ldd}) if (ld % G::kAlignCD != 0) return kMisaligned;
  // the copies
  (void)a_scale, (void)b_scale;
  const auto stand_in = reinterpret_cast<void*>(kShapeOnlyAddress);
  if (const int a_ok = half_copy_can_implement(a_codes, lda, lda_scale, m, k); a_ok != kOk) return a_ok;
  if (const int b_ok = half_copy_can_implement(b_codes, ldb, ldb_scale, b_rows, k); b_ok != kOk) return b_ok;
  if (m > 0 && n > 0 && workspace == nullptr) return kInvalidProblem;  // no room for the copies
  if (!aligned(workspace, Sm90Scratch::kAlign)) return kMisaligned;
  return cutlass_can_implement<typename G::Gemm>(G::arguments(
      stand_in, stand_in, c, d, row_amax, col_amax, bias, alpha, beta, m, n, k, ldc, ldd, row_is_vector,
      col_is_vector));
}

template <class G>
size_t gemm_workspace_size(FP4GEN_SM90_GEMM_PARAMS) {
  (void)workspace;
  if (m <= 0 || n <= 0 || k <= 0) return 0;
  const Sm90Scratch scratch(m, n, k);
  const auto stand_in = reinterpret_cast<void*>(kShapeOnlyAddress);
  return scratch.a_bytes + scratch.b_bytes +
         G::Gemm::get_workspace_size(G::arguments(stand_in, stand_in, c, d, row_amax, col_amax, bias, alpha, beta,
                                                  m, n, k, ldc, ldd, row_is_vector, col_is_vector));
}

template <class G>
int gemm_run(FP4GEN_SM90_GEMM_PARAMS, cudaStream_t stream) {
  const int status = gemm_can_implement<G>(a_codes, a_scale, b_codes, b_scale, c, d, row_amax, col_amax, bias, alpha,
                                           beta, m, n, k, lda, lda_scale, ldb, ldb_scale, b_rows, ldc, ldd,
                                           row_is_vector, col_is_vector, workspace);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  const Sm90Scratch scratch(m, n, k);
  uint8_t* const a16 = scratch.a(workspace);
  uint8_t* const b16 = scratch.b(workspace);
  // block-scaled values times 2^-14 (no amax: the epilogue applies it)
  fused_wgmma::dequantize_two_operands({a_codes, a_scale, lda, lda_scale, m, a16},
                                       {b_codes, b_scale, ldb, ldb_scale, b_rows, b16}, k, stream);
  if (const int launched = launch_status(); launched != kOk) return launched;
  if (b_rows < n) {
    const cudaError_t err = cudaMemsetAsync(b16 + b_rows * k * 2, 0, (n - b_rows) * k * 2, stream);
    if (err != cudaSuccess) return kCudaErrorBase + static_cast<int>(err);
  }
  // The GEMM as the programmatic dependent of the copy kernel (which releases it as it starts), unless a memset
  // of B's missing rows comes between them.
  return cutlass_run<typename G::Gemm>(G::arguments(a16, b16, c, d, row_amax, col_amax, bias, alpha, beta, m, n, k,
                                                    ldc, ldd, row_is_vector, col_is_vector),
                                       scratch.gemm(workspace), stream, /*programmatic=*/b_rows == n);
}

}  // namespace fp4gen
