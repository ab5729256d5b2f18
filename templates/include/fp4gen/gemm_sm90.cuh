// Hopper NVFP4 GEMM, first version (docs/numerics.md, how Hopper runs NVFP4): both operands arrive
// dequantized to their block-scaled values (E2M1 * E4M3, exact in bf16, without the second-level amax), a
// CUTLASS SM90 bf16 TMA warp-specialized GEMM accumulates in fp32, and the bilateral epilogue
// (bilateral_epilogue.hpp) applies alpha * row_amax[i] * col_amax[j], alpha = fl(1 / 2688^2) from the
// caller, plus beta * C.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "fp4gen/abi.h"
#include "fp4gen/cutlass_run.hpp"
#include "fp4gen/bilateral_epilogue.hpp"

namespace fp4gen {

template <class ElementD_, int kTileM, int kTileN, int kTileK, bool kPingpong, int kClusterM, int kClusterN>
struct Sm90BilateralGemm {
  using ElementAB = cutlass::bfloat16_t;
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

  // A [M, K] and B [N, K] K-major (row strides lda, ldb); C, D [M, N] row-major (ldc, ldd).
  static typename Gemm::Arguments arguments(const void* a, const void* b, const void* c, void* d,
                                            const float* row_amax, const float* col_amax, const float* bias,
                                            float alpha, float beta, int64_t m, int64_t n, int64_t k, int64_t lda,
                                            int64_t ldb, int64_t ldc, int64_t ldd, int64_t row_is_vector,
                                            int64_t col_is_vector) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideC = typename Gemm::GemmKernel::StrideC;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    StrideA stride_a{lda, cute::_1{}, int64_t(0)};
    StrideB stride_b{ldb, cute::_1{}, int64_t(0)};
    StrideC stride_c{ldc, cute::_1{}, int64_t(0)};
    StrideD stride_d{ldd, cute::_1{}, int64_t(0)};
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1},
        {static_cast<const ElementAB*>(a), stride_a, static_cast<const ElementAB*>(b), stride_b},
        {{}, static_cast<const ElementC*>(c), stride_c, static_cast<ElementD*>(d), stride_d}};
    Epilogue::set_arguments(args.epilogue.thread, row_amax, col_amax, bias, alpha, beta, row_is_vector,
                            col_is_vector);
    return args;
  }
};

// The C ABI's parameters (codegen/families.py, gemm_sm90), shared by the three entry points below.
#define FP4GEN_SM90_GEMM_PARAMS                                                                                \
  const void *a, const void *b, const void *c, void *d, const float *row_amax, const float *col_amax,          \
      const float *bias, float alpha, float beta, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,   \
      int64_t ldc, int64_t ldd, int64_t row_is_vector, int64_t col_is_vector, void *workspace
#define FP4GEN_SM90_GEMM_PROBLEM \
  a, b, c, d, row_amax, col_amax, bias, alpha, beta, m, n, k, lda, ldb, ldc, ldd, row_is_vector, col_is_vector

template <class G>
int gemm_can_implement(FP4GEN_SM90_GEMM_PARAMS) {
  (void)workspace;
  if (m < 0 || n < 0 || k <= 0 || k % 16 != 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    return kInvalidProblem;
  if (row_amax == nullptr || col_amax == nullptr) return kInvalidProblem;
  // TMA and the broadcast nodes' vector loads
  for (const void* p : {a, b, c, static_cast<const void*>(d), static_cast<const void*>(bias)})
    if (!aligned(p, 16)) return kMisaligned;
  for (int64_t ld : {lda, ldb}) if (ld % G::kAlignAB != 0) return kMisaligned;
  for (int64_t ld : {ldc, ldd}) if (ld % G::kAlignCD != 0) return kMisaligned;
  return cutlass_can_implement<typename G::Gemm>(G::arguments(FP4GEN_SM90_GEMM_PROBLEM));
}

template <class G>
size_t gemm_workspace_size(FP4GEN_SM90_GEMM_PARAMS) {
  (void)workspace;
  return G::Gemm::get_workspace_size(G::arguments(FP4GEN_SM90_GEMM_PROBLEM));
}

template <class G>
int gemm_run(FP4GEN_SM90_GEMM_PARAMS, cudaStream_t stream) {
  const int status = gemm_can_implement<G>(FP4GEN_SM90_GEMM_PROBLEM, workspace);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  return cutlass_run<typename G::Gemm>(G::arguments(FP4GEN_SM90_GEMM_PROBLEM), workspace, stream);
}

}  // namespace fp4gen
