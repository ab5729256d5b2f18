"""fp4gen.nn.Linear on the reference backend (CPU) against an NVFP4 emulation in float64."""
import copy

import pytest
import torch
from torch.func import functional_call

import fp4gen
from fp4gen.formats import NVFP4Data

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def deq64(op: NVFP4Data) -> torch.Tensor:
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64, device=op.data.device)
    codes = torch.stack((op.data & 0xF, op.data >> 4), -1).reshape(op.shape[0], -1).long()
    vals = lut[codes].reshape(op.shape[0], -1, 16) * op.scale.double().unsqueeze(-1)
    return vals.reshape(op.shape) * op.amax.double().reshape(-1, 1) / 2688.0


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def emulate(layer, x2d, dy2d):
    """y, dX, dW, db of the NVFP4 recipe: the three training GEMMs (docs/numerics.md) in float64, from operands
    quantized by the reference backend (on the inputs' device)."""
    recipe = layer.recipe
    assert not recipe.stochastic_rounding, "the emulation rounds to nearest"
    hadamard = recipe.hadamard_wgrad  # on both wgrad operands: their columnwise copies
    qx = fp4gen.quantize(x2d, scaling=recipe.activation_scaling, hadamard=hadamard,
                         four_over_six=recipe.activation_four_over_six, backend="reference")
    qw = fp4gen.quantize(layer.weight.detach(), scaling="tensor", block=recipe.weight_block,
                         four_over_six=recipe.weight_four_over_six, backend="reference")
    qdy = fp4gen.quantize(dy2d, scaling=recipe.gradient_scaling, hadamard=hadamard, backend="reference")
    y = deq64(qx.rowwise) @ deq64(qw.rowwise).t()
    if layer.bias is not None:
        y = y + layer.bias.double()
    dx = deq64(qdy.rowwise) @ deq64(qw.columnwise).t()
    dw = deq64(qdy.columnwise) @ deq64(qx.columnwise).t()
    return y, dx, dw, dy2d.double().sum(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_scaled", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_backward_match_the_emulation(dtype, row_scaled, bias):
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(128, 96, bias=bias, dtype=dtype,
                             recipe=fp4gen.Recipe(row_scaled_activation=row_scaled))
    x = (torch.randn(2, 32, 128) * torch.logspace(-1, 1, 32).reshape(1, 32, 1)).to(dtype).requires_grad_()
    y = layer(x)
    assert y.shape == (2, 32, 96) and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    ey, edx, edw, edb = emulate(layer, x.detach().reshape(64, 128), dy.reshape(64, 96))
    tol = 2e-2
    assert rel(y.reshape(64, 96), ey) < tol
    assert rel(x.grad.reshape(64, 128), edx) < tol
    assert rel(layer.weight.grad, edw) < tol
    if bias:
        assert rel(layer.bias.grad, edb) < tol


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "frozen weight"])
def test_forward_without_a_graph_equals_the_training_forward(context):
    # without grad the layer runs its forward computation outside the autograd.Function, and with a frozen
    # weight (no wgrad) the quantize call makes no columnwise copy of X: the same Y either way, by value
    torch.manual_seed(4)
    layer = fp4gen.nn.Linear(64, 48, dtype=torch.bfloat16)
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    expected = layer(x.clone().requires_grad_())
    if context == "frozen weight":
        layer.requires_grad_(False)
        xg = x.clone().requires_grad_()
        y = layer(xg)
        y.backward(torch.ones_like(y))
        assert xg.grad is not None and layer.weight.grad is None
    else:
        with torch.no_grad() if context == "no_grad" else torch.inference_mode():
            y = layer(x)
        assert not y.requires_grad
    assert y.shape == (3, 16, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y, expected.detach())


def test_close_to_high_precision_linear():
    torch.manual_seed(1)
    layer = fp4gen.nn.Linear(256, 128)
    ref = torch.nn.Linear(256, 128)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(64, 256, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    layer(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    assert rel(x.grad, x_ref.grad) < 0.3 and rel(layer.weight.grad, ref.weight.grad) < 0.3  # NVFP4 noise


def test_same_parameters_and_state_dict_as_torch_linear():
    layer = fp4gen.nn.Linear(32, 16)
    ref = torch.nn.Linear(32, 16)
    assert layer.state_dict().keys() == ref.state_dict().keys()
    layer.load_state_dict(ref.state_dict())
    assert torch.equal(layer.weight, ref.weight)
    assert isinstance(layer, torch.nn.Linear)


@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_dimensions_nvfp4_cannot_take_raise_at_construction(shape):
    with pytest.raises(ValueError, match="multiple of 16"):
        fp4gen.nn.Linear(*shape)


RECIPES = {
    "default": fp4gen.Recipe(),
    "tensor-scaled X, row-scaled dY": fp4gen.Recipe(row_scaled_activation=False, gradient_scaling="row"),
    "stochastic dY, 1x16 weights, 4over6": fp4gen.Recipe(stochastic_rounding=True, weight_block=(1, 16),
                                                         four_over_six="all"),
}


TOKEN_SHAPES = [(1, 64), (7, 64), (17, 64), (5, 7, 64)]


def check_token_count_off_the_block(shape, recipe, device):
    """Training takes any token count: the layer completes the last 16-token block with zero tokens itself, so
    Y, dX, dW and db equal, byte for byte, what a caller gets who appends the zero tokens (with zero gradient
    rows) and drops Y's extra rows; and the forward equals the inference forward of the same tokens (on CUDA
    within bf16 rounding: the inference GEMM has the unpadded M, which may pick another kernel and summation
    order)."""
    from fp4gen.rng import RNGState
    torch.manual_seed(5)
    layer = fp4gen.nn.Linear(64, 48, device=device, dtype=torch.bfloat16, recipe=RECIPES[recipe])
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    tokens = x.numel() // 64
    dy = torch.randn(*shape[:-1], 48, device=device, dtype=torch.bfloat16)
    padded = -tokens % 16
    x_padded = torch.cat([x.reshape(tokens, 64), x.new_zeros(padded, 64)]).requires_grad_()
    dy_padded = torch.cat([dy.reshape(tokens, 48), dy.new_zeros(padded, 48)])
    rng = RNGState.default(x.device).tensor
    start = rng.clone()
    y_padded = layer(x_padded)
    y_padded.backward(dy_padded)
    expected = (y_padded.detach()[:tokens], x_padded.grad[:tokens], layer.weight.grad.clone(), layer.bias.grad.clone())
    layer.zero_grad()
    rng.copy_(start)  # the same random bits for dY's stochastic rounding
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    assert y.shape == (*shape[:-1], 48) and xg.grad.shape == shape
    got = (y.detach().reshape(tokens, 48), xg.grad.reshape(tokens, 64), layer.weight.grad, layer.bias.grad)
    for name, g, e in zip(("Y", "dX", "dW", "db"), got, expected):
        assert torch.equal(g, e), name
    assert layer.weight.grad.abs().sum() > 0
    with torch.no_grad():
        y_inference = layer(x)
    assert torch.equal(y_inference, y.detach()) if device == "cpu" else rel(y_inference, y.detach()) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
@pytest.mark.parametrize("shape", TOKEN_SHAPES)
def test_training_with_a_token_count_off_the_block_equals_zero_tokens_added_by_the_caller(shape, recipe):
    check_token_count_off_the_block(shape, recipe, "cpu")


def test_training_with_a_token_count_off_the_block_matches_the_emulation():
    """17 tokens against the float64 emulation of the recipe on the tokens completed with zeros (no token of
    the partial block is lost or counted twice)."""
    torch.manual_seed(6)
    layer = fp4gen.nn.Linear(128, 96, dtype=torch.float32)
    x = torch.randn(17, 128, requires_grad=True)
    dy = torch.randn(17, 96)
    layer(x).backward(dy)
    pad = torch.nn.functional.pad
    ey, edx, edw, edb = emulate(layer, pad(x.detach(), (0, 0, 0, 15)), pad(dy, (0, 0, 0, 15)))
    assert rel(x.grad, edx[:17]) < 1e-5 and rel(layer.weight.grad, edw) < 1e-5 and rel(layer.bias.grad, edb) < 1e-5


def test_only_nvfp4_copies_are_saved_for_backward():
    layer = fp4gen.nn.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert saved, "nothing was saved"
    for t in saved:
        assert t.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float32), t.dtype
        assert t.dtype != torch.bfloat16 and not (t.dtype == torch.float32 and t.numel() > 64)
    y.sum().backward()
    assert x.grad is not None


def train_recording_saved(layer, inputs, *extra) -> tuple:
    """SGD steps of `layer` over (x, dY) pairs from the default random state reset to 21 (layer(x, *extra)):
    (every step's Y, dX, dW and, with a bias, db; every tensor the forwards saved for backward)."""
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    fp4gen.RNGState.default(layer.weight.device).reset(21)
    outputs, saved = [], []
    for x, dy in inputs:
        xg = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = layer(xg, *extra)
        y.backward(dy)
        outputs += [y.detach(), xg.grad, layer.weight.grad.clone()]
        outputs += [layer.bias.grad.clone()] if layer.bias is not None else []
        optimizer.step()
        optimizer.zero_grad()
    return outputs, saved


def check_a_layer_that_keeps_no_quantized_weight(recipe, device, dtype):
    """keep_quantized_weight=False (for FSDP2): over training steps with optimizer updates between them, the same
    outputs and gradients, byte for byte, as a layer that keeps its quantized weight; no cache is held, and what its
    forward saves for backward is X's NVFP4 copy and the weight itself, never a quantized copy of W (which a kept
    layer saves). An input that needs no gradient (no dgrad) has nothing of W saved at all."""
    torch.manual_seed(11)
    layers = [fp4gen.nn.Linear(64, 48, device=device, dtype=dtype, recipe=recipe, keep_quantized_weight=keep)
              for keep in (True, False)]
    layers[1].load_state_dict(layers[0].state_dict())
    inputs = [(torch.randn(32, 64, device=device, dtype=dtype), torch.randn(32, 48, device=device, dtype=dtype))
              for _ in range(3)]
    results, saved_codes = zip(*(train_recording_saved(layer, inputs) for layer in layers))
    for kept, made_again in zip(*results):
        assert torch.equal(kept, made_again)
    assert layers[1]._weight_cache is None
    w_codes, x_codes = [64, 24], [64, 16]  # W's columnwise codes [in, out / 2]; X's [in, tokens / 2]
    kept_shapes = [list(t.shape) for t in saved_codes[0] if t.dtype == torch.uint8]
    assert w_codes in kept_shapes and x_codes in kept_shapes  # the kept layer saves W's copy
    weight = layers[1].weight
    for t in saved_codes[1]:
        assert t.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float32) or t.data_ptr() == weight.data_ptr()
        assert t.dtype != torch.uint8 or list(t.shape) == x_codes
    assert sum(t.data_ptr() == weight.data_ptr() for t in saved_codes[1]) == len(inputs)  # W itself, each step
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layers[1](inputs[0][0]).sum().backward()  # an input without grad: wgrad only
    assert saved and all(t.dtype != torch.uint8 or list(t.shape) == x_codes for t in saved)
    assert not any(t.data_ptr() == weight.data_ptr() for t in saved)


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_a_layer_that_keeps_no_quantized_weight_computes_the_same_bytes_and_saves_the_weight_instead(recipe):
    check_a_layer_that_keeps_no_quantized_weight(RECIPES[recipe], "cpu", torch.float32)


def test_keep_quantized_weight_switched_on_a_built_layer_takes_effect_at_the_next_call():
    torch.manual_seed(14)
    layer = fp4gen.nn.Linear(64, 32)
    x = torch.randn(16, 64)
    with torch.no_grad():
        kept = layer(x)
        assert layer._weight_cache is not None
        layer.keep_quantized_weight = False
        assert torch.equal(layer(x), kept) and layer._weight_cache is None  # the kept copy is dropped
        layer.keep_quantized_weight = True
        assert torch.equal(layer(x), kept) and layer._weight_cache is not None


def test_keep_quantized_weight_is_a_bool_and_convert_passes_it_on():
    with pytest.raises(TypeError, match="keep_quantized_weight must be True or False"):
        fp4gen.nn.Linear(16, 16, keep_quantized_weight="no")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    fp4gen.convert(model, keep_quantized_weight=False)
    assert [layer.keep_quantized_weight for layer in model] == [False, False]
    fp4gen.unconvert(model)
    assert not any(hasattr(layer, "keep_quantized_weight") for layer in model)


def check_a_second_backward_raises(layer, x, *extra, message="differentiate twice"):
    """create_graph=True gives the first-order gradients unchanged, and a backward through them (a higher-order
    gradient, which the quantized GEMMs do not define) raises instead of silently leaving the layer out. That holds
    for each gradient that depends on something requiring grad, also where dY does not (the gradient of a sum):
    dX = dY W through W, dW = dYᵀ X through x. A gradient that depends on nothing requiring grad comes out as a
    constant, as torch's does."""
    xg = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(layer(xg, *extra).square().sum(), xg)
    xg2 = x.clone().requires_grad_()
    (dx2,) = torch.autograd.grad(layer(xg2, *extra).square().sum(), xg2, create_graph=True)
    assert torch.equal(dx2.detach(), dx)
    with pytest.raises(RuntimeError, match=message):
        dx2.sum().backward()
    # dY constant: dX still depends on W (a gradient penalty on the input would need W's second derivative)
    (dx_sum,) = torch.autograd.grad(layer(xg2, *extra).sum(), xg2, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        (dx_sum.square().sum() + xg2.sum()).backward()  # x's own term would let it run, without W's part
    (dw,) = torch.autograd.grad(layer(xg2, *extra).sum(), layer.weight, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        (dw.square().sum() + xg2.sum()).backward()
    # nothing requiring grad behind the gradient: a constant
    (dw_const,) = torch.autograd.grad(layer(x, *extra).sum(), layer.weight, create_graph=True)
    layer.weight.requires_grad_(False)
    try:
        (dx_const,) = torch.autograd.grad(layer(xg2, *extra).sum(), xg2, create_graph=True)
    finally:
        layer.weight.requires_grad_(True)
    assert not dw_const.requires_grad and not dx_const.requires_grad
    assert torch.equal(dx_const, dx_sum.detach()) and torch.equal(dw_const, dw.detach())


def test_a_second_backward_through_the_layer_raises():
    torch.manual_seed(8)
    check_a_second_backward_raises(fp4gen.nn.Linear(64, 32), torch.randn(32, 64))


def test_weight_quantization_is_cached_until_the_weight_changes():
    layer = fp4gen.nn.Linear(32, 16)
    layer(torch.randn(16, 32)).sum().backward()
    first = layer._weight_cache
    layer(torch.randn(16, 32)).sum().backward()
    assert layer._weight_cache is first
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    layer(torch.randn(16, 32)).sum().backward()
    assert layer._weight_cache is not first
    qw = fp4gen.quantize(layer.weight.detach(), scaling="tensor", block=(16, 16))
    assert torch.equal(layer._weight_cache[1][0], qw.rowwise.data)


class _TwoLayers(torch.nn.Module):
    """A dense layer inside a container and an experts layer: what clear_weight_caches walks."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(fp4gen.nn.Linear(64, 64), torch.nn.ReLU())
        self.experts = fp4gen.nn.GroupedLinear(2, 64, 64, bias=True)

    def forward(self, x):
        return self.experts(self.blocks(x), torch.tensor([16, 32]))


def _fresh_twin(model):
    twin = _TwoLayers()
    twin.load_state_dict(model.state_dict())
    return twin


def test_weight_changes_the_caches_cannot_see_need_clear_weight_caches():
    """Writes through .data move no version counter of the parameter: the layers keep computing with the quantization
    of the old weights (documented), until fp4gen.nn.clear_weight_caches forgets it."""
    torch.manual_seed(9)
    model, source = _TwoLayers(), _TwoLayers()
    x = torch.randn(32, 64)
    before = model(x)
    # a reference model's sync in RL, target.data.mul_(1 - a).add_(source.data, alpha=a), on the weights
    for (name, target), p in zip(model.named_parameters(), source.parameters()):
        if name.endswith("weight"):
            target.data.mul_(0.5).add_(p.data, alpha=0.5)
    expected = _fresh_twin(model)(x)
    assert not torch.equal(expected, before)
    assert torch.equal(model(x), before)  # stale: what the docs warn about
    assert fp4gen.nn.clear_weight_caches(model) == 2
    assert torch.equal(model(x), expected)


def _weight_over(storage) -> torch.Tensor:
    """A new [32, 64] fp32 tensor object over `storage`: a new weight at the address of earlier ones."""
    return torch.empty(0).set_(storage, 0, (32, 64), (64, 1))


def test_a_new_weight_at_an_earlier_weights_address_is_quantized_afresh():
    """torch.func.functional_call with a fresh weight each call: once an earlier weight is freed, a new one can lie at
    its address with as many version bumps, which the cache key alone cannot tell apart (the allocator gave 8 wrong
    results in 20 such calls before the cache also recorded which tensor object it was made from). Here the address
    and the version count are the same by construction."""
    torch.manual_seed(10)
    layer = fp4gen.nn.Linear(64, 32, bias=False)
    x = torch.randn(32, 64)
    storage = torch.randn(32 * 64).untyped_storage()
    first = _weight_over(storage)
    functional_call(layer, {"weight": first}, (x,))
    address, version = first.data_ptr(), first._version
    del first
    storage.copy_(torch.randn(32 * 64).untyped_storage())  # other values in the same memory
    second = _weight_over(storage)
    assert (second.data_ptr(), second._version) == (address, version)
    twin = fp4gen.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        twin.weight.copy_(second)
    assert torch.equal(functional_call(layer, {"weight": second}, (x,)), twin(x))


def test_whole_layers_pickle_without_their_caches(tmp_path):
    """torch.save of whole modules (not state dicts): the caches hold weak references, which no pickle takes, so
    layers pickle without them and make them again."""
    torch.manual_seed(11)
    model = _TwoLayers()
    x = torch.randn(32, 64)
    expected = model(x)  # fills every cache
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert loaded.blocks[0]._weight_cache is None and loaded.experts._weight_cache.entry is None
    assert torch.equal(loaded(x), expected)
    copied = copy.deepcopy(model)
    assert torch.equal(copied(x), expected)


def test_caches_are_dropped_before_an_optimizer_step():
    """The step makes every cached quantization stale: they are forgotten before it runs, so their memory is free
    for the optimizer (the caches are made again at the next forward)."""
    torch.manual_seed(12)
    model = _TwoLayers()
    x = torch.randn(32, 64)
    model(x).sum().backward()
    dense, experts = model.blocks[0], model.experts
    assert dense._weight_cache is not None and dense._bias_cache is not None and experts._weight_cache.entry is not None
    seen = []

    class Watching(torch.optim.SGD):
        def step(self, closure=None):
            seen.append((dense._weight_cache, dense._bias_cache, experts._weight_cache.entry))
            return super().step(closure)

    Watching(model.parameters(), lr=0.1).step()
    assert seen == [(None, None, None)]
    assert torch.equal(model(x), _fresh_twin(model)(x))  # the next forward quantizes the new weights


def test_caches_dropped_after_each_forward_change_no_result():
    """Caches cleared after every forward (a forward hook calling clear_weight_caches): losses bit for bit those of
    a run that keeps them, with no cache left after any forward."""

    def drop_weight_caches(module, args, output):
        fp4gen.nn.clear_weight_caches(module)

    def train(hook: bool):
        torch.manual_seed(13)
        model = _TwoLayers()
        if hook:
            model.register_forward_hook(drop_weight_caches)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        x = torch.randn(32, 64)
        losses, left = [], []
        for _ in range(3):
            for _ in range(2):  # two micro-batches a step: the second would reuse the caches
                loss = model(x).square().mean()
                left.append(model.blocks[0]._weight_cache is not None or model.experts._weight_cache.entry is not None)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return losses, left

    (kept, kept_left), (dropped, dropped_left) = train(False), train(True)
    assert all(kept_left) and not any(dropped_left)
    assert dropped == kept and kept[-1] < kept[0]


def test_clear_weight_caches_takes_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fp4gen.nn.clear_weight_caches([fp4gen.nn.Linear(16, 16)])
    assert fp4gen.nn.clear_weight_caches(torch.nn.Linear(16, 16)) == 0


def test_epilogue_bias_is_cached_until_the_bias_changes():
    torch.manual_seed(4)
    layer = fp4gen.nn.Linear(32, 16)
    x = torch.randn(16, 32)
    y = layer(x)
    first = layer._bias_cache[1]
    assert first.dtype == torch.float32 and torch.equal(first, layer.bias.detach())
    assert layer(x) is not y and layer._bias_cache[1] is first  # unchanged bias: no new conversion
    with torch.no_grad():
        layer.bias.add_(1.0)  # bumps the version counter
    assert torch.allclose(layer(x), y + 1.0, atol=1e-5)  # the new bias, not the cached one
    assert layer._bias_cache[1] is not first
    second = layer._bias_cache[1]
    layer.bias.grad = torch.ones(16)
    torch.optim.SGD([layer.bias], lr=0.5).step()
    assert torch.allclose(layer(x), y + 0.5, atol=1e-5) and layer._bias_cache[1] is not second
    layer.bias.data.add_(1.0)  # .data has its own version counter: clear_weight_cache forgets the copy too
    layer.clear_weight_cache()
    assert torch.allclose(layer(x), y + 1.5, atol=1e-5)


def test_epilogue_bias_under_autocast_is_rounded_to_the_compute_dtype():
    layer = fp4gen.nn.Linear(32, 16)
    with torch.no_grad():
        layer.bias.fill_(1.0 + 2.0 ** -12)  # not a bfloat16 value
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(16, 32))
    assert layer._bias_cache[1].dtype == torch.float32 and torch.all(layer._bias_cache[1] == 1.0)


def test_quantize_calls_without_random_bits_share_one_empty_state():
    from fp4gen.nn import _no_rng
    x = torch.randn(16, 32)
    state = _no_rng(x)
    assert state.numel() == 0 and state.dtype == torch.int64 and _no_rng(torch.randn(4, 16)) is state


def test_weight_refreshed_with_a_preserved_version_counter_is_requantized_after_an_optimizer_step():
    # FSDP2 copies the all-gathered weight into the unsharded parameter inside
    # _unsafe_preserve_version_counter, after the optimizer stepped on the shards.
    torch.manual_seed(3)
    layer = fp4gen.nn.Linear(32, 16)
    shard = torch.nn.Parameter(torch.zeros(1))
    x = torch.randn(16, 32)
    layer(x)
    new_weight = torch.randn(16, 32)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(layer.weight):
        layer.weight.copy_(new_weight)
    shard.grad = torch.ones(1)
    torch.optim.SGD([shard], lr=0.1).step()  # an optimizer that does not even own this layer's weight
    qw = fp4gen.quantize(new_weight, scaling="tensor", block=(16, 16))
    layer(x)
    assert torch.equal(layer._weight_cache[1][0], qw.rowwise.data)


def test_clear_weight_cache_sees_edits_through_data():
    layer = fp4gen.nn.Linear(32, 16)
    layer(torch.randn(16, 32))
    layer.weight.data.mul_(2)  # .data has its own version counter
    layer.clear_weight_cache()
    layer(torch.randn(16, 32))
    qw = fp4gen.quantize(layer.weight.detach(), scaling="tensor", block=(16, 16))
    assert torch.equal(layer._weight_cache[1][0], qw.rowwise.data)


def test_main_grad_accumulation():
    torch.manual_seed(2)
    layer = fp4gen.nn.Linear(64, 32, accumulate_main_grad=True)
    layer.weight.main_grad = torch.zeros(32, 64)
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    for _ in range(2):
        layer(x).backward(dy)
    assert layer.weight.grad is None
    _, _, edw, _ = emulate(layer, x, dy)
    assert rel(layer.weight.main_grad, 2 * edw) < 1e-5
    del layer.weight.main_grad
    with pytest.raises(ValueError, match="main_grad"):
        layer(x)


def test_nan_in_the_input_reaches_the_loss():
    layer = fp4gen.nn.Linear(32, 16)
    x = torch.randn(16, 32)
    x[3, 5] = float("nan")
    loss = layer(x).sum()
    assert torch.isnan(loss)


def test_recipe_validation():
    with pytest.raises(ValueError, match="weight_block"):
        fp4gen.Recipe(weight_block=(1, 32))
    with pytest.raises(TypeError, match="row_scaled_activation"):
        fp4gen.Recipe(row_scaled_activation="yes")
    assert fp4gen.Recipe(weight_block=[1, 16]).weight_block == (1, 16)


def _mlp(seed, keep_quantized_weight=True):
    torch.manual_seed(seed)
    return torch.nn.Sequential(fp4gen.nn.Linear(64, 128, keep_quantized_weight=keep_quantized_weight),
                               torch.nn.GELU(), fp4gen.nn.Linear(128, 32, keep_quantized_weight=keep_quantized_weight))


@pytest.mark.parametrize("keep", [True, False], ids=["kept weight", "weight quantized in backward"])
def test_torch_compile_fullgraph_training_step_matches_eager(keep):
    eager, compiled_model = _mlp(3, keep), _mlp(3, keep)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")  # any graph break raises
    x = torch.randn(4, 16, 64)
    for model in (eager, compiled):
        model(x).square().mean().backward()
    for p_eager, p_compiled in zip(eager.parameters(), compiled_model.parameters()):
        assert torch.equal(p_eager.grad, p_compiled.grad)
    opt = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    opt.step()  # a second compiled step sees the updated weights
    loss = compiled(x).square().mean()
    loss.backward()
    assert torch.isfinite(loss)


def check_compiled_stochastic_steps(device, backend, dtype):
    """The compiled step (which takes the device's default random state when it is traced, made then if the caller
    cleared the default states) draws fresh bits each step, the bits eager steps draw from the same state:
    gradients equal step by step. Two layers without bias and a loss whose gradient is exact (a weighted sum), so that
    a compiler that reorders float arithmetic (inductor's sum of a bias gradient) changes no bit outside fp4gen's
    operations."""
    recipe = fp4gen.Recipe(stochastic_rounding=True)
    models = []
    for _ in range(2):
        torch.manual_seed(3)
        models.append(torch.nn.Sequential(
            fp4gen.nn.Linear(64, 128, bias=False, recipe=recipe, device=device, dtype=dtype),
            fp4gen.nn.Linear(128, 32, bias=False, recipe=recipe, device=device, dtype=dtype)))
    eager, compiled_model = models
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)  # any graph break raises
    xs = [torch.randn(32, 64, device=device, dtype=dtype) for _ in range(3)]
    weights = torch.randn(32, 32, device=device, dtype=dtype)
    grads = {}
    for name, model in (("compiled", compiled), ("eager", eager)):
        torch.manual_seed(2026)
        if name == "eager":
            fp4gen.RNGState.default(device).reset()  # the stream the compiled steps drew from, from its start
        grads[name] = []
        for x in xs:
            model.zero_grad()
            (model(x) * weights).sum().backward()
            grads[name].append([p.grad.clone() for p in model.parameters()])
        assert fp4gen.RNGState.default(device).tensor.tolist() == [2026, 12]  # 3 steps, 2 layers, 2 offsets
    for step_compiled, step_eager in zip(grads["compiled"], grads["eager"]):
        assert all(torch.equal(c, e) for c, e in zip(step_compiled, step_eager))


def test_torch_compile_fullgraph_with_stochastic_rounding_draws_what_eager_draws(monkeypatch):
    monkeypatch.setattr(fp4gen.RNGState, "_defaults", {})  # no default state yet: the trace makes it
    check_compiled_stochastic_steps("cpu", "aot_eager", torch.float32)


_NO_RNG = torch.empty(0, dtype=torch.int64)


@pytest.mark.parametrize("op,args", [
    ("quantize", lambda: (torch.randn(32, 48), "row", [1, 16], True, True, "nearest", False, None, _NO_RNG)),
    ("quantize", lambda: (torch.randn(32, 48), "tensor", [16, 16], False, True, "nearest", False, "mae", _NO_RNG)),
    ("quantize", lambda: (torch.randn(32, 48), "row", [1, 16], True, True, "stochastic", True, None,
                          fp4gen.RNGState(7).tensor)),
    ("gemm", lambda: (*torch.ops.fp4gen.quantize(torch.randn(32, 48), "row", [1, 16], True, False, "nearest", False,
                                                 None, _NO_RNG)[:3],
                      *torch.ops.fp4gen.quantize(torch.randn(16, 48), "tensor", [1, 16], True, False, "nearest",
                                                 False, "mse", _NO_RNG)[:3],
                      torch.bfloat16, 448.0, 256.0)),
])
def test_custom_ops_fake_implementations_agree(op, args):
    # test_schema is left out: its checks run float8 arithmetic that PyTorch's CPU kernels lack
    torch.library.opcheck(getattr(torch.ops.fp4gen, op).default, args(),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_reference_column_sums_are_the_fp32_sums_rounded_once_and_need_tensor_scaling():
    # the reference backend's column sums (the CPU side of db from dY's quantization): x.sum(0) in fp32, in fp32 or
    # rounded once to x's dtype
    from fp4gen.api import quantize_checked
    from fp4gen.options import QuantizeOptions
    x = (torch.randint(-255, 256, (48, 32)) / 64).bfloat16()  # sums exact in fp32, most of them not in bf16
    row, col, sums = quantize_checked(x, "tensor", (1, 16), True, True, QuantizeOptions(), column_sums=torch.float32)
    fp32_sums = torch.tensor([sum(x[:, c].tolist()) for c in range(32)], dtype=torch.float32)
    assert sums.dtype == torch.float32 and torch.equal(sums, fp32_sums)
    plain_row, plain_col = quantize_checked(x, "tensor", (1, 16), True, True, QuantizeOptions())
    assert torch.equal(row.data, plain_row.data) and torch.equal(col.data, plain_col.data)
    bf16_sums = quantize_checked(x, "tensor", (1, 16), False, True, QuantizeOptions(), column_sums=torch.bfloat16)[2]
    assert bf16_sums.dtype == torch.bfloat16 and torch.equal(bf16_sums, fp32_sums.bfloat16())
    with pytest.raises(ValueError, match="tensor scaling"):
        quantize_checked(x, "row", (1, 16), True, True, QuantizeOptions(), column_sums=torch.float32)
    with pytest.raises(ValueError, match="neither torch.float32 nor"):
        quantize_checked(x, "tensor", (1, 16), True, True, QuantizeOptions(), column_sums=torch.float16)
