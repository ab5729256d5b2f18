// The C ABI every fp4gen kernel library exports: status codes, no C++ exception crosses it.
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

// Launches `kernel` as the programmatic dependent of the kernel launched before it on `stream`: its CTAs may
// start once every CTA of that kernel has run griddepcontrol.launch_dependents (or exited), and it runs
// griddepcontrol.wait before it touches what that kernel writes. After anything else it is an ordinary
// launch. Returns launch_status().
template <class... Params, class... Args>
int launch_programmatic_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                                  cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, args...);
  return launch_status();
}

}  // namespace fp4gen

// One definition per library: every library is a single translation unit.
FP4GEN_EXPORT int fp4gen_abi_version(void) { return FP4GEN_ABI_VERSION; }
