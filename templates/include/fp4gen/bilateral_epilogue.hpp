// The epilogue visitor tree both GEMM families share (CUTLASS's SM90 broadcast nodes, which serve
// Blackwell too):
//     D[i, j] = beta * C[i, j] + (alpha * (row_amax[i or 0] * (col_amax[j or 0] * acc[i, j])) + bias[j])
// Each amax side is a vector or a broadcast scalar, chosen at run time through the broadcast nodes'
// `bool` stride; beta = 0 skips reading C; a null bias adds 0 (the node's null default) and reads nothing.
// The bias is fp32 whatever the output: added before the one rounding to the output dtype.
// kPerGroup (grouped GEMMs): the amax and bias arguments are device arrays of one pointer per group, which the
// broadcast nodes index by the group (CUTLASS's array-of-pointers form, element type `float*`).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

namespace fp4gen {

template <class TileShape, class ElementD, bool kPerGroup = false>
struct BilateralEpilogue {
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;
  using Input = std::conditional_t<kPerGroup, float*, float>;
  using Pointer = std::conditional_t<kPerGroup, const float* const*, const float*>;
  // Naming trap: Sm90ColBroadcast broadcasts a column vector (length M), i.e. the per-ROW scale;
  // Sm90RowBroadcast broadcasts a row vector (length N), the per-COLUMN scale.
  using RowAmax = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, Input, float,
                                                              cute::Stride<bool, cute::_0, int64_t>>;
  using ColAmax = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Input, float,
                                                              cute::Stride<cute::_0, bool, int64_t>>;
  using Scalar = cutlass::epilogue::fusion::Sm90ScalarBroadcast<float>;
  using Multiply = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>;
  using ColScaled = cutlass::epilogue::fusion::Sm90EVT<Multiply, ColAmax, cutlass::epilogue::fusion::Sm90AccFetch>;
  using RowColScaled = cutlass::epilogue::fusion::Sm90EVT<Multiply, RowAmax, ColScaled>;
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<Multiply, Scalar, RowColScaled>;
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Input, float,
                                                           cute::Stride<cute::_0, cute::_1, int64_t>>;
  using Add = cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, float, float, kRound>;
  using Biased = cutlass::epilogue::fusion::Sm90EVT<Add, Scaled, Bias>;
  using Tree = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float, kRound>, Scalar,
      cutlass::epilogue::fusion::Sm90SrcFetch<ElementD>, Biased>;

  // The tree's arguments nest like the tree: {child arguments..., node arguments}.
  template <class ThreadArgs>
  static void set_arguments(ThreadArgs& thread, Pointer row_amax, Pointer col_amax, Pointer bias,
                            float alpha, float beta, int64_t row_is_vector, int64_t col_is_vector) {
    thread = {
        {{beta}},  // beta
        {},        // C
        {
            {
                {{alpha}},  // alpha
                {
                    {row_amax, 1.0f, {row_is_vector != 0, cute::_0{}, int64_t(0)}},  // row amax [M] or [1]
                    {
                        {col_amax, 1.0f, {cute::_0{}, col_is_vector != 0, int64_t(0)}},  // column amax [N] or [1]
                        {},                                                           // acc
                        {}},
                    {}},
                {}},
            {bias, 0.0f, {cute::_0{}, cute::_1{}, int64_t(0)}},  // bias [N], or none
            {}},
        {}};
  }
};

}  // namespace fp4gen
