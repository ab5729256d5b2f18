"""Stochastic rounding to E2M1 on the reference backend: the random bits and the rounding rule.

Random bits (fp4gen's definition; a CUDA kernel must give the same bytes). A quantized copy of shape
[rows, cols] (cols a multiple of 16) draws one byte per element from Philox4x32-10 keyed by the state's
seed and offset, both unsigned 64-bit values split into 32-bit words (lo, hi):
  - element (r, c) has the 64-bit flat index e = r * cols + c, and belongs to block b = e // 16 (a block
    never straddles rows);
  - block b's 16 bytes are the output words (w0, w1, w2, w3) of Philox4x32-10 with
    key = (seed_lo, seed_hi) and counter = (b_lo, b_hi, offset_lo, offset_hi);
  - element 16b + 4w + i takes byte i of word w (little-endian: bits 8i .. 8i + 7).
The bits depend only on (seed, offset, e), so any tiling of the work reproduces them: one Philox call
per 16 elements, made by whichever thread owns the block.

Rounding (E2M1_SR, as TransformerEngine's software fallback): y is the element already multiplied by its
block's encode factor and u = byte / 256. With step(v) = 2 if v >= 4, 1 if v >= 2, else 0.5:
  t = fl(|y| + u * step(|y|))   (u * step is exact, so this equals fma(u, step, |y|))
  q = min(floor(t / step(t)) * step(t), 6)
and the code is q's with the sign bit set when y < 0. NaN gives +6 (code 0x7) and -0.0 gives code 0, as
round-to-nearest does.
"""
from __future__ import annotations

import torch

from .formats import BLOCK
from .reference import E2M1_MAX, e2m1_encode

# The Random123 / curand Philox4x32 constants: round multipliers and the key's Weyl increments.
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def _mulhilo(m: int, x: torch.Tensor):
    """(hi, lo) 32-bit words of m * x for a uint32 constant m and int64 x holding uint32 values.

    The product needs 64 unsigned bits, past int64, so multiply by m's 16-bit halves (each partial product
    stays below 2^48) and carry by hand.
    """
    p_lo = x * (m & 0xFFFF)
    p_hi = x * (m >> 16)
    s = p_lo + ((p_hi & 0xFFFF) << 16)  # the product's low 48 bits plus a carry; below 2^49
    return (p_hi >> 16) + (s >> 32), s & _MASK32


def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS):
    """Philox4x32-`rounds` of counter (four int64 tensors of uint32 values) under key (two), broadcast
    together; returns four int64 tensors of uint32 values (Random123's philox4x32, curand's Philox4_32_10)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for i in range(rounds):
        if i:  # the key advances between rounds, not before the first
            k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
        hi0, lo0 = _mulhilo(PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _words(value, device):
    """(lo, hi) 32-bit words of an unsigned 64-bit value given as an int or as an int64 tensor with its bits
    (a device tensor is read on the device: no synchronization)."""
    if isinstance(value, torch.Tensor):
        v = value.to(device=device, dtype=torch.int64)
        return v & _MASK32, (v >> 32) & _MASK32  # the mask undoes the arithmetic shift's sign fill
    value &= (1 << 64) - 1
    return (torch.tensor(value & _MASK32, dtype=torch.int64, device=device),
            torch.tensor(value >> 32, dtype=torch.int64, device=device))


def random_bytes(seed, offset, rows: int, cols: int, device) -> torch.Tensor:
    """uint8 [rows, cols]: each element's random byte for seed and offset (ints, or 0-d int64 tensors on
    `device`), by the rule in the module docstring."""
    if cols % BLOCK:
        raise ValueError(f"cols must be a multiple of {BLOCK}, got {cols}")
    b = torch.arange(rows * cols // BLOCK, dtype=torch.int64, device=device)
    words = philox4x32((b & _MASK32, b >> 32, *_words(offset, device)), _words(seed, device))
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=device)
    out = (torch.stack(torch.broadcast_tensors(*words), dim=-1).unsqueeze(-1) >> shifts) & 0xFF  # [n, word, byte]
    return out.to(torch.uint8).reshape(rows, cols)


def _step(v: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid spacing at magnitude v (NaN gets 0.5; it is replaced later)."""
    return torch.where(v >= 4, 2.0, torch.where(v >= 2, 1.0, 0.5)).to(torch.float32)


def e2m1_encode_stochastic(y: torch.Tensor, rbytes: torch.Tensor) -> torch.Tensor:
    """E2M1_SR of fp32 y with each element's random byte rbytes (uint8, y's shape); returns uint8 codes."""
    a = y.abs()
    u = rbytes.to(torch.float32) / 256  # exact
    t = a + u * _step(a)
    step_t = _step(t)  # t may have crossed into the next binade
    q = torch.clamp(torch.floor(t / step_t) * step_t, max=E2M1_MAX)  # on the grid; NaN stays NaN
    # e2m1_encode maps the exact grid value q (and NaN) to its code; the sign comes from y, as in rounding
    return e2m1_encode(q) | ((y < 0).to(torch.uint8) << 3)
