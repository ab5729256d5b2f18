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
