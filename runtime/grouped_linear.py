"""fp4gen.nn.GroupedLinear: the experts of a mixture-of-experts layer, one [E, out, in] weight, whose fprop,
dgrad and wgrad run as grouped NVFP4 GEMMs (one GEMM launch each) over tokens sorted by expert:

    fprop  Y_g  = X_g W_gᵀ   X rowwise ("rows", per token or per expert)  x  W rowwise (stacked, per expert)
    dgrad  dX_g = dY_g W_g   dY rowwise                                   x  W columnwise (stacked)
    wgrad  dW_g = dY_gᵀ X_g  dY columnwise ("columns")                    x  X columnwise ("columns")

with the Recipe's options as fp4gen.nn.Linear takes them. The group sizes stay on the device: a step neither
synchronizes nor depends on the routing when captured in a CUDA graph. Forward saves only NVFP4 copies (and, with
keep_quantized_weight=False, the weight itself instead of its columnwise copy).
"""
from __future__ import annotations

import math

import torch

from . import grouped_torch_ops
from . import nn as _nn
from .api import refuse_function_transforms
from .first_order import first_order_only
from .formats import BLOCK
from .grouped import group_offsets
from .lasting import made_to_last
from .recipe import Recipe
from .rng import default_state_tensor
from .weight_caches import STATIC_HOLDERS, current_entry, graph_payload, has_gradient, kept_entry, made_static


# The grouped GEMMs contract over in_features (fprop, wgrad's other operand) and out_features (dgrad) 64 at a time.
GROUP_K_TILE = 64


def _meta(layout: str, row_scaled: bool, four_over_six) -> tuple:
    """A grouped copy's static facts (grouped_torch_ops.Meta) as the recipe fixes them."""
    return (layout, row_scaled, _nn.e4m3_max_of(four_over_six))


class _GroupedLinearFunction(torch.autograd.Function):
    """Operands are (data, scale, amax) triples from the grouped custom ops, so torch.compile traces the whole
    step as opaque operators; each copy's layout, scaling and e4m3_max follow from the recipe."""

    @staticmethod
    def forward(ctx, x, offsets, weight, bias, w_row, w_col, recipe, main_grad, need_wgrad, rng_state, w_transposed):
        ops = grouped_torch_ops.for_caller()
        x_scaled = recipe.row_scaled_activation
        q = ops.quantize(x, offsets, recipe.activation_scaling, [1, BLOCK], True, need_wgrad, "nearest",
                         recipe.hadamard_wgrad and need_wgrad, recipe.activation_four_over_six, rng_state)
        x_meta = _meta("rows", x_scaled, recipe.activation_four_over_six)
        w_meta = _meta("stacked", False, recipe.weight_four_over_six)
        y_dtype = _nn.GEMM_OUT[x.dtype]
        y = ops.gemm(*q[:3], *w_row, offsets, *x_meta, *w_meta, y_dtype,
                     bias.to(y_dtype) if bias is not None else None)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        # NVFP4 copies of X (empty without wgrad) and W; without a kept W copy (w_col None: keep_quantized_weight
        # False), the weight itself, quantized again in backward where dgrad needs it
        ctx.weight_quantized_in_backward, ctx.w_transposed = w_col is None, w_transposed
        if w_col is None:
            w_col = (weight,) if ctx.needs_input_grad[0] else ()
        ctx.save_for_backward(offsets, *q[3:6], *w_col)
        ctx.x_col_meta = _meta("columns", x_scaled, recipe.activation_four_over_six)
        ctx.w_meta, ctx.recipe, ctx.main_grad, ctx.need_wgrad = w_meta, recipe, main_grad, need_wgrad
        ctx.rng_state, ctx.x_dtype, ctx.w_dtype = rng_state, x.dtype, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.needs_x_grad = ctx.needs_input_grad[0]
        return y

    @staticmethod
    @first_order_only("fp4gen.nn.GroupedLinear", {0: (2,), 2: (0,)})  # dX on W, dW on X: a second backward raises
    def backward(ctx, dy):
        ops = grouped_torch_ops.for_caller()
        saved = ctx.saved_tensors
        offsets, x_col, w_col = saved[0], saved[1:4], saved[4:]
        recipe = ctx.recipe
        dy = _nn.kernel_readable_rows(dy)
        dx = dw = db = None
        if ctx.needs_x_grad or ctx.need_wgrad:
            q = ops.quantize(dy, offsets, recipe.gradient_scaling, [1, BLOCK], ctx.needs_x_grad, ctx.need_wgrad,
                             recipe.gradient_rounding, recipe.hadamard_wgrad and ctx.need_wgrad, None, ctx.rng_state)
            dy_scaled = recipe.gradient_scaling == "row"
            if ctx.needs_x_grad:  # dgrad: dY_g [T_g, N] x (W_g columnwise = W_g.T [K, N])
                if ctx.weight_quantized_in_backward:
                    w_col = stacked_copies(ops, w_col[0].detach(), ctx.w_transposed, recipe, rowwise=False)[1]
                dx = ops.gemm(*q[:3], *w_col, offsets, *_meta("rows", dy_scaled, None), *ctx.w_meta,
                              _nn.GEMM_OUT[ctx.x_dtype]).to(ctx.x_dtype)
            if ctx.need_wgrad:  # wgrad: (dY columnwise [N, C]) x (X columnwise [K, C]), groups along C
                dy_col_meta = _meta("columns", dy_scaled, None)
                if ctx.main_grad is not None:
                    ops.gemm_accumulate(ctx.main_grad, *q[3:6], *x_col, offsets, *dy_col_meta, *ctx.x_col_meta)
                else:
                    dw = ops.gemm(*q[3:6], *x_col, offsets, *dy_col_meta, *ctx.x_col_meta,
                                  _nn.GEMM_OUT[ctx.w_dtype]).to(ctx.w_dtype)
        if ctx.bias_dtype is not None:
            db = _group_sums(dy, offsets).to(ctx.bias_dtype)
        return dx, None, dw, db, None, None, None, None, None, None, None


def _group_sums(dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """fp32 [E, N]: the sum of each group's rows of dy, without reading the offsets on the host.

    A 16-bit dy on CUDA: one GEMM of the groups' one-hot rows [E, T] with dy, accumulated in fp32. Its products
    are exact and its additions run in an order fixed by the GEMM, so the sums repeat bit for bit; on the expert
    shapes of bench/moe.py it ran 7-12x faster than index_add_ (H100, bench/RESULTS.md), whose fp32 atomics into
    E rows contend and land in no fixed order. fp32 dy (whose GEMM may run in TF32 where the user allows it) and
    the CPU take index_add_."""
    experts = offsets.shape[0]
    tokens = torch.arange(dy.shape[0], device=dy.device)
    group = torch.searchsorted(offsets, tokens, right=True).clamp_max(experts - 1)
    if dy.is_cuda and dy.dtype in (torch.bfloat16, torch.float16):
        one_hot = (group == torch.arange(experts, device=dy.device).unsqueeze(1)).to(dy.dtype)
        return torch.mm(one_hot, dy, out_dtype=torch.float32)
    sums = torch.zeros(experts, dy.shape[1], dtype=torch.float32, device=dy.device)
    return sums.index_add_(0, group, dy.float())


# The attribute under which a module that does not own its stacked weights (fp4gen.hf_experts' experts) keeps their
# StackedWeightCaches: a dict, parameter name -> cache (what fp4gen.nn.clear_weight_caches clears).
MODULE_CACHES = "_fp4gen_weight_caches"


class StackedWeightCache:
    """The quantized copies (rowwise and columnwise triples, one amax per expert) of one stacked [E, out, in] weight,
    kept until the weight changes: its version counter, an optimizer step anywhere in the process, its storage,
    dtype or device, or the recipe. Under torch.compile or CUDA-graph capture the quantization is part of the graph
    instead (a cache hit there would leave a graph that never requantizes), unless the cache is static
    (static_weight_cache: the graph reads the copies it keeps, remade in place when the weight changes). A frozen
    cache (frozen_weight_cache) is left alone by optimizer steps.

    transposed=True: the weight is the [E, out, in] view (transpose(1, 2)) of a parameter stored [E, in, out]. The
    stored parameter is quantized as it lies and its two copies swap roles: a columnwise copy is by definition the
    rowwise quantization of the transpose, with the same per-expert amax, for 1x16 and 16x16 blocks alike, so the
    bytes are those of the [E, out, in] weight's own copies, without a transposed copy of the weight."""

    __slots__ = ("entry", "transposed", "_static", "_frozen", "__weakref__")  # weak references: nn._CACHE_HOLDERS

    def __init__(self, transposed: bool = False):
        self.entry = None
        self.transposed = transposed
        self._static = False
        self._frozen = False

    @property
    def static_weight_cache(self) -> bool:
        return self._static

    @static_weight_cache.setter
    def static_weight_cache(self, static: bool) -> None:
        self._static = _nn.check_static_weight_cache(static, True)
        if static:
            if self.entry is not None and self.entry[2] is None:  # a static cache holds both copies
                self.entry = None
            made_static(self, self.entry)

    @property
    def frozen_weight_cache(self) -> bool:
        return self._frozen

    @frozen_weight_cache.setter
    def frozen_weight_cache(self, frozen: bool) -> None:
        frozen = _nn.check_frozen_weight_cache(frozen, True)
        if frozen != self._frozen:
            self.entry, self._frozen = _nn.rekeyed(self.entry, frozen), frozen

    def has_gradients(self) -> bool:
        """Whether the weight the entry was made from has a gradient now (an optimizer step would move it)."""
        return self.entry is not None and has_gradient(self.entry[-1]())

    def clear(self) -> None:
        """Forget the copies, so the next call makes them again; a static cache makes them again now, in place."""
        if self._static:
            self.refresh_weight_cache()
        else:
            self.entry = None

    clear_weight_cache = clear  # the name fp4gen.nn's optimizer-step hook calls

    def holds_weight_copy(self) -> bool:
        return self.entry is not None

    def __getstate__(self):  # pickled without the entry, whose weak reference no pickle takes
        return None, {"transposed": self.transposed, "static": self._static, "frozen": self._frozen}

    def __setstate__(self, state) -> None:
        self.entry, self.transposed = None, state[1]["transposed"]
        self._static, self._frozen = state[1].get("static", False), state[1].get("frozen", False)

    def get(self, weight: torch.Tensor, recipe: Recipe, grad: bool = True):
        """(rowwise, columnwise) triples of the [E, out, in] weight, from the cache where it holds them. grad: whether
        the calling forward records autograd (a frozen cache makes the columnwise copy only for one that does, and
        returns None for it otherwise: nn.columnwise_when_asked)."""
        ops = grouped_torch_ops.for_caller()
        if _nn.traced_or_captured(weight):
            if not self._static:
                return stacked_copies(ops, weight.detach(), self.transposed, recipe)
            return graph_payload(self.entry, lambda: _nn.cache_key(weight, recipe, self._frozen), weight,
                                 "fp4gen.nn.GroupedLinear")
        old = self.entry  # read once: an optimizer step's hook may clear it meanwhile
        entry = current_entry(
            old, _nn.cache_key(weight, recipe, self._frozen), weight, grad,
            lambda: self._entry(ops, old, weight, recipe, grad),
            lambda: made_to_last(stacked_copies, ops, weight.detach(), self.transposed, recipe, rowwise=False)[1])
        if entry is not old:
            self.entry = entry
        return entry[1], entry[2]

    def refresh_weight_cache(self) -> None:
        """Quantize the weight again now, from the tensor the entry was made from, into the tensors it keeps."""
        entry = self.entry
        stored = entry[-1]() if entry is not None else None
        if stored is None:  # nothing made yet, or the weight is gone
            self.entry = None
            return
        weight = stored.transpose(1, 2) if self.transposed else stored  # the [E, out, in] weight get() was given
        self.entry = self._entry(grouped_torch_ops.for_caller(), entry, weight, entry[0][-1])

    def _entry(self, ops, old, weight: torch.Tensor, recipe: Recipe, grad: bool = True) -> tuple:
        columnwise = _nn.columnwise_when_asked(self, grad)
        # made as normal tensors: kept for training steps after an inference pass
        payload = made_to_last(stacked_copies, ops, weight.detach(), self.transposed, recipe, columnwise=columnwise)
        if not columnwise:
            payload = (payload[0], None)
        _nn._CACHE_HOLDERS.add(self)
        if self._static:
            STATIC_HOLDERS.add(self)
        return kept_entry(old, _nn.cache_key(weight, recipe, self._frozen), payload, weight, self._static)


def stacked_copies(ops, weight: torch.Tensor, transposed: bool, recipe: Recipe, rowwise: bool = True,
                   columnwise: bool = True) -> tuple:
    """(rowwise, columnwise) triples of the [E, out, in] weight (a copy not asked for: three empty tensors),
    quantized as the recipe quantizes stacked weights. transposed: `weight` is the [E, out, in] view of a parameter
    stored [E, in, out], which is quantized as it lies with the two copies' roles swapped (StackedWeightCache)."""
    if transposed:
        weight, rowwise, columnwise = weight.transpose(1, 2), columnwise, rowwise  # the stored parameter
    q = ops.quantize(weight, None, "tensor", list(recipe.weight_block), rowwise, columnwise, "nearest", False,
                     recipe.weight_four_over_six, _nn._no_rng(weight))
    return (q[3:6], q[:3]) if transposed else (q[:3], q[3:6])


def check_stacked_weight(weight: torch.Tensor, bias: torch.Tensor | None, name: str = "weight") -> None:
    """What the grouped path needs of a stacked weight [E, out, in] (and its bias [E, out]); `name` is the
    parameter's name in the messages."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name} has shape {shape}; a stacked expert weight is [num_experts, out, in]")
    if weight.dtype not in _nn.PARAM_DTYPES:
        raise TypeError(f"{name} is {weight.dtype}; fp4gen's grouped layers take bfloat16, float16 or float32 "
                        f"weights")
    for dim, value in (("out", weight.shape[1]), ("in", weight.shape[2])):
        if value % GROUP_K_TILE:
            raise ValueError(f"{name} has shape {tuple(weight.shape)}: its {dim} dimension {value} is not a "
                             f"multiple of {GROUP_K_TILE} (the grouped GEMMs contract over both dimensions in "
                             f"{GROUP_K_TILE}-element k-tiles)")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:2]):
        raise ValueError(f"the bias of {name} has shape {tuple(bias.shape)}; it must be [num_experts, out] = "
                         f"{tuple(weight.shape[:2])}")


def grouped_linear(x: torch.Tensor, offsets, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
                   weight_cache: StackedWeightCache, main_grad: torch.Tensor | None = None,
                   keep_quantized_weight: bool = True) -> torch.Tensor:
    """Y [T, out]: each group's tokens X_g [T_g, in] times its expert's W_g [out, in] transposed (plus b_g), with
    autograd through the three grouped NVFP4 GEMMs; what fp4gen.nn.GroupedLinear runs, for a stacked weight
    that another module owns (check_stacked_weight's rules hold for it). x is cast to the autocast dtype under
    torch.autocast, else it must have the weight's dtype; offsets are the cumulative group ends (a tensor on
    x's device, never read on the host, or a host list). keep_quantized_weight=False: weight_cache keeps nothing;
    the forward quantizes W's rowwise copy and backward its columnwise copy from the weight (GroupedLinear's)."""
    refuse_function_transforms("fp4gen.nn.GroupedLinear (and fp4gen.hf_experts, which runs it)")
    num_experts, out_features, in_features = weight.shape
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; the grouped layer takes tokens [T, {in_features}] "
                         f"sorted by expert")
    x = _nn.kernel_readable_rows(x.to(_compute_dtype(x, weight)))
    offsets = group_offsets(offsets, x.shape[0], x.device)  # int64 on x's device, checked without a sync
    if offsets.shape[0] != num_experts:
        raise ValueError(f"offsets has {offsets.shape[0]} group ends; the weight has {num_experts} experts")
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad
    if keep_quantized_weight:
        w_row, w_col = weight_cache.get(weight, recipe, torch.is_grad_enabled())
    else:
        if weight_cache.entry is not None:  # kept before keep_quantized_weight was turned off (static or not)
            weight_cache.entry = None
        w_row = stacked_copies(grouped_torch_ops.for_caller(), weight.detach(), weight_cache.transposed, recipe,
                               columnwise=False)[0]
        w_col = None
    # stochastic rounding of dY draws from the device's default state, advanced by each backward
    rng_state = default_state_tensor(x.device) if recipe.stochastic_rounding else _nn._no_rng(x)
    return _GroupedLinearFunction.apply(x, offsets, weight, bias, w_row, w_col, recipe, main_grad, need_wgrad,
                                        rng_state, weight_cache.transposed)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    autocast = _nn._autocast_dtype(x)
    if autocast is not None:
        return autocast
    if x.dtype != weight.dtype:
        raise TypeError(f"input dtype {x.dtype} differs from the layer's parameters ({weight.dtype}); "
                        f"outside torch.autocast they must agree")
    return x.dtype


class GroupedLinear(torch.nn.Module):
    """num_experts linear layers (the experts of a mixture-of-experts block) that train with grouped NVFP4
    GEMMs: `layer(x, offsets)` maps tokens x [T, in_features], sorted by expert, to [T, out_features],
    tokens offsets[e-1] .. offsets[e]-1 through expert e (offsets: the cumulative ends, an int32/int64 tensor
    [num_experts] on x's device, as torch.nn.functional.grouped_mm takes them, or a host list).

    weight is one [num_experts, out_features, in_features] parameter (bias, if any, [num_experts,
    out_features]), each expert initialized as torch.nn.Linear initializes its weight. in_features and
    out_features must be multiples of 64 (the grouped GEMM's k-tiles run along both). Any expert may get no
    tokens (its weight gradient is then zero). The recipe is fp4gen.nn.Linear's; the quantized weight is
    cached the same way (until the weight's version counter moves or an optimizer steps).

    accumulate_main_grad=True adds the weight gradient into `weight.main_grad` (fp32, shaped like the
    weight) inside the wgrad GEMM instead of producing `weight.grad`.

    keep_quantized_weight=False keeps no quantized weight between calls, as fp4gen.nn.Linear's (for FSDP2): the
    forward quantizes W's rowwise copy, backward its columnwise copy from the saved weight.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False, *,
                 recipe: Recipe | None = None, device=None, dtype=None, accumulate_main_grad: bool = False,
                 keep_quantized_weight: bool = True):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts={num_experts!r}: it must be a positive int")
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if value % GROUP_K_TILE:
                raise ValueError(f"{name}={value}: fp4gen.nn.GroupedLinear needs a multiple of {GROUP_K_TILE} "
                                 f"(the grouped GEMMs contract over both in {GROUP_K_TILE}-element k-tiles)")
        param_dtype = dtype if dtype is not None else torch.get_default_dtype()
        if param_dtype not in _nn.PARAM_DTYPES:
            raise ValueError(f"dtype={param_dtype}: fp4gen.nn.GroupedLinear keeps its parameters in bfloat16, "
                             f"float16 or float32")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be an fp4gen.Recipe or None, got {type(recipe).__name__}")
        if not isinstance(accumulate_main_grad, bool):
            raise TypeError(f"accumulate_main_grad must be True or False, got {accumulate_main_grad!r}")
        _nn.check_keep_quantized_weight(keep_quantized_weight)
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        factory = dict(device=device, dtype=dtype)
        self.weight = torch.nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None
        self.recipe = recipe if recipe is not None else Recipe()
        self.accumulate_main_grad = accumulate_main_grad
        self.keep_quantized_weight = keep_quantized_weight
        self._weight_cache = StackedWeightCache()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as torch.nn.Linear initializes itself: weight and bias uniform in +-1/sqrt(in_features)
        (kaiming_uniform with a = sqrt(5) gives that bound for the weight)."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            for e in range(self.num_experts):
                torch.nn.init.kaiming_uniform_(self.weight[e], a=math.sqrt(5))
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    # the default of layers pickled before the attribute existed
    keep_quantized_weight = True

    @property
    def static_weight_cache(self) -> bool:
        """Whether the weight cache is static (fp4gen.nn.static_weight_caches), as fp4gen.nn.Linear's."""
        return self._weight_cache.static_weight_cache

    @static_weight_cache.setter
    def static_weight_cache(self, static: bool) -> None:
        _nn.check_static_weight_cache(static, self.keep_quantized_weight)
        self._weight_cache.static_weight_cache = static

    @property
    def frozen_weight_cache(self) -> bool:
        """Whether the weight cache is frozen (fp4gen.nn.frozen_weight_caches), as fp4gen.nn.Linear's."""
        return self._weight_cache.frozen_weight_cache

    @frozen_weight_cache.setter
    def frozen_weight_cache(self, frozen: bool) -> None:
        _nn.check_frozen_weight_cache(frozen, self.keep_quantized_weight)
        self._weight_cache.frozen_weight_cache = frozen

    def clear_weight_cache(self) -> None:
        """Forget the quantized weight, so the next forward makes it again; a static cache makes it again now."""
        self._weight_cache.clear()

    def forward(self, x: torch.Tensor, offsets) -> torch.Tensor:
        main_grad = _nn.main_grad_of(self.weight) if self.accumulate_main_grad else None
        return grouped_linear(x, offsets, self.weight, self.bias, self.recipe, self._weight_cache, main_grad,
                              self.keep_quantized_weight)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, recipe={self.recipe}")
