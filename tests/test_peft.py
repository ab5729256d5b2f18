"""peft's LoRA around fp4gen layers, as docs/recipes.md ("Keeping layers in high precision") describes it:
converting before get_peft_model makes the frozen base layers fp4gen.nn.Linear and leaves the adapters
torch.nn.Linear; converting after it quantizes the adapters too unless convert skips them by name."""
import pytest
import torch

import fp4gen

peft = pytest.importorskip("peft")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.out = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.q(x)) * self.v(x))


def _lora(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q", "v"]))


def _wrapped(model):
    """The LoRA layers of q and v: (base layer, lora_A, lora_B) each."""
    inner = model.base_model.model
    return [(layer.base_layer, layer.lora_A["default"], layer.lora_B["default"]) for layer in (inner.q, inner.v)]


def test_converting_before_the_adapters_keeps_them_in_high_precision_and_trains_them():
    torch.manual_seed(0)
    model = Block()
    fp4gen.convert(model)
    model = _lora(model)
    for base, lora_a, lora_b in _wrapped(model):
        assert type(base) is fp4gen.nn.Linear and not base.weight.requires_grad
        assert type(lora_a) is torch.nn.Linear and type(lora_b) is torch.nn.Linear
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    x, target = torch.randn(32, 64), torch.randn(32, 32)
    losses = []
    for _ in range(8):
        loss = (model(x) - target).square().mean()
        loss.backward()
        for base, lora_a, lora_b in _wrapped(model):
            assert base.weight.grad is None and lora_a.weight.grad is not None  # dgrad through the NVFP4 base
            assert base._weight_cache is not None  # the base layer's forward ran in NVFP4
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


def test_converting_after_the_adapters_quantizes_them_unless_skipped():
    torch.manual_seed(0)
    model = _lora(Block())
    skipped = fp4gen.convert(model, skip="*lora_*")
    assert sorted(skipped.converted) == ["base_model.model.out", "base_model.model.q.base_layer",
                                         "base_model.model.v.base_layer"]
    for base, lora_a, lora_b in _wrapped(model):
        assert type(base) is fp4gen.nn.Linear and type(lora_a) is torch.nn.Linear and type(lora_b) is torch.nn.Linear
    fp4gen.unconvert(model)
    fp4gen.convert(model)
    for base, lora_a, lora_b in _wrapped(model):
        assert type(lora_a) is fp4gen.nn.Linear and type(lora_b) is fp4gen.nn.Linear


def _lora_losses(freeze: bool, steps: int = 4):
    """Losses of LoRA training on converted base layers, and whether every base layer kept one cache entry
    throughout (quantized once)."""
    torch.manual_seed(0)
    model = Block()
    fp4gen.convert(model)
    model = _lora(model)
    bases = [m for m in model.modules() if isinstance(m, fp4gen.nn.Linear)]
    if freeze:
        assert fp4gen.nn.frozen_weight_caches(model) == 3  # q, v and out: all frozen by get_peft_model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, target = torch.randn(32, 64), torch.randn(32, 32)
    losses, first, kept = [], None, True
    for _ in range(steps):
        loss = (model(x) - target).square().mean()
        loss.backward()
        entries = [base._weight_cache for base in bases]
        first = first or entries
        kept = kept and all(a is b for a, b in zip(entries, first))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, kept


def test_frozen_base_caches_train_lora_the_same_and_quantize_the_base_weights_once():
    """The base weights never change, so frozen caches skip their requantization after each optimizer step (a normal
    cache is dropped by every step) and the adapters train to the same losses, bit for bit."""
    frozen_losses, frozen_kept = _lora_losses(True)
    normal_losses, normal_kept = _lora_losses(False)
    assert frozen_losses == normal_losses and frozen_losses[-1] < frozen_losses[0]
    assert frozen_kept and not normal_kept
