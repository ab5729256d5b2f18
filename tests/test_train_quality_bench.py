"""bench/train_quality.py on the CPU: a tiny training run of two presets gives finite losses and ratios, the
corpus is real stdlib Python, presets convert the layers they name, and bad arguments are refused before
any training."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import fp4gen

BENCH = Path(__file__).resolve().parents[1] / "bench" / "train_quality.py"
TINY = ["--device", "cpu", "--steps", "3", "--layers", "1", "--d-model", "64", "--heads", "2", "--seq", "32",
        "--batch", "2", "--corpus-mb", "1", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def bench():
    """bench/train_quality.py imported by path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("fp4gen_train_quality_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def no_training(bench, monkeypatch):
    def train(*args):
        raise AssertionError("train was called")
    monkeypatch.setattr(bench, "train", train)


def test_a_tiny_run_gives_finite_losses_and_a_ratio(bench, tmp_path, capsys):
    out = tmp_path / "results.json"
    results = bench.main(TINY + ["--presets", "bf16,rn", "--json", str(out)])
    by_name = {r["preset"]: r for r in results}
    assert list(by_name) == ["bf16", "rn"]
    for r in results:
        assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < 10  # ln(256) = 5.5 at the start
        assert math.isfinite(r["step_ms"]) and r["step_ms"] > 0
    assert by_name["bf16"]["ratio"] == 1.0
    assert math.isfinite(by_name["rn"]["ratio"]) and 0.5 < by_name["rn"]["ratio"] < 2
    assert by_name["rn"]["recipe_fields"]["stochastic_rounding"] is False
    printed = capsys.readouterr().out
    assert "| rn | " in printed and "| bf16 | " in printed and "torch " in printed and "commit " in printed
    assert '"val_loss"' in out.read_text()


def test_the_corpus_is_stdlib_python_in_sorted_order(bench):
    corpus = bench.load_corpus(200_000)
    assert len(corpus) == 200_000 and b"def " in corpus and b"import " in corpus
    first = bench.stdlib_sources()[0]
    assert first.suffix == ".py" and "site-packages" not in first.parts
    assert corpus.startswith(first.read_bytes()[:1000])
    train, val = bench.split_corpus(corpus)
    assert len(val) == 10_000 and bytes(val.tolist()) == corpus[-10_000:]


def test_every_preset_builds_a_recipe_and_default_is_the_project_default(bench):
    for name in bench.PRESETS:
        recipe = bench.build_recipe(name)
        assert (recipe is None) == (name == "bf16")
    assert bench.build_recipe("default") == fp4gen.Recipe()
    assert bench.build_recipe("rn+sr").stochastic_rounding is True


def test_keep_first_last_leaves_the_outer_blocks_and_the_head_in_torch_linear(bench):
    args = bench._parser().parse_args(["--layers", "3", "--d-model", "32", "--heads", "2", "--seq", "16"])
    name = "sr+rht+4o6 keep-first-last"
    model = bench.build_model(args, 0, torch.device("cpu"))
    bench.apply_preset(model, bench.build_recipe(name), bench.PRESETS[name], args.layers)
    converted = {n for n, m in model.named_modules() if isinstance(m, fp4gen.nn.Linear)}
    assert converted == {f"blocks.1.{layer}" for layer in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}


def test_option_effects_are_ratio_differences_in_points(bench):
    results = [{"preset": p, "val_loss": loss, "step_ms": 1.0}
               for p, loss in (("bf16", 2.0), ("rn", 2.04), ("rn+sr", 2.02))]
    bench.add_ratios(results)
    assert bench.option_effects(results) == [("+ sr (rn+sr vs rn)", pytest.approx(-1.0))]


@pytest.mark.parametrize("argv, message", [
    (["--presets", "bf16,nope"], "unknown preset(s) 'nope'"),
    (["--presets", "rn,rn"], "more than once"),
    (["--presets", "rn", "--d-model", "40"], "multiple of 16"),
    (["--presets", "sr+rht+4o6 keep-first-last"], "at least 3 layers"),
    (["--presets", "bf16", "--steps", "0"], "--steps must be >= 1"),
])
def test_bad_arguments_are_refused_before_training(bench, no_training, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
