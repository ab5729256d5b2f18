"""The NVFP4 containers as users handle them: repr, moving between devices, saving and loading, versions."""
import re

import pytest
import torch

import fp4gen


def _quantized():
    torch.manual_seed(0)
    return fp4gen.quantize(torch.randn(32, 64, dtype=torch.bfloat16), scaling="row")


def test_reprs_show_shapes_not_contents():
    q = _quantized()
    for obj, expected in ((q, "NVFP4Tensor(shape=[32, 64], from bfloat16, scaling='row', block=(1, 16), "
                               "copies=rowwise+columnwise, device=cpu)"),
                          (q.rowwise, "NVFP4Data(shape=[32, 64], amax per row [32], device=cpu)")):
        text = repr(obj)
        assert text == expected
        assert "tensor(" not in text and not re.search(r"\d\.\d{3}", text)  # no tensor values


@pytest.mark.parametrize("scaling,block", [("row", (1, 16)), ("tensor", (16, 16))])
def test_torch_load_with_weights_only(tmp_path, scaling, block):
    q = fp4gen.quantize(torch.randn(32, 64), scaling=scaling, block=block)
    path = tmp_path / "q.pt"
    torch.save({"q": q, "row": q.rowwise}, path)
    loaded = torch.load(path, weights_only=True)
    for copy in ("rowwise", "columnwise"):
        a, b = getattr(q, copy), getattr(loaded["q"], copy)
        assert isinstance(b, fp4gen.NVFP4Data)
        for t in ("data", "scale", "amax"):
            assert torch.equal(getattr(a, t).view(torch.uint8), getattr(b, t).view(torch.uint8))
    assert (loaded["q"].shape, loaded["q"].dtype, loaded["q"].scaling, loaded["q"].block) == \
        (q.shape, q.dtype, q.scaling, q.block)
    assert torch.equal(loaded["row"].data, q.rowwise.data)


def test_to_moves_every_tensor():
    q = _quantized()
    moved = q.to("meta")
    for copy in (moved.rowwise, moved.columnwise):
        assert copy.device.type == "meta"
        assert all(t.device.type == "meta" for t in (copy.data, copy.scale, copy.amax))
    assert q.rowwise.to("cpu") is q.rowwise  # already there: no copy
    assert moved.rowwise.shape == q.rowwise.shape and moved.scaling == "row"
    assert q.rowwise.to(torch.device("meta")).amax.shape == (32,)


def test_version_is_the_installed_distribution_version():
    from importlib.metadata import version
    assert fp4gen.__version__ == version("fp4gen")
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", fp4gen.__version__)
