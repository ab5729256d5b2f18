// Running a CUTLASS 3.x GemmUniversalAdapter behind the fp4gen C ABI: status codes, no exceptions.
#pragma once

#include <atomic>

#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>

#include "fp4gen/abi.h"

namespace fp4gen {

template <class Gemm>
int cutlass_can_implement(typename Gemm::Arguments const& args) {
  return Gemm::can_implement(args) == cutlass::Status::kSuccess ? kOk : kInvalidProblem;
}

// The kernel's dynamic shared-memory limit, raised on the current device once per process. (The adapter's
// initialize() sets it on every call: a driver call on the host path of every GEMM, for an attribute of the
// kernel and the device that never changes.) A CUDA status, cudaSuccess once set.
template <class Gemm>
cudaError_t raise_shared_memory_limit() {
  using Kernel = typename Gemm::GemmKernel;
  constexpr int kBytes = static_cast<int>(Kernel::SharedStorageSize);
  if constexpr (kBytes < (48 << 10)) {
    return cudaSuccess;  // within the default limit
  } else {
    static std::atomic<bool> raised[kMaxCachedDevices];
    int device = -1;
    if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    const bool cached = device >= 0 && device < kMaxCachedDevices;
    if (cached && raised[device].load(std::memory_order_relaxed)) return cudaSuccess;
    const cudaError_t err =
        cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
    if (err == cudaSuccess && cached) raised[device].store(true, std::memory_order_relaxed);
    return err;
  }
}

// What the adapter's initialize() and run() do, with the shared-memory limit raised once (above): the workspace
// set up, the kernel parameters made from the arguments (TMA descriptors live in them, so nothing is cached
// between calls), the launch. A CUDA error of the launch wins over CUTLASS's own status. `programmatic`
// launches the kernel as the programmatic dependent of the kernel before it: only for kernels built with
// CUTLASS's grid dependency control (CUTLASS_ENABLE_GDC_FOR_SM90), which then wait for it before they read.
template <class Gemm>
int cutlass_run(typename Gemm::Arguments const& args, void* workspace, cudaStream_t stream, bool programmatic = false) {
  using Kernel = typename Gemm::GemmKernel;
  if (Kernel::initialize_workspace(args, workspace, stream, nullptr) != cutlass::Status::kSuccess)
    return kInvalidProblem;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  if (const cudaError_t err = raise_shared_memory_limit<Gemm>(); err != cudaSuccess) {
    cudaGetLastError();  // clear it: the status carries it
    return kCudaErrorBase + static_cast<int>(err);
  }
  const cutlass::Status status = Gemm::run(params, stream, nullptr, programmatic);
  const int cuda = launch_status();
  if (cuda != kOk) return cuda;
  return status == cutlass::Status::kSuccess ? kOk : kInvalidProblem;
}

}  // namespace fp4gen
