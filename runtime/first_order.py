"""A backward that has no derivative of its own, marked so that a higher-order gradient through it raises.

fp4gen's layers compute their gradients with GEMMs on NVFP4 copies: the first-order gradients are right, but the
backward is not differentiable. Under `create_graph=True` a gradient that depends on a tensor requiring grad must
therefore not come out as a constant (a second backward would then leave the layer out without a word). torch's
`once_differentiable` asks only whether the incoming gradients require grad; a layer's dX = dY W also depends on
W, and dW = dYᵀ X on X, which the layer saved in forward. So with dY a constant (the gradient of a sum, say) and W
a parameter, dX would come out of `once_differentiable` as a constant and a gradient penalty on it would silently
miss the layer's weights. `first_order_only` marks each gradient by what it depends on: the incoming gradients,
or the forward inputs named for it.
"""
import functools

import torch

_MESSAGE = ("trying to differentiate twice: {layer}'s backward is not differentiable (its GEMMs run on NVFP4 copies), "
            "so no higher-order gradient (create_graph=True) can pass through the layer")


def first_order_only(layer: str, depends_on: dict):
    """Decorates an autograd Function's backward. depends_on: the position of a gradient the backward returns ->
    the positions of the forward's inputs it depends on besides the incoming gradients (e.g. {0: (1,)} for dX of a
    linear layer, which depends on input 1, W). The backward runs without recording; where the backward itself
    runs with grad mode on (create_graph=True), each gradient that depends on a tensor requiring grad comes out
    of a node that raises if a backward reaches it, and the others come out as constants, as torch's would."""
    message = _MESSAGE.format(layer=layer).encode()

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled():
                return outputs
            incoming = any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads)
            inputs = ctx.needs_input_grad  # whether each forward input required grad
            marked = [i for i, out in enumerate(outputs) if isinstance(out, torch.Tensor)
                      and (incoming or any(inputs[j] for j in depends_on.get(i, ())))]
            if not marked:
                return outputs
            raised = torch._C._functions.DelayedError(message, len(marked))(
                *(outputs[i].detach().requires_grad_() for i in marked))
            raised = raised if isinstance(raised, tuple) else (raised,)
            outputs = list(outputs)
            for i, out in zip(marked, raised):
                outputs[i] = out
            return tuple(outputs)

        return wrapper

    return decorate
