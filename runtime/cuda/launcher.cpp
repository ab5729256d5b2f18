// fp4gen's C++ launcher: runs a launch plan (launch_plan.py) in one call from Python. It allocates the plan's
// buffers from PyTorch's allocator, zeroes those the plan zeroes, fills each launch's per-call pointers and
// calls the kernels through their libraries' packed C entries (<name>_run_packed, templates/kernel_abi.cu.j2).
//
// Why: an eager call spends its host time on these steps when Python does them (a ctypes call and a
// torch.empty call each cost microseconds, and a small layer's step makes dozens), not on the launches.
// The plan itself (which kernels, which arguments) is still worked out in Python, once per kind of call.
//
// Compiled against the installed PyTorch on first use (launcher.py); it never includes a CUDA header, so it
// also builds with a CPU-only PyTorch, where tests run plans of host functions.
// ATen, the device guard and torch's pybind11 casters only: with torch/extension.h (all of libtorch's C++ API)
// the compile took about 1.6x the CPU time.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using RunPacked = int (*)(const uint64_t* args, void* stream);

c10::ScalarType dtype_named(const std::string& name) {
  if (name == "uint8") return c10::ScalarType::Byte;
  if (name == "int64") return c10::ScalarType::Long;
  if (name == "float32") return c10::ScalarType::Float;
  if (name == "float16") return c10::ScalarType::Half;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "float8_e4m3fn") return c10::ScalarType::Float8_e4m3fn;
  throw std::invalid_argument("fp4gen launcher: no buffer dtype named " + name);
}

struct Launch {
  RunPacked run;
  std::vector<uint64_t> words;                      // the arguments, a per-call pointer's word left 0
  std::vector<std::pair<int64_t, int64_t>> slots;   // (argument position, slot)
};

class Plan {
 public:
  // inputs: how many per-call tensors run() takes (slots 0 .. inputs-1; buffers follow);
  // buffers: (shape, dtype name) each; zeroed: buffer slots zeroed by each run;
  // launches: (address of <name>_run_packed, argument words, (position, slot) pairs), in launch order.
  Plan(int64_t inputs, const std::vector<std::pair<std::vector<int64_t>, std::string>>& buffers,
       std::vector<int64_t> zeroed,
       const std::vector<std::tuple<uint64_t, std::vector<uint64_t>, std::vector<std::pair<int64_t, int64_t>>>>&
           launches)
      : inputs_(inputs), zeroed_(std::move(zeroed)) {
    const int64_t slots = inputs + static_cast<int64_t>(buffers.size());
    for (const auto& [shape, dtype] : buffers) buffers_.emplace_back(shape, dtype_named(dtype));
    for (int64_t slot : zeroed_)
      TORCH_CHECK(slot >= inputs && slot < slots, "fp4gen launcher: zeroed slot ", slot, " is not a buffer");
    for (const auto& [address, words, fills] : launches) {
      TORCH_CHECK(address != 0, "fp4gen launcher: a launch without an entry point");
      for (const auto& [position, slot] : fills)
        TORCH_CHECK(position >= 0 && position < static_cast<int64_t>(words.size()) && slot >= 0 && slot < slots,
                    "fp4gen launcher: argument ", position, " names slot ", slot, " of ", slots);
      launches_.push_back({reinterpret_cast<RunPacked>(static_cast<uintptr_t>(address)), words, fills});
    }
  }

  // Allocates the buffers on `device` (-1: the CPU), launches on `stream` with `device` current, and returns
  // (buffers, index of the launch that failed or -1, its status).
  std::tuple<std::vector<at::Tensor>, int64_t, int64_t> run(const std::vector<std::optional<at::Tensor>>& inputs,
                                                            int64_t device, uint64_t stream) const {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == inputs_, "fp4gen launcher: the plan takes ", inputs_,
                " inputs, got ", inputs.size());
    const at::Device where = device < 0 ? at::Device(at::kCPU)
                                        : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    c10::OptionalDeviceGuard guard;
    if (device >= 0) guard.reset_device(where);
    std::vector<at::Tensor> buffers;
    buffers.reserve(buffers_.size());
    for (const auto& [shape, dtype] : buffers_)
      buffers.push_back(at::empty(shape, at::TensorOptions().dtype(dtype).device(where)));
    for (int64_t slot : zeroed_) buffers[slot - inputs_].zero_();
    if (launches_.empty()) return {std::move(buffers), -1, 0};
    std::vector<uint64_t> pointers;
    pointers.reserve(inputs.size() + buffers.size());
    for (const auto& input : inputs)
      pointers.push_back(input.has_value() ? reinterpret_cast<uintptr_t>(input->data_ptr()) : 0);
    for (const auto& buffer : buffers) pointers.push_back(reinterpret_cast<uintptr_t>(buffer.data_ptr()));
    std::vector<uint64_t> words;
    for (size_t i = 0; i < launches_.size(); ++i) {
      const Launch& launch = launches_[i];
      words = launch.words;
      for (const auto& [position, slot] : launch.slots) words[position] = pointers[slot];
      const int status = launch.run(words.data(), reinterpret_cast<void*>(static_cast<uintptr_t>(stream)));
      if (status != 0) return {std::move(buffers), static_cast<int64_t>(i), status};
    }
    return {std::move(buffers), -1, 0};
  }

 private:
  int64_t inputs_;
  std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>> buffers_;
  std::vector<int64_t> zeroed_;
  std::vector<Launch> launches_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fp4gen's C++ launcher: runs launch plans (allocations and kernel launches) in one call";
  // An allocation that finds no memory raises torch.OutOfMemoryError, as torch.empty would (pybind11 alone would
  // make it a plain RuntimeError, which callers that catch out-of-memory errors do not catch). Local: for this
  // module's functions only, not for other extensions that share pybind11's internals.
  pybind11::register_local_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) std::rethrow_exception(raised);
    } catch (const c10::OutOfMemoryError& error) {
      PyErr_SetString(pybind11::module_::import("torch").attr("OutOfMemoryError").ptr(),
                      error.what_without_backtrace());
    }
  });
  pybind11::class_<Plan>(m, "Plan")
      .def(pybind11::init<int64_t, const std::vector<std::pair<std::vector<int64_t>, std::string>>&,
                          std::vector<int64_t>,
                          const std::vector<std::tuple<uint64_t, std::vector<uint64_t>,
                                                       std::vector<std::pair<int64_t, int64_t>>>>&>(),
           pybind11::arg("inputs"), pybind11::arg("buffers"), pybind11::arg("zeroed"), pybind11::arg("launches"))
      .def("run", &Plan::run, pybind11::arg("inputs"), pybind11::arg("device"), pybind11::arg("stream"));
}
