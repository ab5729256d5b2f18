"""Every fp4gen.Recipe through fp4gen.nn.Linear and fp4gen.nn.GroupedLinear on the GPU against the same layer on
the reference backend (CPU).

The other layer tests pick a few recipes; a recipe is a product of independent fields, and each combination
selects its own quantize kernels (row pass or amax pass, transform, stochastic rounding, 4over6, 16x16 or 1x16
weights, one copy or two). So here every combination runs a training step on both backends: the quantized
operands are the same bytes on both, so Y, dX, dW and db may differ only by the GEMMs' summation order and the
final rounding to the layer's dtype, which a wrong block, scale or copy exceeds.
Token counts are off the 16-token block, and the grouped layer has an empty expert and experts of a few tokens.
Each option also runs with gradients for the input alone (frozen weights) and for the weights alone.
Linear runs three training steps and two forwards without autograd: from the second call of a kind on, a bf16 or
fp32 layer's eager step runs as one launch plan through the C++ launcher instead of the separate calls.
"""
import itertools

import pytest
import torch

import fp4gen
from conftest import group_ends

pytestmark = pytest.mark.gpu

IN, OUT = 128, 64
TOKENS = (3, 27)  # 81 tokens, given as a 3-D input to Linear
EXPERT_SIZES = [0, 37, 5, 39]  # 81 tokens over four experts, one of them empty


def every_recipe():
    """All distinct recipes: four_over_six_error only matters where some tensor takes 4over6."""
    recipes = []
    for row_x, block, grads, sr, rht, fos in itertools.product(
            (True, False), ((16, 16), (1, 16)), ("tensor", "row"), (False, True), (True, False),
            (None, "weights", "activations", "all")):
        for error in ("mae", "mse") if fos else ("mae",):
            recipes.append(fp4gen.Recipe(row_scaled_activation=row_x, weight_block=block, gradient_scaling=grads,
                                         stochastic_rounding=sr, hadamard_wgrad=rht, four_over_six=fos,
                                         four_over_six_error=error))
    return recipes


def one_option_each():
    """The default recipe and each field moved off its default alone (for the dtype and unkept-weight runs)."""
    return [fp4gen.Recipe(), fp4gen.Recipe(row_scaled_activation=False), fp4gen.Recipe(weight_block=(1, 16)),
            fp4gen.Recipe(gradient_scaling="row"), fp4gen.Recipe(stochastic_rounding=True),
            fp4gen.Recipe(hadamard_wgrad=False), fp4gen.Recipe(four_over_six="all"),
            fp4gen.Recipe(four_over_six="all", four_over_six_error="mse")]


def recipe_id(r):
    parts = ["rowX" if r.row_scaled_activation else "tensorX", "w16x16" if r.weight_block == (16, 16) else "w1x16",
             f"{r.gradient_scaling}dY", "SR" if r.stochastic_rounding else "RN", "RHT" if r.hadamard_wgrad else "noRHT"]
    if r.four_over_six:
        parts.append(f"4o6-{r.four_over_six}-{r.four_over_six_error}")
    return ",".join(parts)


def assert_within_one_rounding(got, want, what):
    """got (CUDA) equals want (reference) up to the GEMMs' summation order and final rounding: a relative
    difference of at most 2^-7 (one or two units in bf16's last place), with an absolute floor for results that
    cancel to near zero, set by the size of the tensor's entries."""
    got, want = got.detach().double().cpu(), want.detach().double()
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    floor = 2 ** -10 * want.abs().max().clamp_min(1e-30)
    bad = (got - want).abs() > 2 ** -7 * want.abs() + floor
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} entries differ, the largest by "
                           f"{(got - want).abs().max().item():.3g} (entries up to {want.abs().max().item():.3g})")


def restart_default_rng_states():
    """Both backends' default stochastic-rounding states at (seed 0, offset 0), so that they draw the same bits."""
    for device in ("cpu", "cuda"):
        fp4gen.RNGState.default(device).reset(0)


def train_once(layer, x, dy, *extra, x_grad=True):
    x = x.clone().requires_grad_(x_grad)
    layer.weight.grad = layer.bias.grad = None
    y = layer(x, *extra)
    y.backward(dy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


def count_launcher_steps(monkeypatch) -> dict:
    """Counts of the C++ launcher's training steps and forwards without autograd run from now on."""
    from fp4gen.cuda import linear_steps
    counts = {"training": 0, "forward": 0}
    for kind, name in (("training", "run_training_step"), ("forward", "run_forward_step")):
        def counted(*args, _run=getattr(linear_steps, name), _kind=kind):
            counts[_kind] += 1
            return _run(*args)
        monkeypatch.setattr(linear_steps, name, counted)
    return counts


GRADS = {"both": (True, True), "input only": (True, False), "weights only": (False, True)}  # (dX, dW and db)


def compare_step(got, want, what):
    for name, g, w in zip(("Y", "dX", "dW", "db"), got, want):
        if w is None:
            assert g is None, f"{what} {name}: a gradient nobody asked for"
        else:
            assert_within_one_rounding(g, w, f"{what} {name}")


def check_linear(monkeypatch, recipe, dtype=torch.bfloat16, keep=True, grads="both"):
    from fp4gen.cuda import launcher
    launched = count_launcher_steps(monkeypatch)
    torch.manual_seed(0)
    kw = dict(recipe=recipe, dtype=dtype, keep_quantized_weight=keep)
    gpu = fp4gen.nn.Linear(IN, OUT, device="cuda", **kw)
    cpu = fp4gen.nn.Linear(IN, OUT, **kw)
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    x_grad, w_grad = GRADS[grads]
    for layer in (gpu, cpu):
        layer.requires_grad_(w_grad)
    x = torch.randn(*TOKENS, IN, dtype=dtype)
    dy = torch.randn(*TOKENS, OUT, dtype=dtype)
    restart_default_rng_states()
    for step in range(3):
        got = train_once(gpu, x.cuda(), dy.cuda(), x_grad=x_grad)
        want = train_once(cpu, x, dy, x_grad=x_grad)
        compare_step(got, want, f"Linear step {step}")
    with torch.no_grad():
        for call in range(2):
            assert_within_one_rounding(gpu(x.cuda()), cpu(x), f"Linear forward without autograd, call {call}")
    if dtype in (torch.bfloat16, torch.float32) and launcher.enabled():  # the launcher's kinds were compared too
        assert launched["training"] >= 1 and launched["forward"] >= 1, launched


def check_grouped_linear(recipe, dtype=torch.bfloat16, keep=True, grads="both"):
    torch.manual_seed(0)
    kw = dict(bias=True, recipe=recipe, dtype=dtype, keep_quantized_weight=keep)
    gpu = fp4gen.nn.GroupedLinear(len(EXPERT_SIZES), IN, OUT, device="cuda", **kw)
    cpu = fp4gen.nn.GroupedLinear(len(EXPERT_SIZES), IN, OUT, **kw)
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    x_grad, w_grad = GRADS[grads]
    for layer in (gpu, cpu):
        layer.requires_grad_(w_grad)
    ends = group_ends(EXPERT_SIZES)
    x = torch.randn(ends[-1], IN, dtype=dtype)
    dy = torch.randn(ends[-1], OUT, dtype=dtype)
    restart_default_rng_states()
    got = train_once(gpu, x.cuda(), dy.cuda(), torch.tensor(ends, device="cuda"), x_grad=x_grad)
    want = train_once(cpu, x, dy, ends, x_grad=x_grad)
    compare_step(got, want, "GroupedLinear")
    if w_grad:
        assert not got[2][0].any() and not got[3][0].any(), "the empty expert's gradients are not zero"


@pytest.mark.parametrize("recipe", every_recipe(), ids=recipe_id)
def test_linear_with_every_recipe_matches_the_reference_backend(monkeypatch, recipe):
    check_linear(monkeypatch, recipe)


@pytest.mark.parametrize("recipe", every_recipe(), ids=recipe_id)
def test_grouped_linear_with_every_recipe_matches_the_reference_backend(recipe):
    check_grouped_linear(recipe)


# bf16 with the weight kept is every_recipe's case; the rest of dtype x kept
OTHER_SETTINGS = [(dtype, keep) for dtype in (torch.float16, torch.float32, torch.bfloat16) for keep in (True, False)
                  if dtype != torch.bfloat16 or not keep]


@pytest.mark.parametrize("dtype,keep", OTHER_SETTINGS,
                         ids=[f"{str(d)[6:]}-{'kept' if k else 'unkept'}" for d, k in OTHER_SETTINGS])
@pytest.mark.parametrize("recipe", one_option_each(), ids=recipe_id)
@pytest.mark.parametrize("layer", ["Linear", "GroupedLinear"])
def test_each_option_in_each_dtype_with_the_weight_kept_or_not(monkeypatch, layer, recipe, dtype, keep):
    if layer == "Linear":
        check_linear(monkeypatch, recipe, dtype, keep)
    else:
        check_grouped_linear(recipe, dtype, keep)


@pytest.mark.parametrize("grads", ["input only", "weights only"])
@pytest.mark.parametrize("recipe", one_option_each(), ids=recipe_id)
@pytest.mark.parametrize("layer", ["Linear", "GroupedLinear"])
def test_each_option_with_gradients_for_the_input_or_the_weights_alone(monkeypatch, layer, recipe, grads):
    # frozen weights (LoRA's base layers): dgrad alone; an input without gradient (a first layer): wgrad alone
    if layer == "Linear":
        check_linear(monkeypatch, recipe, grads=grads)
    else:
        check_grouped_linear(recipe, grads=grads)
