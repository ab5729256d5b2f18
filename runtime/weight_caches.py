"""The entries of fp4gen's weight caches (a layer's quantized weight, its fp32 bias, a stacked expert weight's
copies), and static caches: the form of cache that CUDA graphs and torch.compile read instead of quantizing.

An entry is a tuple (key, *payload, weak reference to the tensor it was made from): the key holds what the payload
depends on (the tensor's version counter, the count of optimizer steps, its address, dtype and device, the recipe),
the payload the tensors made from it.

A normal cache is bypassed in a graph: a graph that read the payload of its capture would keep computing with the
weights of that moment after optimizer updates, so a captured step quantizes the weights at every replay. A static
cache (fp4gen.nn.static_weight_caches) keeps its payload's tensors for as long as the layer lives: a payload
made again (the weight changed, an optimizer stepped, clear_weight_caches) is copied into them, so graphs and
compiled code that read those tensors see the new weights, and a captured step reads them instead of quantizing.

A frozen cache (fp4gen.nn.frozen_weight_caches) is one that optimizer steps leave alone: for weights that no
optimizer moves (a reference or teacher model, the base weights under LoRA), whose normal caches every step of the
trained model's optimizer would otherwise drop. Its keys hold no count of optimizer steps.
"""
from __future__ import annotations

import weakref

import torch

from .lasting import made_to_last

# The layers and stacked-weight caches that are static (with an entry made): what an optimizer step remakes in place.
STATIC_HOLDERS = weakref.WeakSet()


def cache_anchor(t: torch.Tensor) -> torch.Tensor:
    """The tensor object whose identity a cache entry of t records (cache_holds): t, or the tensor t is a view of."""
    return t._base if t._base is not None else t


def cache_holds(entry, key: tuple, t: torch.Tensor) -> bool:
    """Whether a cache entry, (key, ..., weak reference to the tensor it was made from), was made from t as t is now.

    The key holds t's version counter, the optimizer steps and t's address, and an address is reused once its
    tensor is freed: a new tensor there (a weight passed through torch.func.functional_call, a reassigned
    parameter) with as many version bumps would match the key alone and get the old tensor's conversion. So the
    entry must also come from this very tensor object, or, for a view, the tensor it views (a transposed expert
    weight is a new view each call). The reference is weak: a cache never keeps a replaced weight alive."""
    return entry is not None and entry[0] == key and entry[-1]() is cache_anchor(t)


def current_entry(entry, key: tuple, weight: torch.Tensor, grad: bool, make_entry, make_columnwise) -> tuple:
    """The cache entry a forward uses: `entry` where it was made from weight as weight is now (cache_holds), with
    the columnwise copy, make_columnwise(), added where the entry holds the rowwise copy alone (a frozen cache's,
    made without autograd) and this forward records autograd (grad); else the new entry make_entry()."""
    if not cache_holds(entry, key, weight):
        return make_entry()
    if entry[2] is None and grad:
        return (entry[0], entry[1], make_columnwise(), entry[-1])
    return entry


def _tensors(payload) -> list:
    """The tensors of a payload (tensors and tuples of them), in order."""
    out = []
    for item in payload:
        out.extend(_tensors(item) if isinstance(item, (tuple, list)) else [item])
    return out


def _copy_all(dst: list, src: list) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src):
            d.copy_(s)


def kept_entry(old, key: tuple, payload: tuple, source: torch.Tensor, static: bool) -> tuple:
    """The cache entry (key, *payload, weak reference to source's anchor). A static cache keeps old's tensors where
    payload's have their shapes, dtypes and devices: payload's values are copied into them (on the current stream,
    so a copy made while a CUDA graph is captured is part of that graph) and old's tensors make up the entry."""
    if static and old is not None:
        dst, src = _tensors(old[1:-1]), _tensors(payload)
        if len(dst) == len(src) and all(d.shape == s.shape and d.dtype == s.dtype and d.device == s.device
                                        for d, s in zip(dst, src)):
            made_to_last(_copy_all, dst, src)
            return (key, *old[1:-1], weakref.ref(cache_anchor(source)))
    if static:
        mark_static(payload)
    return (key, *payload, weakref.ref(cache_anchor(source)))


def mark_static(payload) -> None:
    """Mark a static cache's tensors as keeping their addresses: torch.compile's CUDA graphs read them where they
    lie instead of copying them in at every call."""
    for t in _tensors(payload):
        torch._dynamo.mark_static_address(t)


def made_static(holder, *entries) -> None:
    """A cache holder just made static: its entries' tensors (made while it was normal) become static ones."""
    for entry in entries:
        if entry is not None:
            mark_static(entry[1:-1])
            STATIC_HOLDERS.add(holder)


def graph_payload(entry, key, source: torch.Tensor, layer: str) -> tuple:
    """The payload of a static cache for a graph being captured or traced: `key` (a function, so that a traced call
    never reads a version counter) must still describe the entry under CUDA-graph capture. Under torch.compile the
    entry is trusted: optimizer steps, eager calls and clear_weight_caches remake it in place."""
    if entry is None:
        raise RuntimeError(f"{layer} has a static weight cache with nothing in it yet: run one forward eagerly (the "
                           f"usual warm-up) before capturing the layer in a CUDA graph or compiling it")
    if not torch.compiler.is_compiling() and not cache_holds(entry, key(), source):
        raise RuntimeError(f"{layer}'s static weight cache was made from another state of its weight or bias (it "
                           f"changed since, or autocast computes in another dtype now): run one forward eagerly, or "
                           f"call fp4gen.nn.clear_weight_caches(model), before capturing it in a CUDA graph")
    return entry[1:-1]


def refresh_static_holders(moved) -> None:
    """Remake in place every static cache whose weights an optimizer step may have moved (moved(holder))."""
    for holder in list(STATIC_HOLDERS):
        if holder.static_weight_cache and moved(holder):
            holder.refresh_weight_cache()


def has_gradient(t) -> bool:
    """Whether t (a parameter, or None) has a gradient now that an optimizer step would apply: .grad, or the fp32
    .main_grad that accumulate_main_grad layers add into."""
    return t is not None and (t.grad is not None or getattr(t, "main_grad", None) is not None)
