// Running a CUTLASS 3.x GemmUniversalAdapter behind the fp4gen C ABI: status codes, no exceptions.
#pragma once

#include <cutlass/cutlass.h>

#include "fp4gen/abi.h"

namespace fp4gen {

template <class Gemm>
int cutlass_can_implement(typename Gemm::Arguments const& args) {
  return Gemm::can_implement(args) == cutlass::Status::kSuccess ? kOk : kInvalidProblem;
}

// initialize() binds the arguments and workspace (TMA descriptors live in the kernel parameters, so
// nothing is cached between calls); a CUDA error of the launch wins over CUTLASS's own status.
template <class Gemm>
int cutlass_run(typename Gemm::Arguments const& args, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return kInvalidProblem;
  const cutlass::Status status = gemm.run(stream);
  const int cuda = launch_status();
  if (cuda != kOk) return cuda;
  return status == cutlass::Status::kSuccess ? kOk : kInvalidProblem;
}

}  // namespace fp4gen
