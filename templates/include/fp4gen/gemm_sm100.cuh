// Blackwell NVFP4 GEMM (docs/kernel-specs.md): native block-scaled MMA (tcgen05 kind::mxf4nvf4) on the
// packed E2M1 operands and their E4M3 block scales in the 128x4 swizzled layout (fp4gen.swizzle), with
// the same bilateral epilogue as Hopper (bilateral_epilogue.hpp).
// Compiled for sm_100a only; no Blackwell GPU was available, so this has never been run.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "fp4gen/abi.h"
#include "fp4gen/cutlass_run.hpp"
#include "fp4gen/bilateral_epilogue.hpp"

namespace fp4gen {

template <class ElementD_, int kTileM, int kTileN, int kTileK>
struct Sm100BilateralGemm {
  using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
  using ElementD = ElementD_;
  using ElementC = ElementD_;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;  // one SM's MMA tile
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignAB = 32, kAlignCD = 16 / sizeof(ElementD);  // 32 E2M1 = 16 bytes

  using Epilogue = BilateralEpilogue<TileShape, ElementD>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor, kAlignCD,
      ElementD, cutlass::layout::RowMajor, kAlignCD, cutlass::epilogue::TmaWarpSpecialized1Sm,
      typename Epilogue::Tree>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementAB, cutlass::layout::RowMajor, kAlignAB,
      ElementAB, cutlass::layout::ColumnMajor, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecialized1SmNvf4Sm100>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Config = typename CollectiveMainloop::Sm1xxBlkScaledConfig;

  // A [M, K] and B [N, K]: packed E2M1 rows of K/2 bytes (contiguous); sfa, sfb: swizzled scales.
  static typename Gemm::Arguments arguments(const void* a, const void* b, const void* sfa, const void* sfb,
                                            const void* c, void* d, const float* row_amax, const float* col_amax,
                                            const float* bias, float alpha, float beta, int64_t m, int64_t n,
                                            int64_t k, int64_t ldc, int64_t ldd, int64_t row_is_vector,
                                            int64_t col_is_vector) {
    using Args = typename Gemm::Arguments;
    using PtrA = decltype(Args{}.mainloop.ptr_A);
    using PtrB = decltype(Args{}.mainloop.ptr_B);
    using PtrSF = decltype(Args{}.mainloop.ptr_SFA);
    const auto shape = cute::make_shape(static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1);
    typename Gemm::GemmKernel::StrideA stride_a{k, cute::_1{}, int64_t(0)};  // packed rows: K elements
    typename Gemm::GemmKernel::StrideB stride_b{k, cute::_1{}, int64_t(0)};
    typename Gemm::GemmKernel::StrideC stride_c{ldc, cute::_1{}, int64_t(0)};
    typename Gemm::GemmKernel::StrideD stride_d{ldd, cute::_1{}, int64_t(0)};
    Args args{cutlass::gemm::GemmUniversalMode::kGemm,
              {static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1},
              {static_cast<PtrA>(a), stride_a, static_cast<PtrB>(b), stride_b, static_cast<PtrSF>(sfa),
               Config::tile_atom_to_shape_SFA(shape), static_cast<PtrSF>(sfb), Config::tile_atom_to_shape_SFB(shape)},
              {{}, static_cast<const ElementC*>(c), stride_c, static_cast<ElementD*>(d), stride_d}};
    Epilogue::set_arguments(args.epilogue.thread, row_amax, col_amax, bias, alpha, beta, row_is_vector,
                            col_is_vector);
    return args;
  }
};

// The C ABI's parameters (codegen/families.py, gemm_sm100), shared by the three entry points below.
#define FP4GEN_SM100_GEMM_PARAMS                                                                               \
  const void *a, const void *b, const void *sfa, const void *sfb, const void *c, void *d, const float *row_amax, \
      const float *col_amax, const float *bias, float alpha, float beta, int64_t m, int64_t n, int64_t k,      \
      int64_t ldc, int64_t ldd, int64_t row_is_vector, int64_t col_is_vector, void *workspace
#define FP4GEN_SM100_GEMM_PROBLEM \
  a, b, sfa, sfb, c, d, row_amax, col_amax, bias, alpha, beta, m, n, k, ldc, ldd, row_is_vector, col_is_vector

template <class G>
int gemm_blockscaled_can_implement(FP4GEN_SM100_GEMM_PARAMS) {
  (void)workspace;
  if (m < 0 || n < 0 || k <= 0 || k % G::kAlignAB != 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    return kInvalidProblem;
  if (row_amax == nullptr || col_amax == nullptr || sfa == nullptr || sfb == nullptr) return kInvalidProblem;
  // TMA and the broadcast nodes' vector loads
  for (const void* p : {a, b, c, static_cast<const void*>(d), static_cast<const void*>(bias)})
    if (!aligned(p, 16)) return kMisaligned;
  for (int64_t ld : {ldc, ldd}) if (ld % G::kAlignCD != 0) return kMisaligned;
  return cutlass_can_implement<typename G::Gemm>(G::arguments(FP4GEN_SM100_GEMM_PROBLEM));
}

template <class G>
size_t gemm_blockscaled_workspace_size(FP4GEN_SM100_GEMM_PARAMS) {
  (void)workspace;
  return G::Gemm::get_workspace_size(G::arguments(FP4GEN_SM100_GEMM_PROBLEM));
}

template <class G>
int gemm_blockscaled_run(FP4GEN_SM100_GEMM_PARAMS, cudaStream_t stream) {
  const int status = gemm_blockscaled_can_implement<G>(FP4GEN_SM100_GEMM_PROBLEM, workspace);
  if (status != kOk) return status;
  if (m == 0 || n == 0) return kOk;
  return cutlass_run<typename G::Gemm>(G::arguments(FP4GEN_SM100_GEMM_PROBLEM), workspace, stream);
}

}  // namespace fp4gen
