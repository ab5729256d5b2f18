// Grouped NVFP4 GEMM for mixture-of-experts layers on Blackwell: the same problems, C ABI and results as
// gemm_grouped_wgmma.cuh (groups along M over stacked B, or along K with one output a group, each group's amaxes
// in the bilateral epilogue), through CUTLASS's SM100 grouped (ptr-array) block-scaled GEMM, which multiplies the
// packed E2M1 codes with their E4M3 block scales natively (tcgen05 kind::mxf4nvf4).
// Compiled for sm_100a only; no Blackwell GPU was available, so this has never been run.
//
//   1. One warp writes each group's arguments into the workspace from the device offsets (gemm_grouped_arguments.cuh):
//      its problem shape, its codes' pointers (rows of A and stacked B along M; a column range of both along K),
//      output and amax pointers, strides, and the layouts and places of its scale factors.
//   2. The MMA reads each group's scales in the 128x4-swizzled layout of its own [rows, K / 16] block (rows padded
//      to 128), which the operands' row-major scales are not: a second kernel copies every group's scales into
//      those layouts in the workspace, through the layout functions the GEMM itself uses, after the workspace's
//      scales were zeroed (padding rows and blocks read as zero scales: a tile's rows past its group, which TMA
//      fills with zero codes, add nothing).
//   3. A persistent CUTLASS kernel walks the groups' tiles, shapes read on the device only, with the bilateral
//      epilogue taking a pointer a group (bilateral_epilogue.hpp, kPerGroup). Groups along K without k-tiles get
//      no rows, and their outputs come from grouped_args::zero_empty_kernel.
//
// Scale places: along M, group g's A scales start at row round_up(begin_g + 256 g, 128) of the scale workspace
// (past the previous group's padded rows whatever the routing; at most M + 256 E + 128 rows in all) and its B
// scales at g * round_up(N, 128); along K, every group's k-range is whole 64-element k-tiles (the columnwise
// copies' padding), so its scales start at block begin_g / 16 of an [round_up(rows, 128), K / 16] area.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "fp4gen/abi.h"
#include "fp4gen/bilateral_epilogue.hpp"
#include "fp4gen/gemm_grouped_arguments.cuh"

namespace fp4gen {

namespace grouped_sm100 {

// One group's scales of one operand, to copy: `rows` rows of `blocks` scales from `src` (row stride ld bytes) into
// the swizzled layout at `dst`.
struct ScaleCopy {
  const uint8_t* src;
  int64_t ld, rows, blocks;
  uint8_t* dst;
};

constexpr int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace grouped_sm100

template <class ElementD_, int kTileM, int kTileN, int kTileK>
struct Sm100GroupedBilateralGemm {
  using ElementAB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
  using ElementD = ElementD_;
  using ElementC = ElementD_;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;  // one SM's MMA tile
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignAB = 32, kAlignCD = 16 / sizeof(ElementD);  // 32 E2M1 = 16 bytes

  using Epilogue = BilateralEpilogue<TileShape, ElementD, true>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor*, kAlignCD,
      ElementD, cutlass::layout::RowMajor*, kAlignCD, cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm,
      typename Epilogue::Tree>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementAB, cutlass::layout::RowMajor*,
      kAlignAB, ElementAB, cutlass::layout::ColumnMajor*, kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using Config = typename CollectiveMainloop::Sm1xxBlkScaledConfig;
  using ElementSF = typename CollectiveMainloop::ElementSF;
  using LayoutSFA = typename CollectiveMainloop::InternalLayoutSFA;
  using LayoutSFB = typename CollectiveMainloop::InternalLayoutSFB;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using MainloopArguments = typename CollectiveMainloop::Arguments;
  // the codes' element type the mainloop's pointer arrays point to
  using CodeA = std::remove_cv_t<std::remove_pointer_t<std::remove_pointer_t<decltype(MainloopArguments{}.ptr_A)>>>;
  using CodeB = std::remove_cv_t<std::remove_pointer_t<std::remove_pointer_t<decltype(MainloopArguments{}.ptr_B)>>>;

  // The per-group arguments, written on the device (grouped_args::arguments_kernel, through write_group).
  struct Arrays {
    Shape* shapes;
    const CodeA** a;
    const CodeB** b;
    const ElementSF** sfa;
    const ElementSF** sfb;
    const ElementC** c;
    ElementD** d;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
    LayoutSFA* layout_sfa;
    LayoutSFB* layout_sfb;
    const float** row_amax;
    const float** col_amax;
    const float** bias;
    grouped_sm100::ScaleCopy* copy_a;
    grouped_sm100::ScaleCopy* copy_b;
  };

  // Arrays for `groups` groups from `base`, each array at a 16-byte boundary in the order of the members; `bytes`
  // gets their extent.
  static Arrays arrays_at(uint8_t* base, int64_t groups, size_t* bytes = nullptr) {
    grouped_args::ArrayCarver carve{reinterpret_cast<uintptr_t>(base), groups};
    Arrays r;
    carve.take(r.shapes), carve.take(r.a), carve.take(r.b), carve.take(r.sfa), carve.take(r.sfb);
    carve.take(r.c), carve.take(r.d);
    carve.take(r.stride_a), carve.take(r.stride_b), carve.take(r.stride_c), carve.take(r.stride_d);
    carve.take(r.layout_sfa), carve.take(r.layout_sfb);
    carve.take(r.row_amax), carve.take(r.col_amax), carve.take(r.bias);
    carve.take(r.copy_a), carve.take(r.copy_b);
    if (bytes != nullptr) *bytes = carve.used;
    return r;
  }
  // The operand area: A's swizzled scales, then (at a 256-byte boundary) B's; see the file's comment for the places.
  __host__ __device__ static size_t sfa_bytes(int64_t m, int64_t k, int64_t groups, bool along_k) {
    using grouped_sm100::round_up;
    return static_cast<size_t>(along_k ? round_up(m, 128) * (k / 16) : (m + 256 * groups + 128) * (k / 16));
  }
  static size_t operand_bytes(int64_t m, int64_t n, int64_t k, int64_t groups, bool along_k) {
    using grouped_sm100::round_up;
    return round_to_256(sfa_bytes(m, k, groups, along_k)) +
           static_cast<size_t>((along_k ? 1 : groups) * round_up(n, 128) * (k / 16));
  }
  static constexpr float kAlphaUnscale = 1.0f;  // the MMA multiplies the block-scaled values themselves

  // The zeroed scale areas, the per-group arguments, then each group's scales swizzled into them.
  static int prepare(const grouped_args::Problem& p, const Arrays& arrays, const grouped_args::Operands& o,
                     cudaStream_t stream);

  // Writes group g's arguments, given its span [begin, end) along M (rows of A, C, D) or K (elements).
  __device__ static void write_group(const grouped_args::Problem& p, const Arrays& arrays, int64_t g, int64_t begin,
                                     int64_t end, const grouped_args::Operands o) {
    using grouped_sm100::round_up;
    uint8_t* const sfa = o.area;
    uint8_t* const sfb = o.area + round_to_256(sfa_bytes(p.m, p.k, p.groups, p.along_k));
    const auto* c = static_cast<const ElementD*>(p.c);
    auto* d = static_cast<ElementD*>(p.d);
    int64_t row0 = 0, k_extent = p.k;  // the group's first row of A, C and D; its K
    grouped_sm100::ScaleCopy copy_a, copy_b;
    if (p.along_k) {
      // whole 64-element k-tiles of the padded columnwise copies, never past K; a group without any gets no rows
      const int64_t k_tiles = (end - begin + fused_gemm::kTileK - 1) / fused_gemm::kTileK;
      k_extent = k_tiles * fused_gemm::kTileK < p.k - begin ? k_tiles * fused_gemm::kTileK : p.k - begin;
      arrays.shapes[g] = Shape(k_tiles > 0 ? static_cast<int>(p.m) : 0, static_cast<int>(p.n), static_cast<int>(k_extent));
      arrays.a[g] = reinterpret_cast<const CodeA*>(o.a_codes + begin / 2);
      arrays.b[g] = reinterpret_cast<const CodeB*>(o.b_codes + begin / 2);
      copy_a = {o.a_scale + begin / 16, o.lda_scale, p.m, k_extent / 16, sfa + round_up(p.m, 128) * (begin / 16)};
      copy_b = {o.b_scale + begin / 16, o.ldb_scale, p.n, k_extent / 16, sfb + round_up(p.n, 128) * (begin / 16)};
      if (k_tiles == 0) copy_a.rows = copy_b.rows = 0;
    } else {
      row0 = begin;
      arrays.shapes[g] = Shape(static_cast<int>(end - begin), static_cast<int>(p.n), static_cast<int>(p.k));
      arrays.a[g] = reinterpret_cast<const CodeA*>(o.a_codes + begin * o.lda);
      arrays.b[g] = reinterpret_cast<const CodeB*>(o.b_codes + g * o.b_group_stride);
      copy_a = {o.a_scale + begin * o.lda_scale, o.lda_scale, end - begin, p.k / 16,
                sfa + round_up(begin + 256 * g, 128) * (p.k / 16)};
      copy_b = {o.b_scale + g * o.b_scale_group_stride, o.ldb_scale, p.n, p.k / 16,
                sfb + g * round_up(p.n, 128) * (p.k / 16)};
    }
    const auto shape = cute::make_shape(static_cast<int>(cute::get<0>(arrays.shapes[g])), static_cast<int>(p.n),
                                        static_cast<int>(k_extent), 1);
    arrays.layout_sfa[g] = Config::tile_atom_to_shape_SFA(shape);
    arrays.layout_sfb[g] = Config::tile_atom_to_shape_SFB(shape);
    arrays.sfa[g] = reinterpret_cast<const ElementSF*>(copy_a.dst);
    arrays.sfb[g] = reinterpret_cast<const ElementSF*>(copy_b.dst);
    arrays.copy_a[g] = copy_a, arrays.copy_b[g] = copy_b;
    // codes: row strides in E2M1 elements (two a byte)
    arrays.stride_a[g] = cute::make_stride(2 * o.lda, cute::Int<1>{}, cute::Int<0>{});
    arrays.stride_b[g] = cute::make_stride(2 * o.ldb, cute::Int<1>{}, cute::Int<0>{});
    arrays.c[g] = c != nullptr ? c + g * p.c_group_stride + row0 * p.ldc : nullptr;
    arrays.d[g] = d + g * p.d_group_stride + row0 * p.ldd;
    arrays.stride_c[g] = cute::make_stride(p.ldc, cute::Int<1>{}, cute::Int<0>{});
    arrays.stride_d[g] = cute::make_stride(p.ldd, cute::Int<1>{}, cute::Int<0>{});
    // the packed kernels index a row amax vector by A's row, CUTLASS by the group's
    arrays.row_amax[g] = p.row_amax + g * p.row_amax_group_stride + (p.row_is_vector ? row0 : 0);
    arrays.col_amax[g] = p.col_amax + g * p.col_amax_group_stride;
    arrays.bias[g] = p.bias != nullptr ? p.bias + g * p.bias_group_stride : nullptr;
  }

  // rows_per_group and n are not used: the tiles go in CUTLASS's default order (the Hopper family's choice of
  // order was measured on the H200; no Blackwell GPU was available to measure this one's)
  static typename Gemm::Arguments arguments(const Arrays& arrays, int64_t groups, bool with_c, bool with_bias,
                                            float alpha, float beta, int64_t row_is_vector, int64_t col_is_vector,
                                            int device, int multiprocessors, int64_t rows_per_group, int64_t n) {
    (void)rows_per_group, (void)n;
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = device;
    hw_info.sm_count = multiprocessors;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {static_cast<int>(groups), arrays.shapes, nullptr},  // shapes on the device only
        {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b, arrays.sfa, arrays.layout_sfa, arrays.sfb,
         arrays.layout_sfb},
        {{}, with_c ? arrays.c : nullptr, arrays.stride_c, arrays.d, arrays.stride_d},
        hw_info};
    Epilogue::set_arguments(args.epilogue.thread, arrays.row_amax, arrays.col_amax, with_bias ? arrays.bias : nullptr,
                            alpha, beta, row_is_vector, col_is_vector);
    return args;
  }
};

namespace grouped_sm100 {

// Every group's scales of both operands (grid: x strides over a group's scales, y the group, z the operand) into
// the swizzled layouts the arguments kernel wrote: scale (r, block b) of the group goes to the layout's offset of
// row r and element 16 b.
template <class G>
__global__ void swizzle_scales_kernel(const typename G::Arrays arrays) {
  const int64_t g = blockIdx.y;
  const ScaleCopy copy = blockIdx.z == 0 ? arrays.copy_a[g] : arrays.copy_b[g];
  const int64_t count = copy.rows * copy.blocks;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / copy.blocks, b = i - r * copy.blocks;
    const auto coord = cute::make_coord(static_cast<int>(r), static_cast<int>(16 * b), 0);
    const int64_t offset = blockIdx.z == 0 ? static_cast<int64_t>(arrays.layout_sfa[g](coord))
                                           : static_cast<int64_t>(arrays.layout_sfb[g](coord));
    copy.dst[offset] = copy.src[r * copy.ld + b];
  }
}

}  // namespace grouped_sm100

template <class ElementD_, int kTileM, int kTileN, int kTileK>
int Sm100GroupedBilateralGemm<ElementD_, kTileM, kTileN, kTileK>::prepare(const grouped_args::Problem& p,
                                                                         const Arrays& arrays,
                                                                         const grouped_args::Operands& o,
                                                                         cudaStream_t stream) {
  if (cudaMemsetAsync(o.area, 0, operand_bytes(p.m, p.n, p.k, p.groups, p.along_k), stream) != cudaSuccess)
    return launch_status();
  grouped_args::arguments_kernel<Sm100GroupedBilateralGemm><<<1, 32, 0, stream>>>(p, arrays, o);
  const int64_t rows = std::max(p.along_k ? p.m : p.m / p.groups + 1, p.n);  // a group's usual rows: the grid
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((rows * (p.k / 16) + 255) / 256, 1024)),
                  static_cast<unsigned>(p.groups), 2);
  grouped_sm100::swizzle_scales_kernel<Sm100GroupedBilateralGemm><<<grid, 256, 0, stream>>>(arrays);
  return kOk;
}

}  // namespace fp4gen
