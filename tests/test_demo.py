"""The demo a new user runs after the build: it trains both models and writes the loss-curve PNG."""
import math

from fp4gen import demo


def test_demo_trains_both_models_and_writes_a_png(tmp_path, capsys):
    out = tmp_path / "loss.png"
    ratio = demo.main(["--steps", "4", "--device", "cpu", "--out", str(out)])
    assert math.isfinite(ratio) and ratio > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "ratio NVFP4/bf16" in printed and "bf16 torch.nn.Linear" in printed
