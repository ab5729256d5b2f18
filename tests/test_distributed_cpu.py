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
import pytest
import torch.distributed as dist

from data_parallel import WORLD, fully_shard, run_data_parallel

pytestmark = [
    pytest.mark.skipif(fully_shard is None, reason="this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)"),
    pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo backend"),
]


@pytest.mark.parametrize("kind", ["linear", "linear_sr", "experts", "experts_3"])
def test_fsdp2_on_two_cpu_ranks_equals_ddp_bit_for_bit(tmp_path, kind):
    fsdp = run_data_parallel("fsdp2", tmp_path, kind, device_type="cpu")
    ddp = run_data_parallel("ddp", tmp_path, kind, device_type="cpu")
    losses = ddp[0]["losses"]
    assert losses[-1] < 0.8 * losses[0], losses  # the run trains, so a stale weight would show
    for rank in range(WORLD):
        assert fsdp[rank]["losses"] == losses and ddp[rank]["losses"] == losses, (rank, fsdp[rank]["losses"], losses)
        params = fsdp[rank]["params"]
        assert params.keys() == ddp[0]["params"].keys() and params
        for name, p in params.items():
            assert p.equal(ddp[0]["params"][name]), (rank, name)


@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_fsdp2_under_torch_compile_on_two_cpu_ranks_equals_eager_fsdp2(tmp_path, kind):
    eager = run_data_parallel("fsdp2", tmp_path, kind, device_type="cpu")
    compiled = run_data_parallel("fsdp2+compile", tmp_path, kind, device_type="cpu")
    assert eager[0]["losses"][-1] < 0.8 * eager[0]["losses"][0]
    for rank in range(WORLD):
        assert compiled[rank]["graphs"] > 0 and eager[rank]["graphs"] == 0  # the compiled run was traced
        assert compiled[rank]["losses"] == eager[rank]["losses"], rank
        for name, p in compiled[rank]["params"].items():
            assert p.equal(eager[rank]["params"][name]), (rank, name)
