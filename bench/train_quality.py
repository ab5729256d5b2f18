"""Training quality of NVFP4 recipes: a small byte-level GPT trained once per recipe ("preset") on real text,
and each run's final validation loss against a bf16 baseline.

What it measures. The model is a 6-layer GPT (d_model 384, 6 heads, context 256, vocabulary = the 256 byte
values, pre-LayerNorm blocks, 4x GELU MLP, learned positions, untied output head). The text is the Python
standard library's own .py sources, read in sorted path order (always on disk, so the bench needs no
download); the last 5% of the bytes are the validation set. Every torch.nn.Linear inside the transformer
blocks (qkv, attention output, fc1, fc2) is the layer under test: `bf16` keeps them torch.nn.Linear under
bf16 autocast, every other preset converts them with fp4gen.convert(model, recipe=...) while embeddings,
LayerNorms and the output head stay in high precision. All runs start from the same weights (same seed)
and see the same batches in the same order, so they differ only in the recipe. The validation loss of a
run is the mean cross-entropy (nats per byte) over a fixed set of validation batches after the last step,
computed with the model as it trains (NVFP4 forward for NVFP4 presets).

The table reports per preset: the recipe, the final validation loss, its ratio to the bf16 loss (1.000 =
trains as well as bf16), the mean step time after warm-up and its ratio to bf16's. A second table says
what each option buys: the ratio of a preset minus the ratio of the same preset without that option, in
percentage points of the bf16 loss (negative = lower loss = better).

Run it on a GPU, from the repository root:

    python bench/train_quality.py [--presets bf16,default,rn,...] [--json results.json]

800 steps of 32 x 256 bytes per preset. On an H200 (torch 2.11, 2026-12-01) the bf16 run took about 13 s
(12.6-13.8 ms a step) and each NVFP4 run 30-43 s (37-54 ms a step: eager and host-bound at this size), so
all 15 presets take about 10 minutes. The header lines (GPU,
torch, commit, date) and both tables are printed so they can be pasted into bench/RESULTS.md.

The corpus is whatever .py files the running Python's stdlib directory holds (all of them below the
32 MB cap: 10.7 MB for one Python 3.12 install, 31.5 MB for a 3.11 install that keeps its test suite), so
losses are comparable only between tables with the same "corpus:" line.
On CPU fp4gen runs its reference backend, which is slow: use a tiny configuration there, for example

    python bench/train_quality.py --device cpu --steps 3 --layers 1 --d-model 64 --heads 2 --seq 32 \
        --batch 2 --corpus-mb 1 --eval-batches 1 --presets bf16,rn

Noise. With a fixed --seed a rerun on the same machine and software repeats nearly the same numbers, but
that says nothing about how much a ratio would move under another initialization and data order, which
is the noise that matters when two presets are compared. Before drawing conclusions from differences of
a few tenths of a percent, run at least bf16 and one NVFP4 preset with two or three --seed values and
state the spread of their ratios next to the table: a difference smaller than that spread is not evidence.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fp4gen
from fp4gen.demo import device_argument  # the demo's --device checks

VAL_FRACTION = 0.05  # the last 5% of the corpus bytes are held out
LR, MIN_LR_FRACTION, WARMUP_STEPS = 1e-3, 0.1, 50
WEIGHT_DECAY, GRAD_CLIP = 0.1, 1.0
TIMING_WARMUP_STEPS = 20  # steps left out of the step time (allocator growth, first-call kernel setup)
LOG_EVERY = 100
BLOCK = 16  # fp4gen's NVFP4 block: layer widths and the tokens of a step must be multiples of it


# ---------------------------------------------------------------------------------------------------------
# Presets

@dataclasses.dataclass(frozen=True)
class Preset:
    """recipe: keyword arguments of fp4gen.Recipe, or None for the bf16 baseline (torch.nn.Linear).
    keep_first_last: the first and last transformer block's linears stay torch.nn.Linear."""
    recipe: dict | None
    keep_first_last: bool = False


# The layout every preset but `default` pins, so that a later change of fp4gen.Recipe()'s defaults does not
# silently change what these presets measure (and old tables stay comparable with new ones).
LAYOUT = dict(row_scaled_activation=True, weight_block=(16, 16), gradient_scaling="tensor",
              four_over_six_error="mae")
RN = dict(LAYOUT, stochastic_rounding=False, hadamard_wgrad=False, four_over_six=None)  # round-to-nearest only
SR_RHT = dict(RN, stochastic_rounding=True, hadamard_wgrad=True)

PRESETS = {
    "bf16": Preset(None),
    "default": Preset({}),  # whatever fp4gen.Recipe() is
    "rn": Preset(RN),
    "rn+sr": Preset(dict(RN, stochastic_rounding=True)),
    "rn+rht": Preset(dict(RN, hadamard_wgrad=True)),
    "rn+sr+rht": Preset(SR_RHT),
    "rn+4o6": Preset(dict(RN, four_over_six="all")),
    "rn+4o6w": Preset(dict(RN, four_over_six="weights")),
    "rn+4o6a": Preset(dict(RN, four_over_six="activations")),
    "sr+rht+4o6": Preset(dict(SR_RHT, four_over_six="all")),
    "w1x16+sr+rht": Preset(dict(SR_RHT, weight_block=(1, 16))),
    "rowgrad+sr+rht": Preset(dict(SR_RHT, gradient_scaling="row")),
    "rowgrad+rht": Preset(dict(RN, hadamard_wgrad=True, gradient_scaling="row")),
    "rowgrad+rht+4o6a": Preset(dict(RN, hadamard_wgrad=True, gradient_scaling="row", four_over_six="activations")),
    "sr+rht+4o6 keep-first-last": Preset(dict(SR_RHT, four_over_six="all"), keep_first_last=True),
}

# "what each option buys": (preset, the same preset without the option, label)
OPTION_EFFECTS = [
    ("rn+sr", "rn", "+ sr"),
    ("rn+rht", "rn", "+ rht"),
    ("rn+sr+rht", "rn", "+ sr+rht"),
    ("rn+4o6", "rn", "+ 4o6 (all)"),
    ("rn+4o6w", "rn", "+ 4o6 (weights)"),
    ("rn+4o6a", "rn", "+ 4o6 (activations)"),
    ("sr+rht+4o6", "rn+sr+rht", "+ 4o6 on sr+rht"),
    ("w1x16+sr+rht", "rn+sr+rht", "1x16 weight blocks on sr+rht"),
    ("rowgrad+sr+rht", "rn+sr+rht", "row-scaled gradients on sr+rht"),
    ("rowgrad+rht", "rn+rht", "row-scaled gradients on rht"),
    ("rowgrad+sr+rht", "rowgrad+rht", "+ sr on rowgrad+rht"),
    ("rowgrad+rht+4o6a", "rowgrad+rht", "+ 4o6 (activations) on rowgrad+rht"),
    ("sr+rht+4o6 keep-first-last", "sr+rht+4o6", "first+last block in bf16 on sr+rht+4o6"),
]


def build_recipe(name: str) -> fp4gen.Recipe | None:
    """The preset's fp4gen.Recipe (None for bf16). A Recipe that lacks a field or refuses a value raises
    ValueError naming the preset, so an fp4gen without the option fails before any training."""
    kwargs = PRESETS[name].recipe
    if kwargs is None:
        return None
    try:
        return fp4gen.Recipe(**kwargs)
    except (TypeError, ValueError) as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ValueError(f"preset {name!r} needs fp4gen.Recipe({shown}), which this fp4gen "
                         f"({fp4gen.__file__}) refuses: {e}") from None


def describe_recipe(recipe: fp4gen.Recipe | None, keep_first_last: bool = False) -> str:
    """A short form of the recipe for the table, e.g. 'act=row w=16x16 grad=tensor sr rht 4o6=all/mae'."""
    if recipe is None:
        return "torch.nn.Linear (bf16 autocast)"
    values = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    parts = []
    if "row_scaled_activation" in values:
        parts.append("act=" + ("row" if values.pop("row_scaled_activation") else "tensor"))
    if "weight_block" in values:
        parts.append("w={}x{}".format(*values.pop("weight_block")))
    if "gradient_scaling" in values:
        parts.append(f"grad={values.pop('gradient_scaling')}")
    if "stochastic_rounding" in values:
        parts.append("sr" if values.pop("stochastic_rounding") else "rn")
    if values.pop("hadamard_wgrad", False):
        parts.append("rht")
    four_over_six, error = values.pop("four_over_six", None), values.pop("four_over_six_error", None)
    if four_over_six is not None:
        parts.append(f"4o6={four_over_six}" + (f"/{error}" if error is not None else ""))
    parts += [f"{k}={v}" for k, v in values.items()]  # fields this function does not know yet
    if keep_first_last:
        parts.append("first+last block bf16")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# Data

def stdlib_sources(root: Path | None = None) -> list:
    """The standard library's .py files in sorted path order. Installed third-party packages (site-packages,
    dist-packages, which may live under the stdlib directory) are left out: the corpus should be the same
    for every environment of one Python version."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts) and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def load_corpus(max_bytes: int, root: Path | None = None) -> bytes:
    """The stdlib sources concatenated as bytes, cut at max_bytes; unreadable files are skipped."""
    chunks, total = [], 0
    for path in stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[:max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return b"".join(chunks)


def split_corpus(corpus: bytes) -> tuple:
    """(train, validation) as uint8 tensors: the validation set is the end of the corpus, so the split is
    deterministic and no training window overlaps it."""
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    cut = len(data) - int(len(data) * VAL_FRACTION)
    return data[:cut], data[cut:]


def random_offsets(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, len(data) - seq, (batch,), generator=generator)


def windows(data: torch.Tensor, offsets: torch.Tensor, seq: int, device) -> tuple:
    """Inputs and next-byte targets, [batch, seq] each, of the windows starting at offsets."""
    chunk = data[offsets[:, None] + torch.arange(seq + 1)].long().to(device)
    return chunk[:, :-1], chunk[:, 1:]


# ---------------------------------------------------------------------------------------------------------
# Model

class Attention(torch.nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = torch.nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(torch.nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = torch.nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(torch.nn.Module):
    """Pre-LayerNorm: the residual stream itself is never normalized, only each branch's input."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1, self.attn = torch.nn.LayerNorm(d_model), Attention(d_model, heads)
        self.ln2, self.mlp = torch.nn.LayerNorm(d_model), MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, layers: int, d_model: int, heads: int, seq: int, vocab: int = 256):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(seq, d_model)
        self.blocks = torch.nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)  # untied: the embedding is not reused
        self._init_weights(layers)

    def _init_weights(self, layers: int):
        # GPT-2's initialization: N(0, 0.02), and the projections that write into the residual stream
        # scaled by 1/sqrt(2 * layers) so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.proj.weight", "mlp.fc2.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(args, seed: int, device) -> GPT:
    """The same initial weights for every run: built on the CPU from `seed`, then moved."""
    torch.manual_seed(seed)
    return GPT(args.layers, args.d_model, args.heads, args.seq).to(device)


def high_precision_layers(layers: int, keep_first_last: bool) -> list:
    """Names (patterns) of the linear layers fp4gen.convert must leave alone: the output head, and with
    keep_first_last the first and last block's linears."""
    skip = ["head"]
    if keep_first_last:
        skip += ["blocks.0.*", f"blocks.{layers - 1}.*"]
    return skip


def apply_preset(model: GPT, recipe: fp4gen.Recipe | None, preset: Preset, layers: int) -> None:
    if recipe is None:
        return
    report = fp4gen.convert(model, recipe=recipe, skip=high_precision_layers(layers, preset.keep_first_last))
    expected = 4 * (layers - (min(layers, 2) if preset.keep_first_last else 0))
    if len(report.converted) != expected:  # a layer fp4gen refused would silently stay high precision
        raise RuntimeError(f"fp4gen.convert converted {len(report.converted)} layers, expected {expected}:\n{report}")


# ---------------------------------------------------------------------------------------------------------
# Training

def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_FRACTION of the peak at the last step."""
    warmup = min(WARMUP_STEPS, max(1, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: GPT) -> torch.optim.AdamW:
    # Weight decay on matrices (linears, embeddings) only; LayerNorm gains and biases are not decayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))


def loss_of(model: GPT, x, y, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model: GPT, val_batches: list, device) -> float:
    model.eval()
    losses = [loss_of(model, *windows(data, offsets, seq, device), device)
              for data, offsets, seq in val_batches]
    model.train()
    return torch.stack(losses).mean().item()


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall time of the training steps alone: evaluation pauses it; on CUDA each start and stop waits for
    the queued kernels, so the time is the steps' device time, not their launch time."""

    def __init__(self, device):
        self.device, self.total, self.started = device, 0.0, None

    def start(self):
        synchronize(self.device)
        self.started = time.perf_counter()

    def stop(self):
        if self.started is not None:
            synchronize(self.device)
            self.total += time.perf_counter() - self.started
            self.started = None


def restart_stochastic_rounding(seed: int, device) -> None:
    """Give every run the same stochastic-rounding bits: fp4gen draws them from the device's default
    RNGState, which torch.manual_seed restarts only when the seed differs from the last one, so a run
    would otherwise continue the stream where the previous preset left it."""
    torch.manual_seed(seed)
    fp4gen.RNGState.default(device).reset(seed)


def train(name: str, args, device, train_data, val_batches) -> dict:
    """One run: the model with the preset applied, trained for args.steps; its losses and step time."""
    preset, recipe = PRESETS[name], build_recipe(name)
    model = build_model(args, args.seed, device)
    apply_preset(model, recipe, preset, args.layers)
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.steps))
    batches = torch.Generator().manual_seed(args.seed)  # the same data order in every run
    restart_stochastic_rounding(args.seed, device)

    timer, timed_from = Timer(device), min(TIMING_WARMUP_STEPS, args.steps // 2)
    start, loss_sum, loss_count = time.perf_counter(), torch.zeros((), device=device), 0
    train_curve, val_curve, diverged_at = [], [], None
    for step in range(args.steps):
        if step == timed_from:
            timer.start()
        x, y = windows(train_data, random_offsets(train_data, args.batch, args.seq, batches), args.seq, device)
        loss = loss_of(model, x, y, device)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        loss_sum += loss.detach()
        loss_count += 1
        last = step == args.steps - 1
        if (step + 1) % LOG_EVERY == 0 or last:
            mean = loss_sum.item() / loss_count  # a sync, but only every LOG_EVERY steps
            loss_sum.zero_()
            loss_count = 0
            train_curve.append((step + 1, mean))
            print(f"  [{name}] step {step + 1:>5}/{args.steps}  train loss {mean:.4f}  "
                  f"{time.perf_counter() - start:7.1f} s", flush=True)
            if not math.isfinite(mean):
                diverged_at = step + 1
                break
        if args.eval_every and (step + 1) % args.eval_every == 0 and not last:
            timer.stop()
            val_curve.append((step + 1, evaluate(model, val_batches, device)))
            print(f"  [{name}] step {step + 1:>5}  val loss {val_curve[-1][1]:.4f}", flush=True)
            timer.start()
    timer.stop()
    timed_steps = (diverged_at or args.steps) - timed_from
    val_loss = float("nan") if diverged_at else evaluate(model, val_batches, device)
    val_curve.append((diverged_at or args.steps, val_loss))
    print(f"  [{name}] val loss {val_loss:.4f}" + (f" (diverged at step {diverged_at})" if diverged_at else ""))
    return {"preset": name, "recipe": describe_recipe(recipe, preset.keep_first_last),
            "recipe_fields": None if recipe is None else {k: v for k, v in dataclasses.asdict(recipe).items()},
            "keep_first_last": preset.keep_first_last, "val_loss": val_loss,
            "step_ms": 1e3 * timer.total / timed_steps if timed_steps > 0 else float("nan"),
            "diverged_at": diverged_at, "train_curve": train_curve, "val_curve": val_curve}


# ---------------------------------------------------------------------------------------------------------
# Report

def add_ratios(results: list) -> None:
    """ratio = val loss / bf16's, time_ratio = step time / bf16's; None without a bf16 run."""
    base = next((r for r in results if r["preset"] == "bf16"), None)
    for r in results:
        r["ratio"] = r["val_loss"] / base["val_loss"] if base else None
        r["time_ratio"] = r["step_ms"] / base["step_ms"] if base else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def results_table(results: list) -> str:
    lines = ["| preset | recipe | val loss | vs bf16 | step ms | time vs bf16 |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['preset']} | {r['recipe']} | {r['val_loss']:.4f} | {_fmt(r['ratio'], '.4f')} "
                     f"| {r['step_ms']:.1f} | {_fmt(r['time_ratio'], '.2f')} |")
    return "\n".join(lines)


def option_effects(results: list) -> list:
    """(label, percentage points) for each OPTION_EFFECTS pair whose two presets both ran."""
    by_name = {r["preset"]: r for r in results}
    effects = []
    for preset, without, label in OPTION_EFFECTS:
        if preset in by_name and without in by_name and by_name[preset]["ratio"] is not None:
            effects.append((f"{label} ({preset} vs {without})",
                            100 * (by_name[preset]["ratio"] - by_name[without]["ratio"])))
    return effects


def option_table(results: list) -> str:
    if not any(r["preset"] == "bf16" for r in results):
        return "what each option buys: needs the bf16 preset (ratios are relative to it)"
    effects = option_effects(results)
    if not effects:
        return "what each option buys: needs a preset and the same preset without the option (e.g. rn and rn+sr)"
    lines = ["what each option buys (ratio difference in percentage points of the bf16 loss; negative = better):"]
    lines += [f"  {label}: {points:+.2f} pts" for label, points in effects]
    return "\n".join(lines)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def environment(device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"none (CPU: {platform.machine()})"
    return {"gpu": gpu, "torch": torch.__version__, "fp4gen": fp4gen.__version__,
            "python": platform.python_version(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


# ---------------------------------------------------------------------------------------------------------
# Command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/train_quality.py",
        description="Train a small byte-level GPT on the Python stdlib sources once per NVFP4 recipe preset and "
                    "compare the final validation losses with a bf16 baseline.",
        epilog="presets, in order: " + ", ".join(PRESETS) + "\nexample: python bench/train_quality.py "
               "--presets bf16,default,rn --json results.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--presets", default=",".join(PRESETS),
                   help="comma-separated presets to run, in this order (default: all)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=256, help="context length in bytes (default: %(default)s)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=384, help="model width (default: %(default)s)")
    p.add_argument("--heads", type=int, default=6, help="attention heads (default: %(default)s)")
    p.add_argument("--corpus-mb", type=float, default=32,
                   help="at most this many MB (1e6 bytes) of stdlib sources (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=16,
                   help="validation batches (of --batch sequences) the loss is averaged over (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every N steps (default: only after the last step)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and data order (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the results (and loss curves) as JSON to PATH")
    return p


def _presets(p: argparse.ArgumentParser, text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        p.error("--presets is empty; choose from: " + ", ".join(PRESETS))
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        p.error(f"--presets: unknown preset(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(PRESETS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--presets lists {', '.join(map(repr, twice))} more than once")
    return names


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """Everything that can be refused before the corpus is read or any model is built."""
    for option in ("steps", "batch", "seq", "layers", "d_model", "heads", "eval_batches"):
        if getattr(args, option) < 1:
            p.error(f"--{option.replace('_', '-')} must be >= 1 (got {getattr(args, option)})")
    if args.eval_every < 0:
        p.error(f"--eval-every must be >= 0 (got {args.eval_every})")
    if not args.corpus_mb > 0 or not math.isfinite(args.corpus_mb):
        p.error(f"--corpus-mb must be a positive number (got {args.corpus_mb})")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    nvfp4 = [n for n in args.presets if PRESETS[n].recipe is not None]
    if nvfp4 and args.d_model % BLOCK:
        p.error(f"--d-model {args.d_model}: NVFP4 presets ({', '.join(nvfp4)}) need a multiple of {BLOCK}")
    if nvfp4 and (args.batch * args.seq) % BLOCK:
        p.error(f"--batch x --seq = {args.batch * args.seq} tokens per step: NVFP4 presets ({', '.join(nvfp4)}) "
                f"need a multiple of {BLOCK}")
    keep = [n for n in args.presets if PRESETS[n].keep_first_last]
    if keep and args.layers < 3:
        p.error(f"--layers {args.layers}: preset {keep[0]!r} keeps the first and last block in bf16, so it needs "
                f"at least 3 layers to have an NVFP4 block")
    for name in args.presets:
        try:
            build_recipe(name)
        except ValueError as e:
            p.error(str(e))
    if args.json:
        path = Path(args.json)
        if path.is_dir():
            p.error(f"--json {args.json} is a directory; give a file name")
        if not path.parent.is_dir():
            p.error(f"--json {args.json}: directory {str(path.parent)!r} does not exist")
        if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            p.error(f"--json {args.json}: not writable")


def main(argv=None) -> list:
    """Run the selected presets; print the header and tables; return the results (dicts, one per preset)."""
    p = _parser()
    args = p.parse_args(argv)
    args.presets = _presets(p, args.presets)
    _check_args(p, args)
    device = device_argument(p, args.device)

    corpus = load_corpus(int(args.corpus_mb * 1e6))
    train_data, val_data = split_corpus(corpus)
    if len(val_data) <= args.seq or len(train_data) <= args.seq:
        p.error(f"--corpus-mb {args.corpus_mb}: {len(corpus)} bytes leave {len(val_data)} validation bytes, too "
                f"few for --seq {args.seq}; raise --corpus-mb")
    val_generator = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [(val_data, random_offsets(val_data, args.batch, args.seq, val_generator), args.seq)
                   for _ in range(args.eval_batches)]

    env = environment(device)
    params = sum(p.numel() for p in GPT(args.layers, args.d_model, args.heads, args.seq).parameters())
    print(f"GPU: {env['gpu']}  torch {env['torch']}  fp4gen {env['fp4gen']}  python {env['python']}  "
          f"commit {env['commit']}  date {env['date']}")
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, context {args.seq}, "
          f"{params / 1e6:.2f} M parameters; {args.steps} steps of {args.batch} x {args.seq} bytes, seed {args.seed}")
    print(f"corpus: {len(corpus) / 1e6:.2f} MB of Python {env['python']} stdlib sources "
          f"({len(train_data)} train / {len(val_data)} validation bytes), validation = {args.eval_batches} "
          f"batches; device {device}", flush=True)

    results = []
    for name in args.presets:
        print(f"\n{name}: {describe_recipe(build_recipe(name), PRESETS[name].keep_first_last)}", flush=True)
        results.append(train(name, args, device, train_data, val_batches))
    add_ratios(results)

    print()
    print(results_table(results))
    print()
    print(option_table(results))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"environment": env, "config": config, "results": results}, indent=2))
        print(f"\nresults written to {args.json}")
    return results


if __name__ == "__main__":
    main()
