"""fp4gen.nn.Linear: a torch.nn.Linear whose fprop, dgrad and wgrad GEMMs run in NVFP4 (and GroupedLinear, the
experts of a mixture-of-experts layer, in grouped_linear.py).

    fprop  Y  = X Wᵀ   X rowwise (row-scaled)        x  W rowwise (per tensor)
    dgrad  dX = dY W   dY rowwise (per tensor)       x  W columnwise
    wgrad  dW = dYᵀ X  dY columnwise (per tensor)    x  X columnwise (per-column amax when row-scaled)

with the default Recipe; its options change the scalings (gradient_scaling), transform both wgrad operands
(hadamard_wgrad, the default), round dY stochastically (stochastic_rounding) or pick 4over6 scales for X
and/or W (four_over_six).

Forward saves only NVFP4 copies for backward (X columnwise, W columnwise), never the high-precision X; with
keep_quantized_weight=False it saves the weight itself instead of W's copy, and backward quantizes it again.
The quantized weight is cached while the weight is unchanged: the cache key holds the weight's version
counter (bumped by every in-place update through the parameter) and a count of optimizer steps taken in
the process, because FSDP2 refills an unsharded weight after an optimizer step without bumping its
version counter; an entry also holds a weak reference to the weight it was made from (cache_holds), and every
cache is dropped just before an optimizer step. clear_weight_caches covers changes none of these can see.
A static cache (static_weight_caches, for CUDA graphs and torch.compile) is remade in place instead, and a frozen
one (frozen_weight_caches, for weights no optimizer moves) is left alone by optimizer steps (weight_caches.py).

Under torch.autocast the layer computes in the autocast dtype, as torch.nn.Linear does: the input is cast
to it, the output has it, and the bias is added in it. The weight is quantized from its own values (fp32
master weights give their fp32 values to the quantizer, not a bf16 rounding of them), and the weight and
bias gradients come back in the parameters' dtypes.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import torch_ops
from .api import INPUT_DTYPES, choose_backend, dtype_names, refuse_function_transforms
from .first_order import first_order_only
from .formats import BLOCK
from .lasting import made_to_last
from .options import column_sums_dtype
from .recipe import Recipe
from .row_layout import readable_copy
from .rng import default_state_tensor
from .weight_caches import (STATIC_HOLDERS, cache_holds, current_entry, graph_payload, has_gradient, kept_entry,
                            made_static, refresh_static_holders)

GEMM_OUT = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float32, torch.float16: torch.float32}
PARAM_DTYPES = INPUT_DTYPES  # the parameters are quantized as they are


_NO_RNG = {}  # device -> the empty rng_state that eager calls share


def _no_rng(like: torch.Tensor) -> torch.Tensor:
    """The rng_state argument of a quantize call that draws no random bits (never read or written): in eager
    mode one empty tensor a device, instead of an allocation a call; a new one while torch.compile traces."""
    if torch.compiler.is_compiling():
        return like.new_empty(0, dtype=torch.int64)
    state = _NO_RNG.get(like.device)
    if state is None:
        state = _NO_RNG[like.device] = made_to_last(like.new_empty, 0, dtype=torch.int64)
    return state


def traced_or_captured(t: torch.Tensor) -> bool:
    """Whether this call is traced by torch.compile or captured into a CUDA graph: then a layer's cached
    conversions (quantized weight, epilogue bias) must be part of the graph, since a cache hit at trace or
    capture time would leave a graph that never redoes them after optimizer updates."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def kernel_readable_rows(t: torch.Tensor) -> torch.Tensor:
    """t [rows, cols] itself where the quantize kernels can read it as it lies, else a contiguous copy of it in new
    memory (row_layout.readable_copy).

    A layer takes whatever a model hands it, as torch.nn.Linear does: a transposed view, rows broadcast from one,
    a view that starts part-way into a buffer. fp4gen.quantize refuses those layouts instead and says why; a slice
    of a wider tensor whose rows start aligned is read in place by both."""
    if torch.compiler.is_compiling():  # no addresses while tracing: the layout alone (a contiguous view that
        return t.contiguous()          # starts off 16 bytes meets the kernels' own alignment error there)
    return readable_copy(t)


def e4m3_max_of(four_over_six) -> float:
    """The e4m3_max of an operand quantized with this four_over_six argument."""
    return 448.0 if four_over_six is None else 256.0


# Every optimizer step in the process, whatever the optimizer, invalidates cached weight quantizations.
# The version counter alone misses weights that a wrapper refreshes with the counter preserved (FSDP2's
# all-gather into the unsharded parameter does exactly that).
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs):
    global _optimizer_steps
    _optimizer_steps += 1


# The layers (and stacked-weight caches) that hold a cached quantization now.
_CACHE_HOLDERS = weakref.WeakSet()


def _drop_weight_caches(optimizer, args, kwargs):
    """Before every optimizer step, forget every cached quantization but the frozen ones: the step makes each one
    stale anyway (the count of steps is part of every other key), and dropped here their memory (about a byte a
    weight parameter: both copies) is free for the optimizer's own peak instead of held until each layer's next
    forward."""
    # frozen caches are kept on purpose (a reference model beside an FSDP2 policy): no warning for them
    if (not _SHARDED_WARNING_GIVEN and _steps_sharded_parameters(optimizer)
            and any(holder.holds_weight_copy() and not holder.frozen_weight_cache for holder in list(_CACHE_HOLDERS))):
        _warn_kept_copies_of_sharded_weights()
    frozen = []
    for holder in list(_CACHE_HOLDERS):
        if not moved_by_optimizer_steps(holder):
            frozen.append(holder)
        elif not holder.static_weight_cache:  # a static cache is remade in place after the step instead
            holder.clear_weight_cache()
    _CACHE_HOLDERS.clear()
    _CACHE_HOLDERS.update(frozen)


def moved_by_optimizer_steps(holder) -> bool:
    """Whether an optimizer step may move the tensors that a cache holder's entries were made from: yes, unless the
    holder is frozen (frozen_weight_caches) and none of them has a gradient; a frozen layer whose weight or bias
    has one is being trained after all, and is treated as any other (with a warning, once a process)."""
    if not holder.frozen_weight_cache:
        return True
    if holder.has_gradients():
        _warn_frozen_cache_with_gradient()
        return True
    return False


_FROZEN_WARNING_GIVEN = False


def _warn_frozen_cache_with_gradient() -> None:
    global _FROZEN_WARNING_GIVEN
    if _FROZEN_WARNING_GIVEN:
        return
    _FROZEN_WARNING_GIVEN = True
    warnings.warn("fp4gen: an optimizer steps while a layer whose weight cache is frozen "
                  "(fp4gen.nn.frozen_weight_caches) has a gradient on its weight or bias, so that layer is being "
                  "trained: its cache is dropped (or, static, remade) at optimizer steps like any other's while it "
                  "has one. Freeze only the caches of layers that no optimizer moves.", stacklevel=3)


# Whether each optimizer seen steps DTensor parameters (FSDP2 leaves its shards as DTensors between steps); looked
# up once an optimizer, until the warning below has been given.
_STEPS_SHARDED = weakref.WeakKeyDictionary()
_SHARDED_WARNING_GIVEN = False


def _steps_sharded_parameters(optimizer) -> bool:
    sharded = _STEPS_SHARDED.get(optimizer)
    if sharded is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a PyTorch without torch.distributed
            DTensor = ()
        sharded = _STEPS_SHARDED[optimizer] = any(isinstance(p, DTensor) for group in optimizer.param_groups
                                                  for p in group["params"])
    return sharded


def _warn_kept_copies_of_sharded_weights() -> None:
    """Once a process: layers kept quantized copies of gathered weights in a step whose optimizer steps shards."""
    global _SHARDED_WARNING_GIVEN
    _SHARDED_WARNING_GIVEN = True
    warnings.warn("fp4gen: this optimizer steps sharded parameters (DTensors, as FSDP2 leaves them), and fp4gen layers "
                  "kept quantized copies of their whole, gathered weights in this step (about a byte a parameter on "
                  "every rank, more than a shard across many ranks). Under FSDP2 build them with "
                  "keep_quantized_weight=False (fp4gen.convert, fp4gen.nn.Linear, fp4gen.nn.GroupedLinear and "
                  "fp4gen.hf_experts.register take it): the same results, no copy kept between calls.", stacklevel=3)


def _refresh_static_caches(optimizer, args, kwargs):
    refresh_static_holders(moved_by_optimizer_steps)


register_optimizer_step_pre_hook(_drop_weight_caches)
register_optimizer_step_post_hook(_count_optimizer_step)
register_optimizer_step_post_hook(_refresh_static_caches)  # after the count: the remade entries' keys hold it


def _step_plans(ops, t: torch.Tensor):
    """fp4gen.cuda.linear_steps where an eager step on t can run as one launch plan a direction (CUDA tensors of
    the CUDA backend through the C++ launcher, bf16 or fp32, whose GEMMs write that dtype), else None: a forward
    without autograd as linear_steps.ForwardStep, a training step as the launcher's LinearStep."""
    if (ops is not torch_ops.EAGER or not t.is_cuda or t.dtype not in _STEP_DTYPES or not t.numel()
            or t.stride(-1) != 1 or choose_backend(t.device, None) != "cuda"):
        return None
    from .cuda import launcher, linear_steps
    return linear_steps if launcher.enabled() else None


_STEP_DTYPES = (torch.bfloat16, torch.float32)  # GEMM_OUT keeps them: the GEMMs write the layer's dtype


def _fprop(ops, x2d, w_row, recipe, need_wgrad, epilogue_bias, ask_for_step: bool = True) -> tuple:
    """(Y = X Wᵀ (+ the bias, in the epilogue) in x2d's dtype, X's quantize outputs, X's and W's e4m3_max).
    X's columnwise copy (for wgrad) is made only with need_wgrad. ask_for_step=False: the separate calls, without
    asking linear_steps for a ForwardStep."""
    # X's columnwise copy comes from the same quantize call as its rowwise copy; with hadamard_wgrad that copy
    # is quantized from the RHT of X along the tokens, like dY's in backward
    x_hadamard = recipe.hadamard_wgrad and need_wgrad
    x_four_over_six = recipe.activation_four_over_six
    x_e4m3_max = e4m3_max_of(x_four_over_six)
    w_e4m3_max = e4m3_max_of(recipe.weight_four_over_six)
    steps = _step_plans(ops, x2d) if ask_for_step else None
    step = steps and steps.forward_step(x2d, w_row, recipe, need_wgrad, epilogue_bias, x_e4m3_max, w_e4m3_max)
    if step:  # the same kernels as the calls below, from one launch plan
        y, x_col = step.run(x2d, w_row, epilogue_bias)
        return y, (None,) * 3 + (x_col or (None,) * 3), x_e4m3_max, w_e4m3_max
    q = ops.quantize(x2d, recipe.activation_scaling, [1, BLOCK], True, need_wgrad, "nearest", x_hadamard,
                     x_four_over_six, _no_rng(x2d))
    # The bias is added in the GEMM's epilogue (epilogue_bias: Linear._epilogue_bias), in fp32 before Y's
    # one rounding (no pass over Y).
    y = ops.gemm(*q[:3], *w_row, GEMM_OUT[x2d.dtype], x_e4m3_max, w_e4m3_max, epilogue_bias)
    # Convert only when needed: a no-op .to() returns its input, and PyTorch 2.11's compile of an
    # autograd.Function whose output aliases an intermediate sends the gradient to the wrong output
    # (zero weight gradients; pytorch/pytorch#180642).
    if y.dtype != x2d.dtype:
        y = y.to(x2d.dtype)
    return y, q, x_e4m3_max, w_e4m3_max


class _NVFP4LinearFunction(torch.autograd.Function):
    """Operands are (data, scale, amax) triples from the fp4gen custom ops, so torch.compile traces the
    whole step as opaque operators."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, w_row, w_col, recipe, main_grad, need_wgrad, rng_state, epilogue_bias):
        y, q, x_e4m3_max, w_e4m3_max = _fprop(torch_ops.for_caller(), x2d, w_row, recipe, need_wgrad, epilogue_bias)
        # NVFP4 copies of X (absent without wgrad) and W; without a kept W copy (w_col None: the layer's
        # keep_quantized_weight=False), the weight itself, quantized again in backward where dgrad needs it
        ctx.weight_quantized_in_backward = w_col is None
        if w_col is None:
            w_col = (weight,) if ctx.needs_input_grad[0] else ()
        ctx.save_for_backward(*q[3:], *w_col)
        ctx.main_grad, ctx.x_dtype, ctx.need_wgrad = main_grad, x2d.dtype, need_wgrad
        ctx.w_dtype, ctx.bias_dtype = weight.dtype, bias.dtype if bias is not None else None
        ctx.needs_x_grad = ctx.needs_input_grad[0]
        ctx.recipe, ctx.rng_state = recipe, rng_state
        ctx.x_e4m3_max, ctx.w_e4m3_max = x_e4m3_max, w_e4m3_max
        return y

    @staticmethod
    @first_order_only("fp4gen.nn.Linear", {0: (1,), 1: (0,)})  # dX = dY W, dW = dYᵀ X: a second backward raises
    def backward(ctx, dy):
        ops = torch_ops.for_caller()
        saved = ctx.saved_tensors
        x_col, w_col = saved[:3], saved[3:]
        recipe = ctx.recipe
        dy = kernel_readable_rows(dy)
        dx = dw = db = None
        # db from the pass that quantizes dY (its amax pass sums the columns) where that pass has an amax pass of
        # its own: tensor-scaled gradients in eager mode; else summed on its own below
        sums_with_dy = ctx.bias_dtype is not None and recipe.gradient_scaling == "tensor" and ops is torch_ops.EAGER
        if ctx.needs_x_grad or ctx.need_wgrad:
            q = ops.quantize(dy, recipe.gradient_scaling, [1, BLOCK], ctx.needs_x_grad, ctx.need_wgrad,
                             recipe.gradient_rounding, recipe.hadamard_wgrad and ctx.need_wgrad, None, ctx.rng_state,
                             *((column_sums_dtype(ctx.bias_dtype, dy.dtype),) if sums_with_dy else ()))
            if sums_with_dy:
                db, q = _as(q[6], ctx.bias_dtype), q[:6]
            if ctx.needs_x_grad:  # dgrad: dY [M, N] x (W columnwise = Wᵀ [K, N])
                if ctx.weight_quantized_in_backward:
                    w_col = quantize_weight(ops, w_col[0].detach(), recipe, rowwise=False)[3:]
                dx = _as(ops.gemm(*q[:3], *w_col, GEMM_OUT[ctx.x_dtype], 448.0, ctx.w_e4m3_max), ctx.x_dtype)
            if ctx.need_wgrad:  # wgrad: (dY columnwise = dYᵀ [N, M]) x (X columnwise = Xᵀ [K, M])
                if ctx.main_grad is not None:  # fp32 main-grad accumulation inside the GEMM epilogue
                    ops.gemm_accumulate(ctx.main_grad, *q[3:], *x_col, 448.0, ctx.x_e4m3_max)
                else:  # in the weight's dtype: fp32 master weights under autocast get fp32 gradients. The
                    # epilogue writes bf16 and fp32 itself (one rounding of its fp32 result, as a separate
                    # conversion would do, without the extra launch and fp32 copy); fp16 goes through fp32.
                    dw = _as(ops.gemm(*q[3:], *x_col, GEMM_OUT[ctx.w_dtype], 448.0, ctx.x_e4m3_max), ctx.w_dtype)
        if ctx.bias_dtype is not None and db is None:  # summed in fp32, rounded once to the bias's dtype
            db = _as(dy.sum(0, dtype=torch.float32), ctx.bias_dtype)
        return dx, dw, db, None, None, None, None, None, None, None


def quantize_weight(ops, w: torch.Tensor, recipe: Recipe, rowwise: bool = True, columnwise: bool = True) -> tuple:
    """W's quantize outputs (rowwise triple, columnwise triple; a copy not asked for absent) as the recipe
    quantizes a Linear's weight: per tensor, in its weight_block, rounded to nearest."""
    if w.stride(-1) != 1:  # a weight assigned as a transposed view: the CUDA kernels read contiguous rows
        w = w.contiguous()
    return ops.quantize(w, "tensor", list(recipe.weight_block), rowwise, columnwise, "nearest", False,
                        recipe.weight_four_over_six, _no_rng(w))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), without the call when t has that dtype already (an eager call costs microseconds)."""
    return t if t.dtype == dtype else t.to(dtype)


def cache_key(t: torch.Tensor, made_with, frozen: bool) -> tuple:
    """What a cached conversion of t depends on: t's version counter, the optimizer steps taken (None in a frozen
    cache, which they leave alone), t's address, dtype and device, and what it was made with (a recipe, the output
    dtype)."""
    return (t._version, None if frozen else _optimizer_steps, t.data_ptr(), t.dtype, t.device, made_with)


def columnwise_when_asked(holder, grad: bool) -> bool:
    """Whether a new cache entry includes the columnwise copy of the weight (dgrad's operand): always, but in a
    frozen, not static cache made by a forward without autograd. A frozen model that only runs such forwards (a
    reference model) then keeps the rowwise copy alone, about half the memory; a forward with autograd adds the
    columnwise copy to the entry (rows and columns quantized apart give the bytes they give together). A normal
    cache makes both at once, since a training step usually follows the forwards without autograd (rollouts)."""
    return grad or holder.static_weight_cache or not holder.frozen_weight_cache


def rekeyed(entry, frozen: bool):
    """The entry of a holder just made frozen (frozen=True) or normal again (frozen=False), keyed as the holder now
    is: the count of optimizer steps in its key becomes None, or the current count, so that the change alone does
    not make a current entry stale. An entry that was stale already (made before the last step) is returned as it
    is."""
    if entry is None:
        return None
    key = entry[0]
    if key[1] != (_optimizer_steps if frozen else None):
        return entry
    return ((key[0], None if frozen else _optimizer_steps, *key[2:]), *entry[1:])


def _checked_cache_setting(name: str, value, keep_quantized_weight: bool, verb: str) -> bool:
    """A cache setting (static_weight_cache, frozen_weight_cache), checked: a bool, and True only for a layer that
    keeps its quantized weight."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    if value and not keep_quantized_weight:
        raise ValueError(f"a layer built with keep_quantized_weight=False keeps no quantized weight, so it has no "
                         f"cache to {verb}")
    return value


def check_frozen_weight_cache(frozen, keep_quantized_weight: bool) -> bool:
    return _checked_cache_setting("frozen_weight_cache", frozen, keep_quantized_weight, "freeze")


def check_static_weight_cache(static, keep_quantized_weight: bool) -> bool:
    return _checked_cache_setting("static_weight_cache", static, keep_quantized_weight, "make static")


def _fp32_bias(bias: torch.Tensor, y_dtype: torch.dtype) -> torch.Tensor:
    """The bias rounded to Y's dtype, then widened to the fp32 that the fprop GEMM's epilogue adds."""
    return bias.to(y_dtype).to(torch.float32)


def check_keep_quantized_weight(keep: bool) -> None:
    if not isinstance(keep, bool):
        raise TypeError(f"keep_quantized_weight must be True or False, got {keep!r}")


def main_grad_of(weight: torch.Tensor) -> torch.Tensor:
    """weight.main_grad, which accumulate_main_grad=True adds the weight gradient into: an fp32 tensor shaped
    like the weight that the caller attached (anything else is a ValueError)."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        raise ValueError("accumulate_main_grad=True needs weight.main_grad: an fp32 tensor shaped like the weight")
    return main_grad


def _autocast_dtype(x: torch.Tensor):
    """The dtype torch.autocast computes a linear layer in for x, or None outside autocast (autocast leaves
    float64 and non-float tensors alone)."""
    if x.device.type not in ("cuda", "cpu") or x.dtype not in PARAM_DTYPES:  # other device types may have none
        return None
    if not torch.is_autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


class Linear(torch.nn.Linear):
    """Drop-in torch.nn.Linear (same parameters and state_dict) that trains with NVFP4 GEMMs.

    in_features and out_features must be multiples of 16 (NVFP4 blocks along both weight dimensions).
    Any number of tokens (the input flattened to [tokens, in_features]) works: in training, where wgrad
    contracts over tokens in 16-token blocks, a count that is not a multiple of 16 is completed with zero
    tokens, at the cost of one copy of the input and one of its gradient. Parameters are bfloat16, float16
    or float32.

    Under torch.autocast the input is cast to the autocast dtype and the output has that dtype, as with
    torch.nn.Linear; outside autocast the input's dtype must equal the parameters'.

    accumulate_main_grad=True adds the weight gradient into `weight.main_grad` (an fp32 tensor you
    attach) inside the wgrad GEMM instead of producing `weight.grad`.

    The quantized weight (and the bias, converted to the fp32 that the forward GEMM's epilogue adds) is
    reused until its version counter moves or any torch.optim optimizer steps (a frozen cache,
    fp4gen.nn.frozen_weight_caches, for weights that no optimizer moves, ignores the steps). A change that
    neither sees (an in-place edit through `weight.data`, a torch.distributed broadcast into the weight) needs
    `clear_weight_cache()`, or fp4gen.nn.clear_weight_caches(model) for a whole model. A weight quantized
    under torch.inference_mode (a rollout) is kept as a normal tensor: the next training step reuses it.
    CUDA graphs and torch.compile quantize the weight at every call, unless the cache is static
    (fp4gen.nn.static_weight_caches, or static_weight_cache=True on the layer): they then read the kept copies,
    remade in place when the weight changes.

    keep_quantized_weight=False keeps no quantized weight: each forward quantizes the weight's rowwise copy
    for its GEMM, and backward quantizes the columnwise copy for dgrad from the weight again (the weight is
    saved for backward, as torch.nn.Linear saves it). That costs a quantization of the weight a step more and
    holds no copy of it between calls: for FSDP2 (fully_shard), which frees each gathered weight after
    forward and gathers it again for backward, where a kept copy would hold every layer's whole, unsharded
    weight on every rank. The bytes computed are the same either way.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Recipe | None = None,
                 device=None, dtype=None, accumulate_main_grad: bool = False, keep_quantized_weight: bool = True):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if value % BLOCK:
                raise ValueError(f"{name}={value}: fp4gen.nn.Linear needs a multiple of {BLOCK} (NVFP4 blocks "
                                 f"run along both weight dimensions)")
        param_dtype = dtype if dtype is not None else torch.get_default_dtype()
        if param_dtype not in PARAM_DTYPES:
            raise ValueError(f"dtype={param_dtype}: fp4gen.nn.Linear keeps its parameters in "
                             f"{dtype_names(PARAM_DTYPES)}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_nvfp4(recipe, accumulate_main_grad, keep_quantized_weight)

    # the defaults of layers pickled before the attributes existed
    keep_quantized_weight = True
    _static_weight_cache = False
    _frozen_weight_cache = False

    @property
    def static_weight_cache(self) -> bool:
        """Whether the weight cache is static (fp4gen.nn.static_weight_caches): CUDA graphs and compiled code read
        the quantized weight it keeps, remade in place when the weight changes, instead of quantizing it."""
        return self._static_weight_cache

    @static_weight_cache.setter
    def static_weight_cache(self, static: bool) -> None:
        self._static_weight_cache = check_static_weight_cache(static, self.keep_quantized_weight)
        if static:
            if self._weight_cache is not None and self._weight_cache[2] is None:  # a static cache holds both copies
                self._weight_cache = None
            made_static(self, self._weight_cache, self._bias_cache)

    @property
    def frozen_weight_cache(self) -> bool:
        """Whether the weight cache is frozen (fp4gen.nn.frozen_weight_caches): optimizer steps leave it alone."""
        return self._frozen_weight_cache

    @frozen_weight_cache.setter
    def frozen_weight_cache(self, frozen: bool) -> None:
        frozen = check_frozen_weight_cache(frozen, self.keep_quantized_weight)
        if frozen != self._frozen_weight_cache:
            self._weight_cache = rekeyed(self._weight_cache, frozen)
            self._bias_cache = rekeyed(self._bias_cache, frozen)
            self._frozen_weight_cache = frozen

    def has_gradients(self) -> bool:
        """Whether the weight or the bias has a gradient now (an optimizer step would move it)."""
        return has_gradient(self.weight) or has_gradient(self.bias)

    def _cache_key(self, t: torch.Tensor, made_with) -> tuple:
        return cache_key(t, made_with, self._frozen_weight_cache)

    def _init_nvfp4(self, recipe, accumulate_main_grad, keep_quantized_weight: bool = True) -> None:
        """The state this class adds to torch.nn.Linear's (also set by fp4gen.convert on a converted layer)."""
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be an fp4gen.Recipe or None, got {type(recipe).__name__} {recipe!r}; "
                            f"for example recipe=fp4gen.Recipe(row_scaled_activation=True)")
        if not isinstance(accumulate_main_grad, bool):
            raise TypeError(f"accumulate_main_grad must be True or False, got {accumulate_main_grad!r}")
        check_keep_quantized_weight(keep_quantized_weight)
        self.recipe = recipe if recipe is not None else Recipe()
        self.accumulate_main_grad = accumulate_main_grad
        self.keep_quantized_weight = keep_quantized_weight
        self._weight_cache = None  # (key, rowwise, columnwise)
        self._bias_cache = None  # (key, the bias as the fprop epilogue adds it)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Recipe | None = None) -> "Linear":
        """A new fp4gen.nn.Linear that shares `linear`'s weight and bias parameters (the same objects, so an
        optimizer over them keeps working) and its training mode. `linear` itself is left as it is."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                    device="meta", dtype=linear.weight.dtype)
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer.train(linear.training)

    def to_linear(self) -> torch.nn.Linear:
        """A torch.nn.Linear that shares this layer's weight and bias parameters and training mode."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                                 dtype=self.weight.dtype)
        linear.weight, linear.bias = self.weight, self.bias
        return linear.train(self.training)

    def clear_weight_cache(self) -> None:
        """Forget the quantized weight (and the fp32 copy of the bias), so the next forward makes them again; a
        static cache makes them again now, in place."""
        if self.static_weight_cache:
            self.refresh_weight_cache()
            return
        self._weight_cache = None
        self._bias_cache = None

    def refresh_weight_cache(self) -> None:
        """Quantize the weight (and convert the bias) again now, into the tensors a static cache keeps."""
        entry = self._weight_cache
        if entry is not None:
            self._weight_cache = self._weight_entry(torch_ops.for_caller(), entry, self.weight)
        entry = self._bias_cache
        if entry is not None and self.bias is not None:
            self._bias_cache = self._bias_entry(entry, self.bias, entry[0][-1])

    def holds_weight_copy(self) -> bool:
        """Whether the layer holds a quantized copy of its weight now (the bias's fp32 copy aside)."""
        return self._weight_cache is not None

    def __getstate__(self) -> dict:
        """Pickled (torch.save of the whole module, multiprocessing) without the caches, which hold weak
        references (no pickle takes them); the loaded layer makes them again at its first forward."""
        state = self.__dict__.copy()
        state["_weight_cache"] = state["_bias_cache"] = None
        return state

    def _quantized_weight(self, ops, weight: torch.Tensor, in_graph: bool, grad: bool = True):
        """(rowwise, columnwise) triples of W, per tensor. Cached on the weight's version counter in eager
        mode; in_graph (torch.compile tracing or CUDA-graph capture: traced_or_captured) makes the
        quantization part of the graph instead, unless the cache is static. Without keep_quantized_weight: the
        rowwise copy alone, made now, and None for the columnwise one (backward makes it from the weight).
        grad: whether this forward records autograd (a frozen cache makes the columnwise copy only for one that
        does, and returns None for it otherwise, see columnwise_when_asked)."""
        if not self.keep_quantized_weight:
            if self._weight_cache is not None:  # kept before keep_quantized_weight was turned off
                self._weight_cache = None
            return quantize_weight(ops, weight.detach(), self.recipe, columnwise=False)[:3], None
        if in_graph:
            if not self.static_weight_cache:  # the graph must contain the quantization itself
                q = quantize_weight(ops, weight.detach(), self.recipe)
                return q[:3], q[3:]
            return graph_payload(self._weight_cache, lambda: self._cache_key(weight, self.recipe), weight,
                                 "fp4gen.nn.Linear")
        old = self._weight_cache  # read once: an optimizer step's hook may clear the attribute meanwhile
        entry = current_entry(
            old, self._cache_key(weight, self.recipe), weight, grad, lambda: self._weight_entry(ops, old, weight, grad),
            lambda: made_to_last(quantize_weight, ops, weight.detach(), self.recipe, rowwise=False)[3:])
        if entry is not old:
            self._weight_cache = entry
        return entry[1], entry[2]

    def _weight_entry(self, ops, old, weight: torch.Tensor, grad: bool = True) -> tuple:
        """The cache entry of the weight as it is now (static: in old's tensors)."""
        columnwise = columnwise_when_asked(self, grad)
        # made as normal tensors: kept for training steps after an inference pass
        q = made_to_last(quantize_weight, ops, weight.detach(), self.recipe, columnwise=columnwise)
        self._hold()
        return kept_entry(old, self._cache_key(weight, self.recipe), (q[:3], q[3:] if columnwise else None), weight,
                          self.static_weight_cache)

    def _hold(self) -> None:
        """Register the layer as holding a cache entry (the optimizer-step hooks drop or remake them)."""
        _CACHE_HOLDERS.add(self)
        if self.static_weight_cache:
            STATIC_HOLDERS.add(self)

    def _epilogue_bias(self, bias, y_dtype: torch.dtype, in_graph: bool):
        """The bias as the fprop GEMM's epilogue adds it, or None: rounded to the GEMM's output dtype (under
        autocast an fp32 bias is rounded to the compute dtype, as torch.nn.Linear's autocast cast does), then
        widened to the fp32 the epilogue takes. Cached like the quantized weight, so an eager step does not
        convert it again (a launch and an allocation)."""
        if bias is None:
            return None
        if in_graph:
            if not self.static_weight_cache:
                return _fp32_bias(bias.detach(), y_dtype)
            return graph_payload(self._bias_cache, lambda: self._cache_key(bias, y_dtype), bias,
                                 "fp4gen.nn.Linear")[0]
        entry = self._bias_cache
        if not cache_holds(entry, self._cache_key(bias, y_dtype), bias):
            entry = self._bias_cache = self._bias_entry(entry, bias, y_dtype)
        return entry[1]

    def _bias_entry(self, old, bias: torch.Tensor, y_dtype: torch.dtype) -> tuple:
        self._hold()
        return kept_entry(old, self._cache_key(bias, y_dtype), (made_to_last(_fp32_bias, bias.detach(), y_dtype),),
                          bias, self.static_weight_cache)

    def _compute_dtype(self, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
        """The dtype the GEMMs take X in and Y comes out in: autocast's, else x's, which must then be the
        parameters' dtype."""
        if weight.dtype not in PARAM_DTYPES:  # e.g. after .double()
            raise TypeError(f"the layer's parameters are {weight.dtype}; fp4gen.nn.Linear quantizes "
                            f"{dtype_names(PARAM_DTYPES)} weights")
        autocast = _autocast_dtype(x)
        if autocast is not None:
            if autocast not in PARAM_DTYPES:
                raise TypeError(f"torch.autocast computes in {autocast} here; fp4gen.nn.Linear takes "
                                f"{dtype_names(PARAM_DTYPES)}")
            return autocast
        if x.dtype != weight.dtype:
            raise TypeError(f"input dtype {x.dtype} differs from the layer's parameters ({weight.dtype}); "
                            f"outside torch.autocast they must agree: cast the input, or run the model under "
                            f"torch.autocast")
        return x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features in its last dimension; this layer takes "
                             f"in_features={self.in_features}")
        weight, bias, recipe = self.weight, self.bias, self.recipe  # each a module attribute lookup: fetched once
        refuse_function_transforms("fp4gen.nn.Linear")
        x = _as(x, self._compute_dtype(x, weight))  # autocast's cast, differentiable
        # [tokens, in_features]: what the quantization and the GEMMs see (a 2-D x is used as it is: no view)
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        tokens = x2d.shape[0]
        grad = torch.is_grad_enabled()
        need_wgrad = grad and weight.requires_grad
        # wgrad contracts over tokens in 16-token NVFP4 blocks: a partial last block is completed with zero
        # tokens (one copy of X here, and of dY in backward), which change no amax, encode as zeros and add
        # nothing to dW, as a grouped layer pads a group's tokens; Y's extra rows are dropped
        pad = -tokens % BLOCK if need_wgrad else 0
        if pad:
            x2d = torch.nn.functional.pad(x2d, (0, 0, 0, pad))
        flat, x2d = x2d, kernel_readable_rows(x2d)  # a copy where the kernels cannot read x's layout
        ops = torch_ops.for_caller()
        in_graph = traced_or_captured(x2d)
        qw_row, qw_col = self._quantized_weight(ops, weight, in_graph, grad)
        epilogue_bias = self._epilogue_bias(bias, GEMM_OUT[x2d.dtype], in_graph)
        # a step takes x itself where its rows are contiguous (and read in place), and gives Y shaped
        # [..., out_features]: no views between x and Y, whose nodes autograd would walk back
        step_x = x if x2d is x or (x2d is flat and x.is_contiguous() and not pad) else x2d
        if not grad:  # inference: no graph to record, nothing to save for backward
            y = self._forward_step(ops, x2d, step_x, qw_row, epilogue_bias)
            if y is None:  # the separate calls (_forward_step asked for the step already)
                y = _fprop(ops, x2d, qw_row, recipe, False, epilogue_bias, ask_for_step=False)[0]
            return y if y.dim() == x.dim() else y.reshape(*x.shape[:-1], self.out_features)
        main_grad = main_grad_of(weight) if self.accumulate_main_grad else None
        # stochastic rounding of dY draws from the device's default state, advanced by each backward
        rng_state = default_state_tensor(x2d.device) if recipe.stochastic_rounding else None
        y = self._training_step(ops, x2d, step_x, weight, bias, qw_row, qw_col, need_wgrad, epilogue_bias,
                                main_grad, rng_state)
        if y is None:
            y = _NVFP4LinearFunction.apply(x2d, weight, bias, qw_row, qw_col, recipe, main_grad, need_wgrad,
                                           rng_state if rng_state is not None else _no_rng(x2d), epilogue_bias)
        if pad:
            y = y[:tokens]
        return y if y.dim() == x.dim() else y.reshape(*x.shape[:-1], self.out_features)

    def _forward_step(self, ops, x2d, step_x, qw_row, epilogue_bias):
        """Y of a forward without autograd from a linear_steps.ForwardStep in one call into the C++ launcher,
        shaped as step_x (see _training_step), where a step expresses it; else None."""
        steps = _step_plans(ops, x2d)
        if steps is None:
            return None
        recipe = self.recipe
        x_e4m3_max, w_e4m3_max = e4m3_max_of(recipe.activation_four_over_six), e4m3_max_of(recipe.weight_four_over_six)
        step = steps.forward_step(x2d, qw_row, recipe, False, epilogue_bias, x_e4m3_max, w_e4m3_max)
        return None if step is None else steps.run_forward_step(step, step_x, qw_row, epilogue_bias)

    def _training_step(self, ops, x2d, step_x, weight, bias, qw_row, qw_col, need_wgrad, epilogue_bias, main_grad,
                       rng_state):
        """Y from the C++ launcher's LinearStep, which records its own backward node, where one expresses this
        step (fp4gen.cuda.linear_steps: the same kernels as _NVFP4LinearFunction's separate calls); else None.
        x2d: the input as [tokens, in_features], which the step is chosen by; step_x: the tensor the step takes (x2d,
        or the input itself with the same memory, for which the step returns Y shaped as it)."""
        needs_x_grad = x2d.requires_grad
        if not (needs_x_grad or need_wgrad) or weight.dtype not in _STEP_DTYPES:
            return None
        steps = _step_plans(ops, x2d)
        if steps is None:
            return None
        recipe = self.recipe
        step = steps.training_step(x2d, weight, qw_row, qw_col, recipe, needs_x_grad, need_wgrad, epilogue_bias,
                                   bias.dtype if bias is not None else None, main_grad,
                                   e4m3_max_of(recipe.activation_four_over_six),
                                   e4m3_max_of(recipe.weight_four_over_six))
        if step is None:
            return None
        return steps.run_training_step(step, step_x, weight, bias, qw_row, qw_col, epilogue_bias, main_grad,
                                       rng_state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


from .grouped_linear import GroupedLinear  # noqa: E402  (it builds on this module's state)
from .grouped_linear import MODULE_CACHES  # noqa: E402


def clear_weight_caches(module: torch.nn.Module) -> int:
    """Forget every cached weight quantization in `module` and its submodules: fp4gen.nn.Linear's and
    GroupedLinear's (quantized weight, fp32 bias) and those of experts run by fp4gen.hf_experts. Each is made
    again at its next call. Returns how many caches it found: one a layer, one an expert weight.

    The caches notice changes made through the parameters (their version counters) and optimizer steps (frozen
    caches, frozen_weight_caches: not the steps). Call this after changing weights in a way they cannot see:
    in-place writes through `.data` (for example `ref.data.mul_(1 - a).add_(p.data, alpha=a)`, a reference model's
    sync), torch.distributed collectives into the parameters (broadcast and all_reduce move no version counter),
    or another library's kernels writing into the parameters' memory."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"clear_weight_caches takes a torch.nn.Module, got {type(module).__name__}")
    cleared = 0
    for m in module.modules():
        if isinstance(m, (Linear, GroupedLinear)):
            m.clear_weight_cache()
            cleared += 1
        for cache in getattr(m, MODULE_CACHES, {}).values():
            cache.clear()
            cleared += 1
    return cleared


def static_weight_caches(module: torch.nn.Module, enabled: bool = True) -> int:
    """Make the weight caches of every fp4gen layer in `module` static (enabled=False: normal again), so that
    CUDA graphs and torch.compile read the quantized weights the layers keep instead of quantizing every weight
    at every replay. Returns how many caches it set: one a layer, one an expert weight.

    A static cache keeps its tensors for the layer's lifetime and makes their contents again in place: when an
    eager forward sees the weight changed (as a normal cache does), after every torch.optim optimizer step (also
    one captured in a CUDA graph: the requantization is then part of that graph), and at clear_weight_caches, which
    requantizes at once. What neither sees (writes through `.data`, collectives into the parameters) needs
    clear_weight_caches(model) before the next replay, as a normal cache needs it before the next call.

    Run one forward eagerly after enabling (the warm-up that CUDA-graph capture wants anyway): a captured or compiled
    call finds the cache filled, and a capture whose cache does not describe the weight as it is raises. The
    caches keep both quantized copies of each weight at all times (about a byte a weight parameter), also through
    optimizer steps, which drop normal caches before they run. Not for layers built with
    keep_quantized_weight=False (FSDP2): those keep no cache, and this raises ValueError. The experts that
    fp4gen.hf_experts runs count too: two caches an experts module.

    A graph captured while the caches were static reads their tensors: turning them normal again (enabled=False)
    lets those tensors be replaced, so do not replay such a graph after it."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"static_weight_caches takes a torch.nn.Module, got {type(module).__name__}")
    check_static_weight_cache(enabled, True)
    return _set_on_holders(module, "static_weight_cache", enabled, check_static_weight_cache)


def _set_on_holders(module: torch.nn.Module, attribute: str, value: bool, check) -> int:
    """Set a cache attribute on every fp4gen layer in module and every expert weight's cache, once every layer
    passed `check` (none is set where one fails); returns how many were set."""
    from .hf_experts import projection_caches  # not at the top: it builds on this module
    holders = []
    for m in module.modules():
        if isinstance(m, (Linear, GroupedLinear)):
            check(value, m.keep_quantized_weight)
            holders.append(m)
    holders.extend(projection_caches(module))
    for holder in holders:
        setattr(holder, attribute, value)
    return len(holders)


def frozen_weight_caches(module: torch.nn.Module, enabled: bool = True) -> int:
    """Freeze the weight caches of every fp4gen layer in `module` (enabled=False: normal again): for weights that no
    optimizer moves, such as an RL reference model or the base weights under LoRA. Returns how many caches it set:
    one a layer, one an expert weight.

    A normal cache is dropped at every torch.optim optimizer step in the process, whichever parameters it steps,
    since a step may refresh a weight without moving its version counter (FSDP2); a frozen model's layers would
    quantize every weight again at their first forward after each step. A frozen cache is left alone by optimizer
    steps (a static one is not remade after them either) and is remade only when the weight's version counter or
    address changes (copy_, load_state_dict, in-place ops on the parameter, a reassigned parameter) and at
    clear_weight_caches. So a change that these cannot see (writes through `.data`, collectives into the
    parameters, a wrapper that refills the weight) needs clear_weight_caches(module) afterwards, also where an
    optimizer step made it. A frozen layer whose weight or bias has a gradient (.grad, or .main_grad) when an
    optimizer steps is being trained after all: its caches are then dropped (static: remade) like any other's,
    with a warning once a process. Made by a forward without autograd, a frozen cache that is not static holds the
    weight's rowwise copy alone (half the memory: what a reference model's forwards need); a forward with autograd
    adds the columnwise copy.

    Not for layers built with keep_quantized_weight=False: those keep no cache, and this raises ValueError. The
    experts that fp4gen.hf_experts runs count too: two caches an experts module."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"frozen_weight_caches takes a torch.nn.Module, got {type(module).__name__}")
    check_frozen_weight_cache(enabled, True)
    return _set_on_holders(module, "frozen_weight_cache", enabled, check_frozen_weight_cache)
