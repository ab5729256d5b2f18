"""NVFP4 experts for Hugging Face transformers' mixture-of-experts models.

transformers (5.0 and newer) runs the experts of its MoE models (Qwen3-MoE, Mixtral, DeepSeek-V3, ...) through
a registry of "experts implementations" chosen per model. `register()` adds one that runs each expert
projection as fp4gen's grouped NVFP4 layer (the fprop, dgrad and wgrad of fp4gen.nn.GroupedLinear, over the
model's own stacked expert weights):

    import fp4gen, fp4gen.hf_experts
    fp4gen.hf_experts.register()                      # the name "fp4gen", with fp4gen.Recipe()
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="fp4gen")
    # or, on a loaded model: model.set_experts_implementation("fp4gen")
    fp4gen.convert(model, skip="lm_head")             # the dense layers (attention, shared experts) too

Each expert weight is quantized once and reused until it changes, as fp4gen.nn.GroupedLinear's (and
fp4gen.nn.static_weight_caches(model) makes those caches static for CUDA graphs and torch.compile, and
fp4gen.nn.frozen_weight_caches(model) keeps them through optimizer steps for a model no optimizer trains). The routing
stays on the device: a step never synchronizes on it. Weights stored [num_experts, out, in] (transformers'
default) and transposed, [num_experts, in, out] (`is_transposed`, as gpt-oss stores them), are both taken as they
lie. What it needs: both dimensions of each weight multiples of 64, and no expert parallelism; anything else
raises an error naming what is not supported.
"""
from __future__ import annotations

import torch

from .grouped_linear import MODULE_CACHES, StackedWeightCache, check_stacked_weight, grouped_linear
from .nn import check_keep_quantized_weight
from .recipe import Recipe

NAME = "fp4gen"
_REGISTERED = set()  # the names register() has added in this process


def register(name: str = NAME, recipe: Recipe | None = None, *, keep_quantized_weight: bool = True) -> None:
    """Add `name` to transformers' experts implementations, running fp4gen's grouped NVFP4 layers with `recipe`
    (default fp4gen.Recipe()). Registering under several names gives models (or sub-models) different recipes;
    registering a name again replaces its recipe. keep_quantized_weight=False: the experts keep no quantized
    weight between calls (for FSDP2), as fp4gen.nn.GroupedLinear's option does."""
    check_keep_quantized_weight(keep_quantized_weight)
    if recipe is None:
        recipe = Recipe()
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fp4gen.Recipe or None, got {type(recipe).__name__} {recipe!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    _experts_interface().register(name, _ExpertsForward(recipe, keep_quantized_weight))
    _REGISTERED.add(name)


def experts_modules(model: torch.nn.Module) -> list:
    """[(name, module, implementation)] of the transformers experts modules in `model` (modules that
    transformers' use_experts_implementation set up: stacked expert weights, an experts implementation chosen
    by the model's config), found without importing transformers."""
    found = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if (hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "_apply_gate")
                and hasattr(config, "_experts_implementation")):
            found.append((name, module, config._experts_implementation))
    return found


def projection_caches(model: torch.nn.Module) -> list:
    """The StackedWeightCaches of the expert projections of every experts module in `model` that runs an
    implementation register() added, made (empty) where the module's first call has not made them yet: what
    fp4gen.nn.static_weight_caches and frozen_weight_caches set."""
    caches = []
    for _, experts, implementation in experts_modules(model):
        if runs_in_nvfp4(implementation):
            transposed = bool(getattr(experts, "is_transposed", False))
            for name in ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj"):
                caches.append(_weight_cache(experts, name, transposed))
    return caches


def runs_in_nvfp4(implementation) -> bool:
    """Whether an experts implementation name is one that register() added."""
    return implementation in _REGISTERED


def _experts_interface():
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:
        raise ImportError("fp4gen.hf_experts needs Hugging Face transformers 5.0 or newer (its registry of experts "
                          "implementations, transformers.integrations.moe.ExpertsInterface): pip install "
                          "'transformers>=5'") from error
    return ExpertsInterface


class _ExpertsForward:
    """The registered function: called as forward(experts_module, hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], in the hidden states' dtype."""

    def __init__(self, recipe: Recipe, keep_quantized_weight: bool = True):
        self.recipe, self.keep_quantized_weight = recipe, keep_quantized_weight

    def __call__(self, experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        _check_layout(experts)
        tokens, top_k = top_k_index.shape
        num_experts = experts.num_experts
        # One row per (token, choice), ordered by expert; a stable sort keeps each expert's tokens in token
        # order. The group ends come from the sorted ids on the device (no host read of the routing).
        expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
        offsets = torch.searchsorted(expert_ids, torch.arange(num_experts, device=expert_ids.device,
                                                              dtype=expert_ids.dtype), right=True)
        x = hidden_states.index_select(0, order // top_k)
        up_name = "gate_up_proj" if experts.has_gate else "up_proj"
        h = self._project(experts, up_name, x, offsets)
        h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
        y = self._project(experts, "down_proj", h, offsets)
        if getattr(experts, "has_post_expert_norm", False):
            y = experts.post_expert_norm(y)
        y = y * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        # back to (token, choice) order, then each token's choices summed
        unsorted = y.new_empty(y.shape).index_copy(0, order, y)
        return unsorted.view(tokens, top_k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)  # also with no tokens

    def _project(self, experts, name: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        weight, label = getattr(experts, name), f"{type(experts).__name__}.{name}"
        transposed = bool(getattr(experts, "is_transposed", False))
        if transposed:  # stored [E, in, out]: multiplied as its [E, out, in] view
            weight, label = weight.transpose(1, 2), f"{label}.transpose(1, 2)"
        bias = getattr(experts, f"{name}_bias", None) if experts.has_bias else None
        check_stacked_weight(weight, bias, label)
        return grouped_linear(x, offsets, weight, bias, self.recipe, _weight_cache(experts, name, transposed),
                              keep_quantized_weight=self.keep_quantized_weight)


# What torch.compile's traced calls use when the module keeps no caches yet: a traced call quantizes inside the graph
# and never stores into a cache (nor could it add the attribute: the tracer takes no writes to a module's __dict__).
_TRACED_CACHES = {False: StackedWeightCache(False), True: StackedWeightCache(True)}


def _weight_cache(experts: torch.nn.Module, name: str, transposed: bool) -> StackedWeightCache:
    """The experts module's cache of parameter `name`'s quantized copies, made at its first eager call."""
    caches = getattr(experts, MODULE_CACHES, None)
    cache = caches.get(name) if caches is not None else None
    if cache is not None and cache.transposed == transposed:
        return cache
    if torch.compiler.is_compiling():
        return _TRACED_CACHES[transposed]
    if caches is None:
        caches = {}
        setattr(experts, MODULE_CACHES, caches)
    cache = caches[name] = StackedWeightCache(transposed)
    return cache


def _check_layout(experts: torch.nn.Module) -> None:
    """The experts module's flags (set by transformers' use_experts_implementation) that this implementation
    does not support raise."""
    kind = type(experts).__name__
    if getattr(experts, "_is_expert_parallel", False):
        raise NotImplementedError(f"{kind} runs with expert parallelism; fp4gen's experts implementation "
                                  f"does not support it (each rank would need the routed tokens of its experts)")
