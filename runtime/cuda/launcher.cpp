// fp4gen's C++ launcher: runs a launch plan (launch_plan.py) in one call from Python. It allocates the plan's
// buffers from PyTorch's allocator, zeroes those the plan zeroes, fills each launch's per-call pointers and
// calls the kernels through their libraries' packed C entries (<name>_run_packed, templates/kernel_abi.cu.j2).
//
// Why: an eager call spends its host time on these steps when Python does them (a ctypes call and a
// torch.empty call each cost microseconds, and a small layer's step makes dozens), not on the launches.
// The plan itself (which kernels, which arguments) is still worked out in Python, once per kind of call.
//
// It also runs fp4gen.nn.Linear's training steps (LinearStep below): the forward's plan, and an autograd node
// whose backward runs the backward's plan, so that neither direction goes through Python between PyTorch's
// autograd engine and the launches.
//
// Compiled against the installed PyTorch on first use (launcher.py); it never includes a CUDA header, so it
// also builds with a CPU-only PyTorch, where tests run plans of host functions.
// ATen, the device guard, the C++ autograd function and torch's pybind11 casters only: with torch/extension.h
// (all of libtorch's C++ API) the compile took about 1.6x the CPU time.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
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

// Raises RuntimeError("fp4gen launcher: " + message()) unless ok. The message is put together with std::to_string,
// not with TORCH_CHECK's stream formatting: formatting an integer into TORCH_CHECK's message crashed the process
// (segmentation fault in the stream's insertion) with the launcher compiled against torch 2.11 on the GPU machine.
template <typename Message>
void check(bool ok, Message message) {
  if (!ok) throw std::runtime_error("fp4gen launcher: " + message());
}

struct Launch {
  RunPacked run;
  std::vector<uint64_t> words;                      // the arguments, a per-call pointer's word left 0
  std::vector<std::pair<int64_t, int64_t>> slots;   // (argument position, slot)
};

// Where buffers that share one allocation lie in it: each at a multiple of 256 bytes (the kernels need 16, and
// plans are worked out for the alignment of fresh allocations).
constexpr int64_t kShareAlignment = 256;

class Plan {
 public:
  // inputs: how many per-call tensors run() takes (slots 0 .. inputs-1; buffers follow);
  // buffers: (shape, dtype name) each; zeroed: buffer slots zeroed by each run;
  // launches: (address of <name>_run_packed, argument words, (position, slot) pairs), in launch order;
  // shared: per buffer, the allocation it shares with the buffers of the same number (-1, or none: its own).
  Plan(int64_t inputs, const std::vector<std::pair<std::vector<int64_t>, std::string>>& buffers,
       std::vector<int64_t> zeroed,
       const std::vector<std::tuple<uint64_t, std::vector<uint64_t>, std::vector<std::pair<int64_t, int64_t>>>>&
           launches,
       const std::vector<int64_t>& shared)
      : inputs_(inputs), zeroed_(std::move(zeroed)) {
    const int64_t slots = inputs + static_cast<int64_t>(buffers.size());
    for (const auto& [shape, dtype] : buffers) buffers_.emplace_back(shape, dtype_named(dtype));
    check(shared.empty() || shared.size() == buffers.size(), [&] {
      return std::to_string(shared.size()) + " allocation numbers for " + std::to_string(buffers.size()) + " buffers";
    });
    for (size_t i = 0; i < shared.size(); ++i) {
      const int64_t group = shared[i];
      check(group >= -1 && group < static_cast<int64_t>(buffers.size()),
            [&] { return "allocation number " + std::to_string(group) + " out of range"; });
      if (group < 0) {
        placement_.push_back({-1, 0});
        continue;
      }
      if (group >= static_cast<int64_t>(shared_bytes_.size())) shared_bytes_.resize(group + 1, 0);
      const auto& [shape, dtype] = buffers_[i];
      int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
      for (int64_t extent : shape) bytes *= extent;
      placement_.push_back({group, shared_bytes_[group]});
      shared_bytes_[group] += (bytes + kShareAlignment - 1) / kShareAlignment * kShareAlignment;
    }
    for (int64_t slot : zeroed_)
      check(slot >= inputs && slot < slots, [&] { return "zeroed slot " + std::to_string(slot) + " is not a buffer"; });
    for (const auto& [address, words, fills] : launches) {
      check(address != 0, [] { return std::string("a launch without an entry point"); });
      for (const auto& [position, slot] : fills)
        check(position >= 0 && position < static_cast<int64_t>(words.size()) && slot >= 0 && slot < slots, [&] {
          return "argument " + std::to_string(position) + " names slot " + std::to_string(slot) + " of " +
                 std::to_string(slots);
        });
      launches_.push_back({reinterpret_cast<RunPacked>(static_cast<uintptr_t>(address)), words, fills});
    }
  }

  // Allocates the buffers on `device` (-1: the CPU), launches on `stream` with `device` current, and returns
  // (buffers, index of the launch that failed or -1, its status).
  std::tuple<std::vector<at::Tensor>, int64_t, int64_t> run(const std::vector<std::optional<at::Tensor>>& inputs,
                                                            int64_t device, uint64_t stream) const {
    check(static_cast<int64_t>(inputs.size()) == inputs_, [&] {
      return "the plan takes " + std::to_string(inputs_) + " inputs, got " + std::to_string(inputs.size());
    });
    const at::Device where = device < 0 ? at::Device(at::kCPU)
                                        : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    c10::OptionalDeviceGuard guard;
    if (device >= 0) guard.reset_device(where);
    std::vector<at::Tensor> shared;
    for (int64_t bytes : shared_bytes_)
      shared.push_back(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(where)));
    // the backend's dispatch key, as at::empty gives its tensors (the tensor's constructor adds autograd's)
    const c10::DispatchKeySet backend(at::TensorOptions().device(where).computeDispatchKey());
    std::vector<at::Tensor> buffers;
    buffers.reserve(buffers_.size());
    for (size_t i = 0; i < buffers_.size(); ++i) {
      const auto& [shape, dtype] = buffers_[i];
      if (i < placement_.size() && placement_[i].first >= 0) {
        // A tensor over the shared allocation's storage at its offset, made as at::empty makes one (the view
        // operations narrow, view(dtype), view(shape) would cost more host time than the allocations saved)
        const auto [group, offset] = placement_[i];
        const at::Tensor& block = shared[group];
        at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(block.storage()), backend,
                                                                     c10::scalarTypeToTypeMeta(dtype));
        tensor.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
        tensor.unsafeGetTensorImpl()->set_storage_offset(offset / static_cast<int64_t>(c10::elementSize(dtype)));
        buffers.push_back(std::move(tensor));
      } else {
        buffers.push_back(at::empty(shape, at::TensorOptions().dtype(dtype).device(where)));
      }
    }
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

  int64_t inputs() const { return inputs_; }

  // Whether `slot` names one of the buffers (-1, none, if none_ok).
  bool is_buffer(int64_t slot, bool none_ok) const {
    return (none_ok && slot == -1) || (slot >= inputs_ && slot < inputs_ + static_cast<int64_t>(buffers_.size()));
  }

 private:
  int64_t inputs_;
  std::vector<std::pair<std::vector<int64_t>, c10::ScalarType>> buffers_;
  std::vector<int64_t> zeroed_;
  std::vector<Launch> launches_;
  std::vector<std::pair<int64_t, int64_t>> placement_;  // per buffer: (shared allocation or -1, byte offset in it)
  std::vector<int64_t> shared_bytes_;                    // the size of each shared allocation
};

// What a failed launch raises (set by set_errors, kept for the process as new references):
// fp4gen.errors.KernelError, and fp4gen.cuda.library.failure_message(name, call, status), its text.
PyObject* kernel_error = nullptr;
PyObject* failure_message = nullptr;

// Runs `plan`, raising fp4gen.errors.KernelError (through the GIL: backward runs on autograd's threads) if a launch
// fails. `names`: the plan's kernels in launch order.
std::vector<at::Tensor> run_or_raise(const Plan& plan, const std::vector<std::string>& names,
                                     const std::vector<std::optional<at::Tensor>>& inputs, int64_t device,
                                     uint64_t stream) {
  auto [buffers, failed, status] = plan.run(inputs, device, stream);
  if (failed < 0) return std::move(buffers);
  const std::string name = failed < static_cast<int64_t>(names.size()) ? names[failed] : "a kernel";
  // As a Python error carried by a C++ exception: PyTorch's autograd engine moves it from its thread to the one
  // that called backward and raises it there; the module's translator raises it for forward's callers
  python_error error;
  {
    pybind11::gil_scoped_acquire gil;
    std::string message = name + ": run failed with status " + std::to_string(status);
    if (failure_message != nullptr) {
      const auto format = pybind11::reinterpret_borrow<pybind11::object>(failure_message);
      message = format(name, "run", status).cast<std::string>();
    }
    PyErr_SetString(kernel_error != nullptr ? kernel_error : PyExc_RuntimeError, message.c_str());
    error.persist();
  }
  throw error;
}

// The current stream of `device` (-1: none, the CPU) as the raw handle the kernels take.
uint64_t current_stream(int64_t device) {
  if (device < 0) return 0;
  const at::Device where(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(at::kCUDA)->getStream(where);
  return reinterpret_cast<uintptr_t>(stream.native_handle());
}

// A training step of fp4gen.nn.Linear as two plans, built by fp4gen.cuda.linear_steps for one kind of call:
//   forward  inputs (x, no random state, W rowwise data, scale, amax, the epilogue's fp32 bias) -> Y, X columnwise
//   backward inputs (dY, random state, W columnwise triple, X columnwise triple, main_grad) -> dX, dW, dY's sums
//   weight   (a layer that keeps no quantized weight) inputs (W, no random state) -> W columnwise, run at backward
struct LinearStep {
  std::shared_ptr<const Plan> forward, backward;
  std::vector<std::string> forward_kernels, backward_kernels;  // names, for errors
  int64_t y;                   // forward buffer slots
  std::vector<int64_t> x_col;  // X's columnwise (data, scale, amax), none without wgrad
  int64_t dx, dw, sums;        // backward buffer slots, -1 for none
  int64_t rng_advance;         // added to the random state's offset after backward (0: no stochastic rounding)
  int64_t bias_grad;           // 0: no bias; 1: from the backward plan's column sums; 2: dY summed here
  c10::ScalarType bias_dtype;
  std::shared_ptr<const Plan> weight;  // null where W's columnwise copy comes with the call
  std::vector<std::string> weight_kernels;
  std::vector<int64_t> w_col;  // the weight plan's buffer slots of W's columnwise (data, scale, amax)
};

// Keeps a step alive in an autograd context (saved_data holds IValues; a capsule holds any CustomClassHolder).
struct StepHolder : torch::CustomClassHolder {
  explicit StepHolder(std::shared_ptr<const LinearStep> s) : step(std::move(s)) {}
  std::shared_ptr<const LinearStep> step;
};

at::Tensor buffer(const std::vector<at::Tensor>& buffers, const Plan& plan, int64_t slot) {
  return slot < 0 ? at::Tensor() : buffers[slot - plan.inputs()];
}

at::Tensor as_dtype(const at::Tensor& t, c10::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Gives `t`, a buffer that this call just made and shares with no one, the contiguous shape `sizes` of as many
// elements: the step's [tokens, features] buffers as the caller's [..., features] tensors, without a view (an
// output view would add a view node for autograd to walk back, and forbid in-place use of Y).
at::Tensor reshaped_buffer(at::Tensor t, at::IntArrayRef sizes) {
  if (t.sizes() != sizes) t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

// The gradients at the positions `marked`, each made to require grad through a node that raises "trying to
// differentiate twice" if a backward reaches it (what Python's once_differentiable returns); the others unchanged.
torch::autograd::variable_list first_order_only(torch::autograd::variable_list grads,
                                               const std::vector<size_t>& marked) {
  torch::autograd::variable_list raised;
  for (size_t i : marked) raised.push_back(grads[i].detach().requires_grad_(true));
  auto error = std::make_shared<torch::autograd::DelayedError>(
      "trying to differentiate twice: fp4gen.nn.Linear's backward is not differentiable (its GEMMs run on NVFP4 "
      "copies), so no higher-order gradient (create_graph=True) can pass through the layer",
      static_cast<int64_t>(raised.size()));
  raised = (*error)(std::move(raised));
  for (size_t j = 0; j < marked.size(); ++j) grads[marked[j]] = std::move(raised[j]);
  return grads;
}

// Y = X Wᵀ (+ bias) with X quantized on the way; backward: dY quantized, then dX = dY W and dW = dYᵀ X (or dW
// accumulated into main_grad inside the GEMM), with db. x is [..., K] with contiguous rows of K, as the step's
// [tokens, K]; Y is [..., N] and dX is shaped as x. operands: W rowwise (3), W columnwise (3), the epilogue's fp32
// bias, main_grad, the random state (each may be None where the step has no use for it).
struct LinearFunction : public torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const std::shared_ptr<const LinearStep>& step,
                            const std::vector<std::optional<at::Tensor>>& operands, int64_t device) {
    const Plan& plan = *step->forward;
    const auto buffers = run_or_raise(plan, step->forward_kernels,
                                      {x, std::nullopt, operands[0], operands[1], operands[2], operands[6]}, device,
                                      current_stream(device));
    torch::autograd::variable_list saved;
    for (int64_t slot : step->x_col) saved.push_back(buffer(buffers, plan, slot));
    saved.resize(3);
    if (step->weight) {  // W itself, quantized again at backward (as torch.nn.Linear, it saves the weight)
      saved.push_back(weight);
      saved.resize(6);
    } else {
      for (int i = 3; i < 6; ++i) saved.push_back(operands[i].value_or(at::Tensor()));
    }
    ctx->save_for_backward(std::move(saved));  // NVFP4 copies only (X's are absent without wgrad), or W
    ctx->saved_data["step"] = at::IValue::make_capsule(c10::make_intrusive<StepHolder>(step));
    ctx->saved_data["main_grad"] = operands[7];
    ctx->saved_data["rng_state"] = operands[8];
    ctx->saved_data["device"] = device;
    // which of x (1) and W (2) required grad: dW depends on x and dX on W (see backward)
    ctx->saved_data["requires_grad"] = int64_t{x.requires_grad()} | int64_t{weight.requires_grad()} << 1;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    at::Tensor y = buffer(buffers, plan, step->y);
    std::vector<int64_t> y_sizes = x.sizes().vec();
    y_sizes.back() = y.size(1);
    return reshaped_buffer(std::move(y), y_sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // A backward with create_graph=True runs in grad mode. This one is not differentiable (its GEMMs take NVFP4
    // copies), so each gradient that depends on a tensor requiring grad (dX = dY W on dY and W, dW = dYᵀ X on dY
    // and x, db on dY) then comes out of a node that raises if a second backward reaches it, instead of as a
    // constant that would silently drop the layer from a higher-order gradient (fp4gen/first_order.py, the
    // layer's Python function, does the same).
    if (at::GradMode::is_enabled()) {
      const bool dy = grads[0].requires_grad();
      const int64_t inputs = ctx->saved_data["requires_grad"].toInt();
      const bool depends[3] = {dy || (inputs & 2) != 0, dy || (inputs & 1) != 0, dy};
      torch::autograd::variable_list results;
      {
        at::NoGradGuard no_grad;  // nothing below is recorded (the bias gradient's sum included)
        results = gradients(ctx, std::move(grads));
      }
      std::vector<size_t> marked;
      for (size_t i = 0; i < 3; ++i) {
        if (depends[i] && results[i].defined()) marked.push_back(i);
      }
      return marked.empty() ? results : first_order_only(std::move(results), marked);
    }
    return gradients(ctx, std::move(grads));
  }

  // dX, dW (or none: accumulated into main_grad) and db, from the step's backward plan.
  static torch::autograd::variable_list gradients(torch::autograd::AutogradContext* ctx,
                                                  torch::autograd::variable_list grads) {
    const auto holder = ctx->saved_data["step"].toCapsule();
    const LinearStep& step = *static_cast<const StepHolder*>(holder.get())->step;
    const auto saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> main_grad = ctx->saved_data["main_grad"].toOptional<at::Tensor>();
    const std::optional<at::Tensor> rng_state = ctx->saved_data["rng_state"].toOptional<at::Tensor>();
    const int64_t device = ctx->saved_data["device"].toInt();
    // The plan was made for a contiguous dY at a 16-byte aligned address (autograd's own gradients are); any other
    // dY is copied into one, which changes no value
    at::Tensor dy = grads[0].contiguous();
    if (reinterpret_cast<uintptr_t>(dy.data_ptr()) % 16) dy = dy.clone();
    std::array<at::Tensor, 3> w_col = {saved[3], saved[4], saved[5]};
    if (step.weight) {
      const auto made = run_or_raise(*step.weight, step.weight_kernels, {saved[3], std::nullopt}, device,
                                     current_stream(device));
      for (int i = 0; i < 3; ++i) w_col[i] = buffer(made, *step.weight, step.w_col[i]);
    }
    const Plan& plan = *step.backward;
    const auto buffers = run_or_raise(plan, step.backward_kernels,
                                      {dy, step.rng_advance ? rng_state : std::nullopt, optional_of(w_col[0]),
                                       optional_of(w_col[1]), optional_of(w_col[2]), optional_of(saved[0]),
                                       optional_of(saved[1]), optional_of(saved[2]), main_grad},
                                      device, current_stream(device));
    if (step.rng_advance) rng_state->slice(0, 1).add_(step.rng_advance);  // as RNGState.advance, after the draws
    at::Tensor db;
    if (step.bias_grad == 1) db = as_dtype(buffer(buffers, plan, step.sums), step.bias_dtype);
    if (step.bias_grad == 2) {  // dY summed over its tokens in fp32, rounded once
      db = as_dtype(dy.view({-1, dy.size(-1)}).sum({0}, false, at::kFloat), step.bias_dtype);
    }
    at::Tensor dx = buffer(buffers, plan, step.dx);
    if (dx.defined()) dx = reshaped_buffer(std::move(dx), ctx->saved_data["x_sizes"].toIntVector());
    return {dx, buffer(buffers, plan, step.dw), db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
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
    } catch (python_error& error) {  // a failed launch of a Linear step (run_or_raise)
      error.restore();
    } catch (const c10::OutOfMemoryError& error) {
      PyErr_SetString(pybind11::module_::import("torch").attr("OutOfMemoryError").ptr(),
                      error.what_without_backtrace());
    }
  });
  pybind11::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(pybind11::init<int64_t, const std::vector<std::pair<std::vector<int64_t>, std::string>>&,
                          std::vector<int64_t>,
                          const std::vector<std::tuple<uint64_t, std::vector<uint64_t>,
                                                       std::vector<std::pair<int64_t, int64_t>>>>&,
                          const std::vector<int64_t>&>(),
           pybind11::arg("inputs"), pybind11::arg("buffers"), pybind11::arg("zeroed"), pybind11::arg("launches"),
           pybind11::arg("shared") = std::vector<int64_t>())
      .def("run", &Plan::run, pybind11::arg("inputs"), pybind11::arg("device"), pybind11::arg("stream"));
  pybind11::class_<LinearStep, std::shared_ptr<LinearStep>>(m, "LinearStep")
      .def(pybind11::init([](std::shared_ptr<Plan> forward, std::vector<std::string> forward_kernels, int64_t y,
                             std::vector<int64_t> x_col, std::shared_ptr<Plan> backward,
                             std::vector<std::string> backward_kernels, int64_t dx, int64_t dw, int64_t sums,
                             int64_t rng_advance, int64_t bias_grad, const std::string& bias_dtype,
                             std::shared_ptr<Plan> weight, std::vector<std::string> weight_kernels,
                             std::vector<int64_t> w_col) {
             check(x_col.empty() || x_col.size() == 3, [] { return std::string("X's columnwise copy is 3 slots"); });
             check(bias_grad >= 0 && bias_grad <= 2, [] { return std::string("bias_grad is 0, 1 or 2"); });
             check(weight ? w_col.size() == 3 && dx >= 0 : w_col.empty(), [] {
               return std::string("a weight plan makes W's columnwise copy (3 slots) for a backward with dX");
             });
             bool buffers = forward->is_buffer(y, false);
             for (int64_t slot : x_col) buffers = buffers && forward->is_buffer(slot, false);
             for (int64_t slot : {dx, dw}) buffers = buffers && backward->is_buffer(slot, true);
             buffers = buffers && backward->is_buffer(sums, bias_grad != 1);
             for (int64_t slot : w_col) buffers = buffers && weight->is_buffer(slot, false);
             check(buffers, [] { return std::string("a LinearStep's output slots must name its plans' buffers"); });
             return std::make_shared<LinearStep>(LinearStep{std::move(forward), std::move(backward),
                                                            std::move(forward_kernels), std::move(backward_kernels),
                                                            y, std::move(x_col), dx, dw, sums, rng_advance, bias_grad,
                                                            dtype_named(bias_dtype), std::move(weight),
                                                            std::move(weight_kernels), std::move(w_col)});
           }),
           pybind11::arg("forward"), pybind11::arg("forward_kernels"), pybind11::arg("y"), pybind11::arg("x_col"),
           pybind11::arg("backward"), pybind11::arg("backward_kernels"), pybind11::arg("dx"), pybind11::arg("dw"),
           pybind11::arg("sums"), pybind11::arg("rng_advance"), pybind11::arg("bias_grad"),
           pybind11::arg("bias_dtype"), pybind11::arg("weight") = nullptr,
           pybind11::arg("weight_kernels") = std::vector<std::string>(),
           pybind11::arg("w_col") = std::vector<int64_t>());
  // Y of one training step (autograd records the backward node); operands as LinearFunction takes them
  m.def("linear_step",
        [](const std::shared_ptr<LinearStep>& step, const at::Tensor& x, const at::Tensor& weight,
           const std::optional<at::Tensor>& bias, const std::vector<std::optional<at::Tensor>>& operands,
           int64_t device) {
          check(operands.size() == 9,
                [&] { return "linear_step takes 9 operands, got " + std::to_string(operands.size()); });
          return LinearFunction::apply(x, weight, bias, std::shared_ptr<const LinearStep>(step), operands, device);
        },
        pybind11::arg("step"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("operands"), pybind11::arg("device"));
  // Y of a forward without autograd (linear_steps.ForwardStep): the forward plan's inputs are x [..., K] (its
  // [tokens, K] in any contiguous shape of the same memory), no random state, W rowwise (3) and the epilogue's
  // fp32 bias; Y comes back [..., N]
  m.def("forward_step",
        [](const std::shared_ptr<Plan>& plan, const std::vector<std::string>& kernels, int64_t y, const at::Tensor& x,
           const std::vector<std::optional<at::Tensor>>& w_row_and_bias, int64_t device) {
          check(w_row_and_bias.size() == 4,
                [] { return std::string("forward_step takes W's 3 tensors and the bias"); });
          check(plan->is_buffer(y, false),
                [] { return std::string("forward_step's y must name a buffer of its plan"); });
          const auto buffers = run_or_raise(*plan, kernels,
                                            {x, std::nullopt, w_row_and_bias[0], w_row_and_bias[1],
                                             w_row_and_bias[2], w_row_and_bias[3]},
                                            device, current_stream(device));
          at::Tensor out = buffer(buffers, *plan, y);
          std::vector<int64_t> sizes = x.sizes().vec();
          sizes.back() = out.size(1);
          return reshaped_buffer(std::move(out), sizes);
        },
        pybind11::arg("plan"), pybind11::arg("kernels"), pybind11::arg("y"), pybind11::arg("x"),
        pybind11::arg("w_row_and_bias"), pybind11::arg("device"));
  // What a failed launch raises: the exception type and the texts of the kernels' refusal statuses
  m.def("set_errors", [](pybind11::object error_type, pybind11::object message) {
    Py_XDECREF(kernel_error);
    Py_XDECREF(failure_message);
    kernel_error = error_type.release().ptr();
    failure_message = message.release().ptr();
  });
}
