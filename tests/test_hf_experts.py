"""fp4gen.hf_experts: the NVFP4 experts implementation for Hugging Face transformers' MoE models, on tiny models
(reference backend on CPU): Qwen3-MoE and Mixtral ([E, out, in] weights) and gpt-oss ([E, in, out] weights with
biases). Each expert projection must equal fp4gen.nn.GroupedLinear over the same weights and tokens, grouped here
without the implementation's sort; the routing must be the model's own (close to its fp32 experts, far from a
wrong routing); the quantized weights must be reused until an optimizer step."""
import copy
import importlib.util
from pathlib import Path

import pytest
import torch

import fp4gen
import fp4gen.hf_experts

transformers = pytest.importorskip("transformers", minversion="5.0")

NEAREST = "fp4gen-test-nearest"  # a registered name whose recipe rounds gradients to nearest (no random state)
fp4gen.hf_experts.register(NEAREST, fp4gen.Recipe(stochastic_rounding=False))
UNKEPT = "fp4gen-test-unkept"  # the same, keeping no quantized weight between calls
fp4gen.hf_experts.register(UNKEPT, fp4gen.Recipe(stochastic_rounding=False), keep_quantized_weight=False)


SHAPES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2, max_position_embeddings=64)
MODELS = {  # config class, model class, expert settings (each expert 64 -> 2 x 64 -> 64)
    "qwen3": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, intermediate_size=128,
                                                            moe_intermediate_size=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=64)),
    # expert weights stored transposed, [E, in, out], with biases
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, intermediate_size=64)),
}


def tiny_moe(kind="qwen3", experts_implementation="fp4gen", seed=0, **overrides):
    torch.manual_seed(seed)
    config_class, model_class, experts = MODELS[kind]
    config = getattr(transformers, config_class)(**{**SHAPES, **experts, **overrides})
    model = getattr(transformers, model_class)(config)
    fp4gen.hf_experts.register()
    model.set_experts_implementation(experts_implementation)
    return model


def experts_of(model):
    return model.model.layers[0].mlp.experts


def routed(tokens=40, hidden=64, experts=4, top_k=2, seed=1):
    """Hidden states and a routing in which expert 3 gets no token."""
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(tokens, hidden, generator=g)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, 3] = -1.0
    top_k_weights, top_k_index = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return hidden_states, top_k_index, top_k_weights


def grouped_linear_loop(experts, hidden_states, top_k_index, top_k_weights, recipe):
    """The experts' output from two fp4gen.nn.GroupedLinear layers holding the experts' weights, with the
    tokens grouped by a mask per expert (in token order, as a stable sort orders them)."""
    num_experts = experts.num_experts
    rows, choices, sizes = [], [], []
    for e in range(num_experts):
        token, choice = (top_k_index == e).nonzero(as_tuple=True)
        rows.append(token)
        choices.append(choice)
        sizes.append(token.numel())
    token, choice = torch.cat(rows), torch.cat(choices)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    layers = []
    for name in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, name)
        if experts.is_transposed:
            weight = weight.transpose(1, 2)
        layer = fp4gen.nn.GroupedLinear(num_experts, weight.shape[2], weight.shape[1], bias=experts.has_bias,
                                        recipe=recipe, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if experts.has_bias:
                layer.bias.copy_(getattr(experts, f"{name}_bias"))
        layers.append(layer)
    h = experts._apply_gate(layers[0](hidden_states[token], ends))
    y = layers[1](h, ends) * top_k_weights[token, choice].unsqueeze(-1)
    out = torch.zeros(hidden_states.shape, dtype=y.dtype, device=y.device).index_add(0, token, y)
    return out.to(hidden_states.dtype), layers


def weight_grad(experts, name):
    """The gradient of an expert weight as [E, out, in]."""
    grad = getattr(experts, name).grad
    return grad.transpose(1, 2) if experts.is_transposed else grad


def check_equal_to_grouped_linear_layers(experts, x, out, dout, top_k_index, top_k_weights):
    """The experts' output `out` of tokens x (a leaf), after out.backward(dout), against grouped_linear_loop's:
    outputs and every gradient bit for bit (the bias gradients, summed with index_add_, to fp32 rounding)."""
    x_loop = x.detach().clone().requires_grad_()
    expected, layers = grouped_linear_loop(experts, x_loop, top_k_index, top_k_weights,
                                           fp4gen.Recipe(stochastic_rounding=False))
    expected.backward(dout)
    assert torch.equal(out, expected)
    assert torch.equal(x.grad, x_loop.grad)
    assert torch.equal(weight_grad(experts, "gate_up_proj"), layers[0].weight.grad)
    assert torch.equal(weight_grad(experts, "down_proj"), layers[1].weight.grad)
    assert not experts.gate_up_proj.grad[3].any()  # routed() gives expert 3 no tokens
    if experts.has_bias:
        assert torch.allclose(experts.down_proj_bias.grad, layers[1].bias.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", [NEAREST, UNKEPT])
@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "gpt_oss"])
def test_experts_equal_grouped_linear_layers(kind, implementation):
    """Also with keep_quantized_weight=False (UNKEPT), whose caches stay empty: for gpt-oss's transposed weights, W's
    columnwise copy is then the stored weight's rowwise quantization, made at backward."""
    model = tiny_moe(kind, implementation)
    experts = experts_of(model)
    if experts.has_bias:  # transformers leaves them zero
        with torch.no_grad():
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                getattr(experts, name).normal_(0, 0.02)
    hidden_states, top_k_index, top_k_weights = routed()
    x = hidden_states.clone().requires_grad_()
    out = experts(x, top_k_index, top_k_weights)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_equal_to_grouped_linear_layers(experts, x, out, dout, top_k_index, top_k_weights)
    caches = experts._fp4gen_weight_caches.values()
    assert all((cache.entry is None) == (implementation == UNKEPT) for cache in caches) and caches


def test_experts_under_torch_compile_match_eager():
    """fullgraph: the sort, the group ends and the grouped custom ops trace without a graph break (traced first,
    before any eager call has given the module its weight caches)."""
    experts = experts_of(tiny_moe("qwen3", NEAREST))
    hidden_states, top_k_index, top_k_weights = routed()
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (compiled, experts):
        x = hidden_states.clone().requires_grad_()
        out = fn(x, top_k_index, top_k_weights)
        out.square().sum().backward()
        grads.append((out, x.grad, experts.down_proj.grad.clone()))
        experts.zero_grad()
    for eager, traced in zip(*grads):
        assert torch.equal(eager, traced)


def test_routing_is_the_models_own():
    """Against the model's own experts in fp32 (transformers' grouped_mm implementation) the NVFP4 output differs by
    quantization noise only; the same experts fed a wrong routing (every choice moved to the next expert) are far
    off."""
    model = tiny_moe("qwen3", NEAREST)
    experts = experts_of(model)
    hidden_states, top_k_index, top_k_weights = routed()
    with torch.no_grad():
        nvfp4 = experts(hidden_states, top_k_index, top_k_weights)
        wrong = experts(hidden_states, (top_k_index + 1) % experts.num_experts, top_k_weights)
        model.set_experts_implementation("grouped_mm")
        exact = experts(hidden_states, top_k_index, top_k_weights)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(nvfp4, exact) < 0.4  # measured 0.24: two chained NVFP4 projections and the gate between them
    assert rel(wrong, exact) > 0.9  # measured 1.26


def test_model_trains_under_autocast_and_requantizes_after_each_step():
    model = tiny_moe("qwen3")  # the name "fp4gen": the default recipe
    experts = experts_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(6):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        cached = experts._fp4gen_weight_caches["gate_up_proj"].entry
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            model(input_ids=ids)
        assert experts._fp4gen_weight_caches["gate_up_proj"].entry is cached  # no change, no requantization
        loss.backward()
        assert experts.gate_up_proj.grad.dtype == torch.float32 and torch.isfinite(experts.gate_up_proj.grad).all()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        model(input_ids=ids)
    assert experts._fp4gen_weight_caches["gate_up_proj"].entry is not cached  # the step changed the weight
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_unchanged_expert_weights_are_quantized_once(kind):
    """gpt-oss stores its experts [E, in, out] and each call multiplies a new transposed view: the cache is tied to
    the stored parameter, so an unchanged weight is still quantized once."""
    model = tiny_moe(kind)
    experts = experts_of(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = model(input_ids=ids).logits
        cached = experts._fp4gen_weight_caches["gate_up_proj"].entry
        assert torch.equal(model(input_ids=ids).logits, first)
    assert experts._fp4gen_weight_caches["gate_up_proj"].entry is cached


def test_clear_weight_caches_reaches_the_experts():
    """After a write through .data (no version counter moves), fp4gen.nn.clear_weight_caches forgets the experts'
    quantized weights too, and the model computes with the new weights."""
    model = tiny_moe("qwen3")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.data.mul_(-1.0)
        assert torch.equal(model(input_ids=ids).logits, before)  # the caches still hold the old weights
        assert fp4gen.nn.clear_weight_caches(model) == 2 * len(model.model.layers)  # gate_up_proj, down_proj
        after = model(input_ids=ids).logits
        twin = tiny_moe("qwen3", seed=5)
        twin.load_state_dict(model.state_dict())
        assert not torch.equal(after, before) and torch.equal(after, twin(input_ids=ids).logits)


def check_an_rl_iteration_with_a_reference_model(device, dtype, frozen=True):
    """What docs/recipes.md's RL section describes, on a tiny Qwen3-MoE converted whole: rollouts generated under
    inference mode, a training step of the policy (which leaves the reference's frozen caches alone, and drops
    normal ones: frozen=False), then a reference model synced through .data (as TRL's sync_ref_model does): stale
    until its caches are cleared, then computing with the synced weights."""
    policy = tiny_moe("qwen3").to(device, dtype)
    fp4gen.convert(policy, skip="lm_head")
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    fp4gen.nn.frozen_weight_caches(reference, frozen)
    reference_caches = experts_of(reference)._fp4gen_weight_caches
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    prompts = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.inference_mode():
        rollouts = policy.generate(prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
        reference_before = reference(input_ids=rollouts).logits
    rollouts = rollouts.clone()  # an inference tensor cannot enter autograd
    loss = policy(input_ids=rollouts, labels=rollouts).loss
    loss.backward()
    kept = reference_caches["gate_up_proj"].entry
    opt.step()  # drops the policy's caches, and the reference's unless frozen
    assert (reference_caches["gate_up_proj"].entry is kept) == frozen
    with torch.no_grad():
        assert torch.equal(reference(input_ids=rollouts).logits, reference_before)  # kept, or made again
    alpha = 0.5
    for r, p in zip(reference.parameters(), policy.parameters()):
        r.data.mul_(1 - alpha).add_(p.data, alpha=alpha)
    with torch.no_grad():
        twin = copy.deepcopy(reference)  # a copy makes its caches afresh, from the synced weights
        expected = twin(input_ids=rollouts).logits
        assert not torch.equal(reference(input_ids=rollouts).logits, expected)  # stale: nothing saw the sync
        assert fp4gen.nn.clear_weight_caches(reference) > 0
        assert torch.equal(reference(input_ids=rollouts).logits, expected)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "normal"])
def test_an_rl_iteration_with_a_reference_model(frozen):
    check_an_rl_iteration_with_a_reference_model("cpu", torch.float32, frozen)


def test_unsupported_experts_raise():
    model = tiny_moe("qwen3")
    experts = experts_of(model)
    hidden_states, top_k_index, top_k_weights = routed()
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        experts(hidden_states, top_k_index, top_k_weights)
    narrow = experts_of(tiny_moe("qwen3", moe_intermediate_size=48))
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts\.gate_up_proj has shape \(4, 96, 64\): its out "
                                         r"dimension 96 is not a multiple of 64"):
        narrow(hidden_states, top_k_index, top_k_weights)
    narrow = experts_of(tiny_moe("gpt_oss", intermediate_size=48))
    with pytest.raises(ValueError, match=r"GptOssExperts\.gate_up_proj\.transpose\(1, 2\) has shape \(4, 96, 64\)"):
        narrow(hidden_states, top_k_index, top_k_weights)


def test_convert_notes_experts_that_do_not_run_in_nvfp4():
    report = fp4gen.convert(tiny_moe("qwen3", "grouped_mm"), skip="lm_head")
    assert len(report.converted) == 8  # the attention projections; the experts are no torch.nn.Linear layers
    assert report.notes == [
        "the experts of model.layers.0.mlp.experts and 1 more (transformers' stacked expert weights, not "
        "torch.nn.Linear layers) keep their implementation 'grouped_mm': fp4gen.hf_experts runs them in NVFP4 "
        "(fp4gen.hf_experts.register(), then model.set_experts_implementation(\"fp4gen\"))"]
    assert "note       the experts of model.layers.0.mlp.experts and 1 more" in str(report)
    assert fp4gen.convert(tiny_moe("qwen3", NEAREST), skip="lm_head").notes == []


def test_the_benchmarks_check_runs_both_implementations_on_the_cpu():
    """bench/hf_experts.py --check (imported by path: bench/ is not a package): the same experts module and routing
    through transformers' grouped_mm and through fp4gen, their outputs apart by NVFP4's error only."""
    path = Path(__file__).resolve().parents[1] / "bench" / "hf_experts.py"
    spec = importlib.util.spec_from_file_location("fp4gen_hf_experts_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    errors = bench.check()
    assert list(errors) == ["qwen3 (small)"] and 0.05 < errors["qwen3 (small)"] < 0.4


def test_register_checks_its_arguments():
    with pytest.raises(TypeError, match="recipe must be an fp4gen.Recipe"):
        fp4gen.hf_experts.register(recipe="default")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        fp4gen.hf_experts.register("")
    with pytest.raises(TypeError, match="keep_quantized_weight must be True or False"):
        fp4gen.hf_experts.register(UNKEPT, keep_quantized_weight=0)


def test_without_transformers_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers.integrations.moe", None)
    with pytest.raises(ImportError, match=r"transformers 5.0 or newer .*pip install 'transformers>=5'"):
        fp4gen.hf_experts.register()


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_static_expert_caches_are_remade_in_place_by_an_optimizer_step(kind):
    """fp4gen.nn.static_weight_caches, before any call, takes the experts' caches (made empty then); the first call
    fills them and an optimizer step remakes them in their own tensors, with the bytes a fresh quantization of the
    stepped weights gives (gpt-oss: from the stored [E, in, out] parameter, through its transposed view)."""
    from fp4gen.grouped_linear import StackedWeightCache
    model = tiny_moe(kind, experts_implementation=NEAREST)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    assert fp4gen.nn.static_weight_caches(model) == 2 * SHAPES["num_hidden_layers"]
    model(input_ids=ids)
    experts = experts_of(model)
    cache = experts._fp4gen_weight_caches["gate_up_proj"]
    kept = cache.entry[1] + cache.entry[2]
    codes_before = kept[0].clone()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    now = cache.entry[1] + cache.entry[2]
    assert all(a is b for a, b in zip(now, kept))
    weight = experts.gate_up_proj.transpose(1, 2) if cache.transposed else experts.gate_up_proj
    fresh = StackedWeightCache(cache.transposed).get(weight, fp4gen.Recipe(stochastic_rounding=False))
    assert all(torch.equal(a, b) for a, b in zip(now, fresh[0] + fresh[1]))
    assert not torch.equal(now[0], codes_before)  # the step moved the weights, and the codes with them


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_a_frozen_reference_keeps_its_expert_caches_through_the_policys_steps(kind):
    """fp4gen.nn.frozen_weight_caches on a converted reference model (experts included, before their first call):
    the policy's optimizer steps leave the reference's quantized weights alone (a normal cache would be dropped by
    each), and the reference keeps computing with its own weights."""
    policy = tiny_moe(kind, experts_implementation=NEAREST)
    fp4gen.convert(policy, skip="lm_head")
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    layers = sum(isinstance(m, fp4gen.nn.Linear) for m in reference.modules())
    assert fp4gen.nn.frozen_weight_caches(reference) == layers + 2 * SHAPES["num_hidden_layers"]
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    caches = experts_of(reference)._fp4gen_weight_caches
    kept = {name: cache.entry for name, cache in caches.items()}
    assert all(entry[2] is None for entry in kept.values())  # forwards without autograd: the rowwise copies alone
    for _ in range(2):
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        assert all(caches[name].entry is entry for name, entry in kept.items())
        with torch.no_grad():
            assert torch.equal(reference(input_ids=ids).logits, expected)
    assert all(caches[name].entry is entry for name, entry in kept.items())
    assert experts_of(policy)._fp4gen_weight_caches["down_proj"].entry is None  # the policy's: dropped by the step


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_experts_take_a_call_without_tokens(kind):
    """A batch with no tokens (a data-parallel rank's empty share, say): an empty output, empty input gradient and
    zero weight gradients, as transformers' own implementation gives."""
    experts = experts_of(tiny_moe(kind, NEAREST))
    hidden_states, top_k_index, top_k_weights = routed(tokens=0)
    x = hidden_states.clone().requires_grad_()
    out = experts(x, top_k_index, top_k_weights)
    assert out.shape == (0, 64) and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad.shape == (0, 64)
    assert not experts.gate_up_proj.grad.any() and not experts.down_proj.grad.any()
