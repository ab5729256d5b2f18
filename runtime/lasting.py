"""Tensors that fp4gen keeps from one call for later ones: a layer's quantized weight and converted bias, the
default random-number states, the empty placeholder state.

Under torch.inference_mode every tensor an op makes is an inference tensor, which autograd refuses to save for
backward and which no in-place op may change outside inference mode. A kept tensor made during an inference-mode
pass (an RL rollout, an evaluation) would then break the training step after it, so kept tensors are always
made as normal tensors.
"""
from __future__ import annotations

import torch


def made_to_last(make, *args, **kwargs):
    """make(*args, **kwargs), with inference mode (and autograd, which leaving it turns back on) off while it
    runs if the caller is in inference mode: whatever tensors it makes are normal tensors, usable in training and
    in inference alike."""
    if not torch.is_inference_mode_enabled():
        return make(*args, **kwargs)
    with torch.inference_mode(False), torch.no_grad():
        return make(*args, **kwargs)
