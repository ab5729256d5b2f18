// The C ABI every fp4gen kernel library exports (design.md section 7, rule 8).
//
// Each generated translation unit is one library with one kernel <name> and exports
//   int    fp4gen_abi_version(void)
//   int    <name>_can_implement(params...)          FP4GEN_OK or the rule the problem breaks
//   size_t <name>_workspace_size(params...)         scratch bytes the caller allocates
//   int    <name>_run(params..., cudaStream_t)      FP4GEN_OK, a rule status, or a CUDA error
// The parameter list of each family is declared once, in codegen/families.py, and recorded in
// generated/manifest.json, from which the runtime builds its ctypes signatures. No C++ exception
// crosses this boundary.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#define FP4GEN_ABI_VERSION 1
#define FP4GEN_EXPORT extern "C" __attribute__((visibility("default")))

namespace fp4gen {

// Status codes; runtime/cuda/library.py turns each into a message.
enum Status : int {
  kOk = 0,
  kInvalidProblem = 1,     // a shape or stride rule is broken
  kMisaligned = 2,         // a pointer or row stride breaks the kernel's vector-access alignment
  kCudaErrorBase = 1000,   // + the cudaError_t of a failed launch
};

// (host and device: the launchers check their arguments with it, kernels their output pieces)
__host__ __device__ inline bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

inline int launch_status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? kOk : kCudaErrorBase + static_cast<int>(err);
}

}  // namespace fp4gen

// One definition per library: every library is a single translation unit.
FP4GEN_EXPORT int fp4gen_abi_version(void) { return FP4GEN_ABI_VERSION; }
