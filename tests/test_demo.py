"""The demo a new user runs after the build: it trains both models and writes the loss-curve PNG, and refuses
bad arguments before spending any time on training."""
import math
import sys

import pytest
import torch

from fp4gen import demo
from fp4gen import nn as fp4nn


def test_demo_trains_both_models_and_writes_a_png(tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    out = tmp_path / "loss.png"
    ratio = demo.main(["--steps", "4", "--device", "cpu", "--out", str(out)])
    assert math.isfinite(ratio) and ratio > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(out).shape[:2]
    assert width > 400 and height > 300
    printed = capsys.readouterr().out
    assert "ratio NVFP4/bf16" in printed and "bf16 torch.nn.Linear" in printed


@pytest.fixture
def no_training(monkeypatch):
    """Any call of demo.train fails the test: the arguments must be refused before training starts."""
    def train(*args):
        raise AssertionError("demo.train was called")
    monkeypatch.setattr(demo, "train", train)


@pytest.fixture
def fake_training(monkeypatch):
    """A stand-in for demo.train so tests of the flow around it do not spend seconds training: NVFP4 losses
    are twice the bf16 ones, so the ratio is 2."""
    def train(linear, steps, device):
        return [2.0 if linear is fp4nn.Linear else 1.0] * steps
    monkeypatch.setattr(demo, "train", train)


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_zero_steps_is_refused_before_training(no_training, tmp_path, capsys):
    err = refused(["--steps", "0", "--device", "cpu", "--out", str(tmp_path / "loss.png")], capsys)
    assert "--steps must be >= 1" in err


def test_cuda_is_refused_where_it_is_not_available(no_training, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(["--steps", "4", "--device", "cuda", "--out", str(tmp_path / "loss.png")], capsys)
    assert "CUDA is not available" in err


def test_a_cuda_index_past_the_device_count_is_refused(no_training, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(["--device", "cuda:1", "--out", str(tmp_path / "loss.png")], capsys)
    assert "only 1 CUDA device" in err


# explicit ids: conftest skips any test with the keyword "gpu", which a bare "gpu" id would add
@pytest.mark.parametrize("device", ["gpu", "mps", "meta", "cpu:1"], ids=["typo", "mps", "meta", "cpu-index"])
def test_unknown_devices_are_refused(device, no_training, tmp_path, capsys):
    err = refused(["--device", device, "--out", str(tmp_path / "loss.png")], capsys)
    assert "use cpu, cuda or cuda:N" in err


@pytest.mark.parametrize("name, message", [
    ("missing/loss.png", "does not exist"),
    ("loss.txt", "must end in .png"),
    ("folder.png", "is a directory"),
])
def test_bad_out_paths_are_refused_before_training(name, message, no_training, tmp_path, capsys):
    (tmp_path / "folder.png").mkdir()
    err = refused(["--device", "cpu", "--out", str(tmp_path / name)], capsys)
    assert message in err


def test_out_must_be_png_relative_to_the_working_directory_too(no_training, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert "must end in .png" in refused(["--device", "cpu", "--out", "foo.txt"], capsys)


def test_no_plot_writes_no_file(fake_training, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # the default --out would land here
    assert demo.main(["--steps", "3", "--device", "cpu", "--no-plot"]) == 2.0
    assert list(tmp_path.iterdir()) == []
    assert "ratio NVFP4/bf16 = 2.000" in capsys.readouterr().out


def test_missing_matplotlib_is_refused_before_training_unless_no_plot(no_training, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    err = refused(["--device", "cpu", "--out", str(tmp_path / "loss.png")], capsys)
    assert "pip install matplotlib" in err and "--no-plot" in err

    monkeypatch.setattr(demo, "train", lambda linear, steps, device: [1.0] * steps)  # --no-plot: may train
    assert demo.main(["--steps", "2", "--device", "cpu", "--out", str(tmp_path / "loss.png"), "--no-plot"]) == 1.0
    assert list(tmp_path.iterdir()) == []


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in ("--steps", "--device", "--out", "--no-plot", "example:"):
        assert option in text
