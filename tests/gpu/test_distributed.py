"""Data-parallel training with fp4gen.nn.Linear on two GPUs of one host (DDP, and FSDP2 where this PyTorch
has it), and with fp4gen.nn.GroupedLinear experts under FSDP2, against a single-GPU run on the same global
batch; the two-GPU tests are skipped with fewer than two CUDA devices. FSDP2 over a single rank (its sharded
parameters, hooks and optimizer steps around the fp4gen modules, with nothing to communicate) runs on one GPU.

Run: `python -m pytest tests/gpu/test_distributed.py`. Each two-GPU test spawns one process per GPU (NCCL;
NVLink multicast off, see README); the single-rank test runs in the test's own process. The models, batches and
rank processes are tests/data_parallel.py's, which tests/test_distributed_cpu.py also runs on the CPU."""
import pytest
import torch

from data_parallel import WORLD, fully_shard, load_run, make_model, run_data_parallel, train, worker

pytestmark = [pytest.mark.gpu]
needs_world = pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices")


@pytest.fixture(scope="module")
def single_gpu_losses():
    with torch.cuda.device(0):
        return train(make_model("cuda"), rank=0, world=1, device="cuda")


@pytest.fixture(scope="module")
def single_gpu_expert_losses():
    with torch.cuda.device(0):
        return train(make_model("cuda", "experts"), rank=0, world=1, device="cuda")


def assert_losses_match(parallel, single):
    # Quantization scales differ between one 128-token batch and two 64-token halves (per-column amax of X,
    # per-tensor amax of dY), so the runs agree within NVFP4 noise, not bit for bit: a CPU emulation of this
    # run differs by up to 3% from step 7 on, while a weight that never updated would keep the loss near
    # its first value, and the trained loss ends about 40% below that.
    assert single[-1] < 0.8 * single[0], single  # the run trains, so a stale weight would show
    for step, (p, s) in enumerate(zip(parallel, single)):
        assert abs(p - s) <= 0.06 * abs(s), (step, parallel, single)


@needs_world
def test_ddp_matches_single_gpu_and_ranks_hold_identical_gradients(tmp_path, single_gpu_losses):
    [ranks] = run_data_parallel([("ddp", "linear")], tmp_path)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert_losses_match(ranks[0]["losses"], single_gpu_losses)
    assert ranks[0]["grads"].keys() == ranks[1]["grads"].keys() and ranks[0]["grads"]
    for name, g0 in ranks[0]["grads"].items():
        assert torch.equal(g0, ranks[1]["grads"][name]), name


@needs_world
@pytest.mark.skipif(fully_shard is None, reason="this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
@pytest.mark.parametrize("kind", ["linear", "linear_unkept"])
def test_fsdp2_matches_single_gpu(tmp_path, single_gpu_losses, kind):
    [ranks] = run_data_parallel([("fsdp2", kind)], tmp_path)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert_losses_match(ranks[0]["losses"], single_gpu_losses)


@needs_world
@pytest.mark.skipif(fully_shard is None, reason="this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
@pytest.mark.parametrize("kind", ["experts", "experts_unkept"])
def test_fsdp2_grouped_linear_matches_single_gpu(tmp_path, single_gpu_expert_losses, kind):
    """The [E, out, in] expert weight sharded along its experts; the quantized weight must follow each
    unshard after an optimizer step (the cache's optimizer-step key), or the loss would stall."""
    [ranks] = run_data_parallel([("fsdp2", kind)], tmp_path)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert_losses_match(ranks[0]["losses"], single_gpu_expert_losses)


@pytest.mark.skipif(fully_shard is None, reason="this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
@pytest.mark.parametrize("kind,single_losses",
                         [("linear", "single_gpu_losses"), ("experts", "single_gpu_expert_losses")])
def test_fsdp2_one_rank_matches_single_gpu(tmp_path, request, kind, single_losses):
    """FSDP2 over one rank computes what the plain model computes (the same kernels on the same batch), through
    its sharded parameters and its unshard and reshard around every step: a quantized weight that missed an
    optimizer step would move the loss far beyond this tolerance (on the H200, with the optimizer-step hook
    removed from the weight cache, at step 7 for the Linear stack and step 2 for the experts)."""
    single = request.getfixturevalue(single_losses)
    worker(0, [("fsdp2", kind)], str(tmp_path / "rdzv"), str(tmp_path), world=1)
    [sharded] = load_run(tmp_path, "fsdp2", kind, world=1)
    sharded = sharded["losses"]
    assert single[-1] < 0.8 * single[0], single  # the run trains
    for step, (p, s) in enumerate(zip(sharded, single)):
        assert abs(p - s) <= 1e-3 * abs(s), (step, sharded, single)


@pytest.mark.skipif(fully_shard is None, reason="this PyTorch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_fsdp2_one_rank_layers_that_keep_no_quantized_weight_save_less_and_compute_the_same(tmp_path, kind):
    """keep_quantized_weight=False under FSDP2 (one rank): the same losses bit for bit as kept layers (the C++
    launcher's steps quantize W at backward for the Linear stack), with at least W's columnwise codes fewer bytes held
    by what the first forward saved (the saved weights are freed by FSDP2's reshard after the forward)."""
    from test_distributed_cpu import W_COLUMNWISE_CODES
    worker(0, [("fsdp2", kind), ("fsdp2", f"{kind}_unkept")], str(tmp_path / "rdzv"), str(tmp_path), world=1)
    [kept], [unkept] = (load_run(tmp_path, "fsdp2", run, world=1) for run in (kind, f"{kind}_unkept"))
    assert unkept["losses"] == kept["losses"] and kept["losses"][-1] < 0.8 * kept["losses"][0]
    assert kept["saved_bytes"][0] - unkept["saved_bytes"][0] >= W_COLUMNWISE_CODES[kind]
