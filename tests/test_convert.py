"""fp4gen.convert / fp4gen.unconvert and Linear.from_linear / to_linear on CPU."""
import pytest
import torch

import fp4gen


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_proj = torch.nn.Linear(32, 64)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.odd = torch.nn.Linear(64, 10)  # 10 outputs: not a multiple of 16
        self.wide = torch.nn.Linear(64, 64, dtype=torch.float64)
        self.attn = torch.nn.MultiheadAttention(64, 4)  # out_proj is a torch.nn.Linear subclass
        self.lm_head = torch.nn.Linear(64, 32)

    def forward(self, x):
        h = self.embed_proj(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(h)


def test_convert_replaces_eligible_layers_in_place_and_reports_the_rest():
    torch.manual_seed(0)
    model = Model()
    params_before = dict(model.named_parameters())
    state_before = {k: v.clone() for k, v in model.state_dict().items()}
    up = model.layers[0].up
    report = fp4gen.convert(model, skip=["embed_proj", "lm_head"])
    assert report.converted == ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]
    skipped = dict(report.skipped)
    assert set(skipped) == {"embed_proj", "odd", "wide", "attn.out_proj", "lm_head"}
    assert "skipped by name" in skipped["embed_proj"] and "skipped by name" in skipped["lm_head"]
    assert "out_features=10" in skipped["odd"] and "multiple of 16" in skipped["odd"]
    assert "float64" in skipped["wide"]
    assert "subclass" in skipped["attn.out_proj"]
    # the same module objects, parameters, dtypes and state
    assert model.layers[0].up is up and type(up) is fp4gen.nn.Linear
    assert type(model.embed_proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    assert dict(model.named_parameters()).keys() == params_before.keys()
    for name, p in model.named_parameters():
        assert p is params_before[name]
    for k, v in model.state_dict().items():
        assert torch.equal(v, state_before[k])
    # printing shows both lists with reasons
    text = str(report)
    assert text.startswith("fp4gen.convert: 4 converted, 5 skipped")
    assert "converted  layers.1.down" in text and "skipped    odd: out_features=10" in text


def test_converted_model_trains_with_an_optimizer_built_before():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    report = fp4gen.convert(model, recipe=fp4gen.Recipe(row_scaled_activation=False))
    assert report.converted == ["0", "2"] and report.skipped == []
    assert model[0].recipe == fp4gen.Recipe(row_scaled_activation=False)
    x, target = torch.randn(64, 32), torch.randn(64, 16)
    first = None
    for _ in range(20):
        loss = (model(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.7 * first


def test_convert_output_is_the_nvfp4_layer_output():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    x = torch.randn(16, 64)
    expected = fp4gen.nn.Linear.from_linear(model[0])(x)
    fp4gen.convert(model)
    assert torch.equal(model(x), expected)


def test_skip_by_pattern_and_predicate():
    model = Model()
    report = fp4gen.convert(model, skip=["layers.*.down"])
    assert report.converted == ["embed_proj", "layers.0.up", "layers.1.up", "lm_head"]
    model = Model()
    report = fp4gen.convert(model, skip=lambda name, module: module.out_features == 128)
    assert "layers.0.up" not in report.converted and "layers.0.down" in report.converted
    assert dict(report.skipped)["layers.1.up"] == "skip predicate returned True"


def test_skip_that_matches_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"'lm_haed'.*match no linear layer.*did you mean 'lm_head'"):
        fp4gen.convert(Model(), skip=["lm_haed"])
    with pytest.raises(TypeError, match="skip takes module names"):
        fp4gen.convert(Model(), skip=[3])
    with pytest.raises(TypeError, match="must return a bool"):
        fp4gen.convert(Model(), skip=lambda name, module: "yes")


def test_bad_arguments():
    with pytest.raises(TypeError, match="recipe must be an fp4gen.Recipe"):
        fp4gen.convert(Model(), recipe={"row_scaled_activation": True})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        fp4gen.convert([torch.nn.Linear(16, 16)])


def test_shared_module_is_converted_once_and_a_linear_model_itself():
    shared = torch.nn.Linear(32, 32)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    report = fp4gen.convert(model)
    assert report.converted == ["0"] and model[2] is model[0] and type(shared) is fp4gen.nn.Linear
    single = torch.nn.Linear(32, 16)
    assert fp4gen.convert(single).converted == ["(model)"] and type(single) is fp4gen.nn.Linear
    assert dict(fp4gen.convert(single).skipped) == {"(model)": "already an fp4gen.nn.Linear"}


def test_unconvert_restores_torch_linear_with_the_same_parameters():
    torch.manual_seed(3)
    model = Model()
    fp4gen.convert(model)
    weight = model.layers[0].up.weight
    report = fp4gen.unconvert(model, skip=["layers.1.*"])
    assert report.converted == ["embed_proj", "layers.0.up", "layers.0.down", "lm_head"]
    assert type(model.layers[0].up) is torch.nn.Linear and model.layers[0].up.weight is weight
    # none of the state fp4gen.nn.Linear adds is left behind (the caches included)
    assert set(vars(model.layers[0].up)) == set(vars(torch.nn.Linear(2, 2)))
    assert type(model.layers[1].up) is fp4gen.nn.Linear
    x = torch.randn(8, 64)
    assert torch.equal(model.layers[0].up(x), torch.nn.functional.linear(x, weight, model.layers[0].up.bias))


def test_from_linear_and_to_linear_share_parameters():
    linear = torch.nn.Linear(32, 48, dtype=torch.bfloat16).eval()
    layer = fp4gen.nn.Linear.from_linear(linear, recipe=fp4gen.Recipe(weight_block=(1, 16)))
    assert type(linear) is torch.nn.Linear  # the argument is left alone
    assert layer.weight is linear.weight and layer.bias is linear.bias and not layer.training
    assert layer.recipe.weight_block == (1, 16) and layer.weight.dtype == torch.bfloat16
    back = layer.to_linear()
    assert type(back) is torch.nn.Linear and back.weight is linear.weight and back.bias is linear.bias
    no_bias = fp4gen.nn.Linear.from_linear(torch.nn.Linear(32, 16, bias=False))
    assert no_bias.bias is None
    with pytest.raises(ValueError, match="multiple of 16"):
        fp4gen.nn.Linear.from_linear(torch.nn.Linear(32, 10))
    with pytest.raises(TypeError, match="torch.nn.Linear"):
        fp4gen.nn.Linear.from_linear(torch.nn.Conv1d(4, 4, 1))
