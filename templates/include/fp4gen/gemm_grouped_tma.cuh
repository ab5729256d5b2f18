// Grouped NVFP4 GEMM for mixture-of-experts layers on Hopper through CUTLASS's SM90 grouped (ptr-array) GEMM:
// the same problems, C ABI and results as gemm_grouped_wgmma.cuh (see there: groups along M over stacked B, or
// along K with one output a group, each group's amaxes in the bilateral epilogue), computed differently.
//
//   1. Both operands are dequantized into the workspace as fp16 rows (fused_wgmma::dequantize_rows: the block-
//      scaled values times 2^-14, exact; both operands in the same order within each 16-element block, so every
//      dot product is unchanged), B whole: along M, every group's [N, K] weight.
//   2. One warp, 32 groups at a time, turns the device offsets into the grouped GEMM's arguments in the
//      workspace: each group's problem shape, operand, output and amax pointers and strides. A group without rows gets shape
//      (0, N, K) and is skipped; a group along K without k-tiles gets shape (0, N, K) too (CUTLASS would leave
//      its accumulators unset) and a third kernel writes its output, beta * C (zeros unless accumulating).
//   3. A persistent CUTLASS kernel (TMA, warp-specialized wgmma, cooperative or pingpong) walks the groups' tiles, reading
//      the shapes from device memory only (no host copy of them exists), with the bilateral epilogue whose
//      broadcast nodes take a pointer a group (bilateral_epilogue.hpp, kPerGroup). The fp16 operands carry
//      2^-14 each, so alpha is passed times 2^28, an exact power of two.
//
// Why: the packed kernel's synchronous mainloop (one barrier a k-tile, dequantization between the multiplies)
// reached 390-410 TFLOP/s on Mixtral's experts and 150-225 on the wgrads; this one, prepasses included, 600-645
// and 1.2-1.6x faster wgrads on the H200 (bench/RESULTS.md, 2026-12-02). The price is the fp16 copies' traffic
// and workspace: along M, E * N * K * 2 bytes for the weights, which few tokens an expert do not repay.
//
// Offsets that break their contract are clamped as gemm_grouped_wgmma.cuh clamps them: a group spans
// [previous end, max(its end, previous end)] within [0, M] (along K: within [0, K]); results of such groups are
// undefined, no access leaves the operands.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "fp4gen/abi.h"
#include "fp4gen/bilateral_epilogue.hpp"
#include "fp4gen/gemm_fused_wgmma.cuh"
#include "fp4gen/gemm_grouped_arguments.cuh"

namespace fp4gen {

template <class ElementD_, int kTileM, int kTileN, int kTileK, bool kPingpong, int kClusterM, int kClusterN>
struct TmaGroupedBilateralGemm {
  using ElementAB = cutlass::half_t;
  using ElementD = ElementD_;
  using ElementC = ElementD_;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  // cooperative: both consumer warp groups share each tile; pingpong: they take alternate tiles, so that one's
  // epilogue runs beside the other's mainloop
  using KernelSchedule = std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB), kAlignCD = 16 / sizeof(ElementD);

  using Epilogue = BilateralEpilogue<TileShape, ElementD, true>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor*, kAlignCD,
      ElementD, cutlass::layout::RowMajor*, kAlignCD, EpilogueSchedule, typename Epilogue::Tree>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, cutlass::layout::RowMajor*, kAlignAB,
      ElementAB, cutlass::layout::ColumnMajor*, kAlignAB, float, TileShape, ClusterShape,
      // the epilogue's tensor maps (one set per group change, in shared memory) are not in its SharedStorage:
      // carved out too, or the stage count chosen overflows shared memory by their size
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage) + sizeof(typename CollectiveEpilogue::TensorMapStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;

  // The per-group arguments, written on the device (grouped_args::arguments_kernel, through write_group) into
  // the workspace.
  struct Arrays {
    Shape* shapes;
    const ElementAB** a;
    const ElementAB** b;
    const ElementC** c;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
    const float** row_amax;
    const float** col_amax;
    const float** bias;
  };

  // Arrays for `groups` groups from `base`, each array at a 16-byte boundary in the order of the members; `bytes`
  // gets their extent.
  static Arrays arrays_at(uint8_t* base, int64_t groups, size_t* bytes = nullptr) {
    grouped_args::ArrayCarver carve{reinterpret_cast<uintptr_t>(base), groups};
    Arrays r;
    carve.take(r.shapes), carve.take(r.a), carve.take(r.b), carve.take(r.c), carve.take(r.d);
    carve.take(r.stride_a), carve.take(r.stride_b), carve.take(r.stride_c), carve.take(r.stride_d);
    carve.take(r.row_amax), carve.take(r.col_amax), carve.take(r.bias);
    if (bytes != nullptr) *bytes = carve.used;
    return r;
  }
  // 2^28: the two fp16 operands' 2^-14 factors (fused_gemm::decode8), undone through alpha
  static constexpr float kAlphaUnscale = 268435456.0f;

  // The operand area: A's fp16 copy, then (at a 256-byte boundary) B's.
  static size_t b_half_offset(int64_t m, int64_t k) { return round_to_256(static_cast<size_t>(m * k) * 2); }
  static size_t operand_bytes(int64_t m, int64_t n, int64_t k, int64_t groups, bool along_k) {
    return b_half_offset(m, k) + static_cast<size_t>((along_k ? n : groups * n) * k) * 2;
  }

  // Both operands' fp16 copies, then the per-group arguments.
  static int prepare(const grouped_args::Problem& p, const Arrays& arrays, const grouped_args::Operands& o,
                     cudaStream_t stream) {
    uint8_t* const a_half = o.area;
    uint8_t* const b_half = o.area + b_half_offset(p.m, p.k);
    if (p.along_k) {
      fused_wgmma::dequantize_two_operands({o.a_codes, o.a_scale, o.lda, o.lda_scale, p.m, a_half},
                                           {o.b_codes, o.b_scale, o.ldb, o.ldb_scale, p.n, b_half}, p.k, stream);
    } else {
      fused_wgmma::dequantize_rows(o.a_codes, o.a_scale, o.lda, o.lda_scale, p.m, p.k, a_half, stream);
      fused_wgmma::dequantize_stacked_rows(o.b_codes, o.b_scale, o.ldb, o.ldb_scale, p.groups, p.n, o.b_group_stride,
                                           o.b_scale_group_stride, p.k, b_half, stream);
    }
    grouped_args::arguments_kernel<TmaGroupedBilateralGemm><<<1, 32, 0, stream>>>(
        p, arrays, reinterpret_cast<const ElementAB*>(a_half), reinterpret_cast<const ElementAB*>(b_half));
    return kOk;
  }

  // Writes group g's arguments, given its span [begin, end) along M (rows of A, C, D) or K (elements).
  __device__ static void write_group(const grouped_args::Problem& p, const Arrays& arrays, int64_t g, int64_t begin,
                                     int64_t end, const ElementAB* a_half, const ElementAB* b_half) {
    const auto* c = static_cast<const ElementD*>(p.c);
    auto* d = static_cast<ElementD*>(p.d);
    int64_t row0 = 0;  // the group's first row of A, C and D (along K: every group has all M rows)
    if (p.along_k) {
      // whole 64-element k-tiles of the padded columnwise copies, never past K (TMA zero-fills a tile's rest);
      // a group without any gets no rows, and zero_empty_kernel its output
      const int64_t k_tiles = (end - begin + fused_gemm::kTileK - 1) / fused_gemm::kTileK;
      const int64_t k_extent = k_tiles * fused_gemm::kTileK < p.k - begin ? k_tiles * fused_gemm::kTileK : p.k - begin;
      arrays.shapes[g] = Shape(k_tiles > 0 ? static_cast<int>(p.m) : 0, static_cast<int>(p.n), static_cast<int>(k_extent));
      arrays.a[g] = a_half + begin, arrays.b[g] = b_half + begin;
    } else {
      row0 = begin;
      arrays.shapes[g] = Shape(static_cast<int>(end - begin), static_cast<int>(p.n), static_cast<int>(p.k));
      arrays.a[g] = a_half + begin * p.k, arrays.b[g] = b_half + g * p.n * p.k;
    }
    arrays.stride_a[g] = cute::make_stride(p.k, cute::Int<1>{}, cute::Int<0>{});
    arrays.stride_b[g] = cute::make_stride(p.k, cute::Int<1>{}, cute::Int<0>{});
    arrays.c[g] = c != nullptr ? c + g * p.c_group_stride + row0 * p.ldc : nullptr;
    arrays.d[g] = d + g * p.d_group_stride + row0 * p.ldd;
    arrays.stride_c[g] = cute::make_stride(p.ldc, cute::Int<1>{}, cute::Int<0>{});
    arrays.stride_d[g] = cute::make_stride(p.ldd, cute::Int<1>{}, cute::Int<0>{});
    // the packed kernels index a row amax vector by A's row, CUTLASS by the group's
    arrays.row_amax[g] = p.row_amax + g * p.row_amax_group_stride + (p.row_is_vector ? row0 : 0);
    arrays.col_amax[g] = p.col_amax + g * p.col_amax_group_stride;
    arrays.bias[g] = p.bias != nullptr ? p.bias + g * p.bias_group_stride : nullptr;
  }

  static typename Gemm::Arguments arguments(const Arrays& arrays, int64_t groups, bool with_c, bool with_bias,
                                            float alpha, float beta, int64_t row_is_vector, int64_t col_is_vector,
                                            int device, int multiprocessors, int64_t rows_per_group, int64_t n) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = device;
    hw_info.sm_count = multiprocessors;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {static_cast<int>(groups), arrays.shapes, nullptr},  // shapes on the device only
        {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
        {{}, with_c ? arrays.c : nullptr, arrays.stride_c, arrays.d, arrays.stride_d},
        hw_info};
    Epilogue::set_arguments(args.epilogue.thread, arrays.row_amax, arrays.col_amax, with_bias ? arrays.bias : nullptr,
                            alpha, beta, row_is_vector, col_is_vector);
    // The persistent CTAs walk each group's tiles along its longer side of tiles. CUTLASS's grouped scheduler
    // cannot choose (the group shapes are on the device) and walks along M unless told: with many more tile rows
    // than tile columns, each CTA in flight then takes its own panel of A, and every panel is read again for
    // each tile column. Walking along N, consecutive CTAs share one panel of A while it is in L2. On the H200
    // (bench/RESULTS.md, 2026-12-03) that made Mixtral's wgrad (28672 x 4096 a group, 2048 tokens deep) 17%
    // faster and moved no fprop or dgrad measured beyond noise.
    using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
    const int64_t tiles_m = (rows_per_group + kTileM - 1) / kTileM, tiles_n = (n + kTileN - 1) / kTileN;
    args.scheduler.raster_order = tiles_m > tiles_n ? RasterOrder::AlongN : RasterOrder::AlongM;
    return args;
  }
};

}  // namespace fp4gen
