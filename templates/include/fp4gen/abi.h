// The C ABI every fp4gen kernel library exports: status codes, no C++ exception crosses it.
//
// Each generated translation unit is one library with one kernel <name> and exports
//   int    fp4gen_abi_version(void)
//   int    <name>_can_implement(params...)          FP4GEN_OK or the rule the problem breaks
//   size_t <name>_workspace_size(params...)         scratch bytes the caller allocates
//   int    <name>_run(params..., cudaStream_t)      FP4GEN_OK, a rule status, or a CUDA error
//   int    <name>_run_packed(const uint64_t* args, cudaStream_t)
//                                                   the same run with its parameters as one word each (a
//                                                   pointer or int64_t as its 64 bits, a float as its bits in
//                                                   the low 32): one signature for every kernel, which the
//                                                   runtime's C++ launcher calls without knowing the family
// The parameter list of each family is declared once, in codegen/families.py, and recorded in
// generated/manifest.json, from which the runtime builds its ctypes signatures. No C++ exception
// crosses this boundary.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>

#include <cuda_runtime.h>

#define FP4GEN_ABI_VERSION 2
#define FP4GEN_EXPORT extern "C" __attribute__((visibility("default")))

namespace fp4gen {

// Status codes; runtime/cuda/library.py turns each into a message.
enum Status : int {
  kOk = 0,
  kInvalidProblem = 1,     // a shape or stride rule is broken
  kMisaligned = 2,         // a pointer or row stride breaks the kernel's vector-access alignment
  kCudaErrorBase = 1000,   // + the cudaError_t of a failed launch
};

// A float parameter of <name>_run_packed: its bits in the word's low 32.
inline float float_from_word(uint64_t word) {
  const uint32_t bits = static_cast<uint32_t>(word);
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// (host and device: the launchers check their arguments with it, kernels their output pieces)
__host__ __device__ inline bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}

// Workspace areas start at 256-byte boundaries (what cudaMalloc gives a whole allocation): every vector access,
// TMA's 16-byte and 128-byte rules included, then holds within each area.
constexpr size_t round_to_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

inline int launch_status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? kOk : kCudaErrorBase + static_cast<int>(err);
}

// Per-device facts that launchers need on every call and that do not change while the process runs: looked up
// once per device and kept (a lookup costs a CUDA runtime call on the host path of every launch). Two threads
// that race on the first lookup both compute the same value.
constexpr int kMaxCachedDevices = 64;

// The current device and its multiprocessor count; false on a CUDA error.
inline bool current_device_multiprocessors(int* device, int* sms) {
  static std::atomic<int> cache[kMaxCachedDevices];
  if (cudaGetDevice(device) != cudaSuccess) return false;
  if (*device < 0 || *device >= kMaxCachedDevices)
    return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, *device) == cudaSuccess;
  *sms = cache[*device].load(std::memory_order_relaxed);
  if (*sms > 0) return true;
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, *device) != cudaSuccess) return false;
  cache[*device].store(*sms, std::memory_order_relaxed);
  return true;
}

// CTAs of kKernel per multiprocessor on `device` with `threads` threads and `shared_bytes` of dynamic shared
// memory (kept for the last shared_bytes asked on each device); false on a CUDA error.
template <auto kKernel>
bool cached_occupancy(int device, int threads, size_t shared_bytes, int* per_sm) {
  static std::atomic<uint64_t> cache[kMaxCachedDevices];  // (shared_bytes + 1) << 32 | per_sm; 0: none yet
  const bool cacheable = device >= 0 && device < kMaxCachedDevices && shared_bytes < (size_t{1} << 31);
  const uint64_t tag = static_cast<uint64_t>(shared_bytes + 1) << 32;
  if (cacheable) {
    const uint64_t entry = cache[device].load(std::memory_order_relaxed);
    if ((entry & ~uint64_t{0xFFFFFFFFu}) == tag) return *per_sm = static_cast<int>(entry & 0xFFFFFFFFu), true;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kKernel, threads, shared_bytes) != cudaSuccess)
    return false;
  if (cacheable) cache[device].store(tag | static_cast<uint32_t>(*per_sm), std::memory_order_relaxed);
  return true;
}

// Raises kKernel's dynamic shared memory limit to at least `bytes` on the current device (kernels above 48 KB
// must opt in; the attribute is per function and device, so it is set once per device, or again for more). The
// limit only ever rises, under a lock, so that a thread asking for less never lowers it under one that launches
// with more.
template <auto kKernel>
cudaError_t opt_in_shared_bytes(int device, size_t bytes) {
  static std::atomic<size_t> granted[kMaxCachedDevices];
  static std::mutex raising;
  if (device < 0 || device >= kMaxCachedDevices)
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (granted[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  const std::lock_guard<std::mutex> lock(raising);
  if (granted[device].load(std::memory_order_relaxed) >= bytes) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess) granted[device].store(bytes, std::memory_order_release);
  return err;
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
