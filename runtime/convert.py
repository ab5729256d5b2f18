"""fp4gen.convert and fp4gen.unconvert: turn a model's torch.nn.Linear layers into fp4gen.nn.Linear and back.

Conversion changes each eligible module's class in place. A converted module is the same object with the
same parameters (so optimizers, hooks, other references to it and state_dict keys keep working); it only
gains fp4gen.nn.Linear's forward and its three attributes (recipe, accumulate_main_grad, the weight cache).
That is sound because fp4gen.nn.Linear holds exactly torch.nn.Linear's state plus those attributes.
"""
from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass, field

import torch

from .formats import BLOCK
from .nn import PARAM_DTYPES, Linear, check_keep_quantized_weight
from .recipe import Recipe

ROOT_NAME = "(model)"  # how the report shows a model that is itself a linear layer


@dataclass
class ConversionReport:
    """What fp4gen.convert or fp4gen.unconvert did: the converted modules' names (as in named_modules()) and
    the skipped linear layers' names with the reason each was left alone. print() it for a table."""

    action: str  # "convert" or "unconvert"
    converted: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # [(name, reason)]
    notes: list = field(default_factory=list)  # what else the caller should know (str), such as experts left alone

    def __str__(self) -> str:
        lines = [f"fp4gen.{self.action}: {len(self.converted)} converted, {len(self.skipped)} skipped"]
        lines += [f"  converted  {name}" for name in self.converted]
        lines += [f"  skipped    {name}: {reason}" for name, reason in self.skipped]
        lines += [f"  note       {note}" for note in self.notes]
        return "\n".join(lines)


def _names_by_module(model: torch.nn.Module) -> dict:
    """id(module) -> (module, every name it has in the model), for modules of any linear class; a module
    reachable under several names (shared) appears once."""
    found = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, torch.nn.Linear):
            found.setdefault(id(module), (module, []))[1].append(name or ROOT_NAME)
    return found


def _skip_rule(skip, linear_names: list):
    """A function (names, module) -> reason or None from convert's `skip` argument: None, a predicate
    skip(name, module) -> bool, or names / shell-style patterns (a string is one name). A name or pattern
    that matches no linear layer is an error: it is almost always a typo."""
    if skip is None:
        return lambda names, module: None
    if callable(skip):
        def by_predicate(names, module):
            result = skip(names[0], module)
            if not isinstance(result, bool):
                raise TypeError(f"skip({names[0]!r}, module) returned {result!r}; the predicate must return a bool")
            return "skip predicate returned True" if result else None
        return by_predicate
    patterns = [skip] if isinstance(skip, str) else list(skip)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip takes module names (str), a predicate skip(name, module) -> bool, or None; got "
                        f"{bad[0]!r} in it")
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in linear_names)]
    if unmatched:
        close = difflib.get_close_matches(unmatched[0], linear_names, n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        shown = ", ".join(linear_names[:12]) + (", ..." if len(linear_names) > 12 else "")
        raise ValueError(f"skip names {', '.join(map(repr, unmatched))}, which match no linear layer of the model"
                         f"{hint} (its linear layers: {shown or 'none'})")

    def by_name(names, module):
        for pattern in patterns:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                return f"skipped by name ({pattern!r})"
        return None
    return by_name


def _why_not_convertible(module: torch.nn.Module):
    """The reason a linear layer cannot become an fp4gen.nn.Linear, or None when it can."""
    if type(module) is not torch.nn.Linear:
        if isinstance(module, Linear):
            return "already an fp4gen.nn.Linear"
        return (f"{type(module).__module__}.{type(module).__qualname__} is a subclass of torch.nn.Linear whose "
                f"forward may differ; only torch.nn.Linear itself is converted (convert before wrapping)")
    for attr in ("in_features", "out_features"):
        value = getattr(module, attr)
        if value % BLOCK:
            return f"{attr}={value} is not a multiple of {BLOCK} (NVFP4 blocks run along both weight dimensions)"
    if module.weight.dtype not in PARAM_DTYPES:
        return f"dtype {str(module.weight.dtype).replace('torch.', '')} (fp4gen quantizes bfloat16, float16, float32)"
    return None


def convert(model: torch.nn.Module, recipe: Recipe | None = None, skip=None, *,
            keep_quantized_weight: bool = True) -> ConversionReport:
    """Make every eligible torch.nn.Linear in `model` (the model itself included) an fp4gen.nn.Linear, in place.

    Eligible: exactly torch.nn.Linear (not a subclass), in_features and out_features multiples of 16,
    parameters in bfloat16, float16 or float32. Each converted layer keeps its parameter objects, device,
    dtype, hooks and state_dict keys, and gets `recipe` (default fp4gen.Recipe()).

    skip: None; module names as `model.named_modules()` gives them, or shell-style patterns such as
    "layers.*.mlp.*" (a string is one name); or a predicate skip(name, module) -> bool. Typical use keeps
    the first and last layers in high precision. A name or pattern matching no linear layer is a ValueError.

    keep_quantized_weight: as fp4gen.nn.Linear takes it (False for FSDP2: no quantized weight kept between
    calls).

    Returns a ConversionReport of what was converted and what was skipped, with the reason.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_keep_quantized_weight(keep_quantized_weight)
    if recipe is None:
        recipe = Recipe()
    elif not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fp4gen.Recipe or None, got {type(recipe).__name__} {recipe!r}")
    layers = _names_by_module(model)
    skip_reason = _skip_rule(skip, [n for _, names in layers.values() for n in names])
    report = ConversionReport("convert")
    for module, names in layers.values():
        reason = skip_reason(names, module) or _why_not_convertible(module)
        if reason:
            report.skipped.append((names[0], reason))
            continue
        module.__class__ = Linear
        module._init_nvfp4(recipe, accumulate_main_grad=False, keep_quantized_weight=keep_quantized_weight)
        report.converted.append(names[0])
    note = _experts_note(model)
    if note:
        report.notes.append(note)
    return report


def _experts_note(model: torch.nn.Module):
    """A note on the experts of a transformers mixture-of-experts model that do not run in NVFP4 (their stacked
    weights are no torch.nn.Linear, which convert takes), or None."""
    from . import hf_experts  # needs no transformers to look

    others = [(name, implementation) for name, _, implementation in hf_experts.experts_modules(model)
              if not hf_experts.runs_in_nvfp4(implementation)]
    if not others:
        return None
    (first, implementation), more = others[0], len(others) - 1
    where = first + (f" and {more} more" if more else "")
    return (f"the experts of {where} (transformers' stacked expert weights, not torch.nn.Linear layers) keep their "
            f"implementation {implementation!r}: fp4gen.hf_experts runs them in NVFP4 (fp4gen.hf_experts.register(), "
            f"then model.set_experts_implementation(\"fp4gen\"))")


def unconvert(model: torch.nn.Module, skip=None) -> ConversionReport:
    """The inverse of convert: every fp4gen.nn.Linear in `model` becomes a torch.nn.Linear in place, with the
    same parameter objects. `skip` works as in convert. Returns a ConversionReport."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = _names_by_module(model)
    skip_reason = _skip_rule(skip, [n for _, names in layers.values() for n in names])
    report = ConversionReport("unconvert")
    for module, names in layers.values():
        reason = skip_reason(names, module)
        if reason is None and type(module) is not Linear:
            reason = "not an fp4gen.nn.Linear"
        if reason:
            report.skipped.append((names[0], reason))
            continue
        module.__class__ = torch.nn.Linear
        for attr in ("recipe", "accumulate_main_grad", "keep_quantized_weight", "_weight_cache", "_bias_cache"):
            if attr in module.__dict__:  # keep_quantized_weight: absent from layers pickled before it existed
                delattr(module, attr)
        report.converted.append(names[0])
    return report
