"""FSDP2 around fp4gen layers on the CPU: two processes over gloo (the reference backend), so that every CI run
shards fp4gen.nn.Linear's and fp4gen.nn.GroupedLinear's weights across two ranks, all-gathers them before each
forward and steps the optimizer on the shards.

Both ranks of an FSDP2 run compute exactly what the same two ranks compute under DDP: the same quantization of
the same slices (with stochastic rounding, the same random bits: each rank's state is seeded alike and advanced
by its own backward passes), the same sum of two ranks' gradients (a sum of two numbers does not depend on its
order), and Adam elementwise on shards or on whole tensors. So the two runs must agree bit for bit, step by step.
A weight quantization cached across an optimizer step (FSDP2 refills the unsharded weight without bumping its
version counter) breaks that: with the layers' optimizer-step hook removed, the Linear stack's and the experts'
losses part from the third step on (measured 2026-12-05, torch 2.13 CPU). The GPU runs of the same models are
tests/gpu/test_distributed.py.

FSDP2 under torch.compile runs the layers' custom ops, traced, on the same shards: the same bits again."""
import importlib.util

import pytest
import torch.distributed as dist

from data_parallel import WORLD, fully_shard, run_data_parallel

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="the Qwen3-MoE model needs transformers")
pytestmark = [
    pytest.mark.skipif(fully_shard is None, reason="this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)"),
    pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo backend"),
]


@pytest.mark.parametrize("kind", ["linear", "linear_sr", "experts", "experts_3", "linear_unkept", "experts_unkept",
                                  pytest.param("qwen3_moe", marks=needs_transformers)])
def test_fsdp2_on_two_cpu_ranks_equals_ddp_bit_for_bit(tmp_path, kind):
    fsdp, ddp = run_data_parallel([("fsdp2", kind), ("ddp", kind)], tmp_path, device_type="cpu")
    losses = ddp[0]["losses"]
    assert losses[-1] < 0.8 * losses[0], losses  # the run trains, so a stale weight would show
    for rank in range(WORLD):
        assert fsdp[rank]["losses"] == losses and ddp[rank]["losses"] == losses, (rank, fsdp[rank]["losses"], losses)
        params = fsdp[rank]["params"]
        assert params.keys() == ddp[0]["params"].keys() and params
        for name, p in params.items():
            assert p.equal(ddp[0]["params"][name]), (rank, name)


@pytest.mark.parametrize("kind", ["linear", "experts", "linear_unkept", "experts_unkept"])
def test_fsdp2_under_torch_compile_on_two_cpu_ranks_equals_eager_fsdp2(tmp_path, kind):
    eager, compiled = run_data_parallel([("fsdp2", kind), ("fsdp2+compile", kind)], tmp_path, device_type="cpu")
    assert eager[0]["losses"][-1] < 0.8 * eager[0]["losses"][0]
    for rank in range(WORLD):
        assert compiled[rank]["graphs"] > 0 and eager[rank]["graphs"] == 0  # the compiled run was traced
        assert compiled[rank]["losses"] == eager[rank]["losses"], rank
        for name, p in compiled[rank]["params"].items():
            assert p.equal(eager[rank]["params"][name]), (rank, name)


# The bytes of W's columnwise NVFP4 codes (one byte a pair) that a kept layer saves for backward: the Linear stack's
# 256 -> 512 -> 256 -> 64 layers, the experts' 4 x 256 -> 64
W_COLUMNWISE_CODES = {"linear": (256 * 512 + 512 * 256 + 256 * 64) // 2, "experts": 4 * 256 * 64 // 2}


@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_under_fsdp2_layers_that_keep_no_quantized_weight_save_no_unsharded_copy(tmp_path, kind):
    """After a forward under FSDP2, what kept layers saved for backward holds their whole weights' columnwise NVFP4
    copies on every rank; with keep_quantized_weight=False they save the gathered weight itself, which FSDP2 frees
    after the forward (and gathers again for backward), so at least those codes' bytes less stay held."""
    kept, unkept = run_data_parallel([("fsdp2", kind), ("fsdp2", f"{kind}_unkept")], tmp_path, device_type="cpu")
    for rank in range(WORLD):
        [held], [held_unkept] = kept[rank]["saved_bytes"], unkept[rank]["saved_bytes"]
        assert held - held_unkept >= W_COLUMNWISE_CODES[kind], (rank, held, held_unkept)
        assert unkept[rank]["losses"] == kept[rank]["losses"]  # the same bytes computed


def _one_rank_fsdp2_steps(tmp_path, keep: bool, steps: int = 2, shard: bool = True, reference: bool = False) -> list:
    """The fp4gen warnings that `steps` Adam steps of an FSDP2-sharded fp4gen.nn.Linear (one gloo rank, in this
    process; shard=False: the same layer unsharded) give; reference=True: with an unsharded reference layer beside
    it (frozen caches, as an RL reference model), run without autograd before each step."""
    import warnings

    import torch

    import fp4gen
    from data_parallel import fully_shard
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layer = fp4gen.nn.Linear(64, 32, keep_quantized_weight=keep)
        if shard:
            fully_shard(layer)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
        ref = fp4gen.nn.Linear(64, 32).requires_grad_(False)
        fp4gen.nn.frozen_weight_caches(ref)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                x = torch.randn(16, 64)
                if reference:
                    with torch.no_grad():
                        ref(x)
                layer(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    finally:
        dist.destroy_process_group()
    return [str(w.message) for w in caught if "fp4gen" in str(w.message)]


def test_kept_copies_of_fsdp2_sharded_weights_are_warned_about_once(tmp_path, monkeypatch):
    from fp4gen import nn
    monkeypatch.setattr(nn, "_SHARDED_WARNING_GIVEN", False)
    (tmp_path / "kept").mkdir()
    messages = _one_rank_fsdp2_steps(tmp_path / "kept", keep=True)
    assert len(messages) == 1 and "keep_quantized_weight=False" in messages[0]  # once, not every step
    monkeypatch.setattr(nn, "_SHARDED_WARNING_GIVEN", False)
    (tmp_path / "unkept").mkdir()
    assert _one_rank_fsdp2_steps(tmp_path / "unkept", keep=False) == []  # its bias's fp32 copy is no weight copy
    (tmp_path / "unsharded").mkdir()
    assert _one_rank_fsdp2_steps(tmp_path / "unsharded", keep=True, shard=False) == []
    (tmp_path / "reference").mkdir()  # a frozen reference model's kept caches are meant to stay
    assert _one_rank_fsdp2_steps(tmp_path / "reference", keep=False, reference=True) == []
