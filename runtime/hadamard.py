"""The 16-point random Hadamard transform (RHT) of TransformerEngine's NVFP4 recipe, in plain PyTorch.

The wgrad GEMM contracts dY^T X over the token dimension M. Multiplying both columnwise copies, dY^T and
X^T, by the same orthogonal block-diagonal matrix along M leaves that product unchanged, while spreading
outliers over 16 tokens before each 1x16 NVFP4 block is quantized. The rowwise copies are untouched.

The matrix (entries +-1/4, exact in bf16):
    H = (1/4) diag(s) H16,   H16[i, j] = (-1)^popcount(i & j)   (Sylvester),
    s_i = -1 where bit i of RHT_SIGN_MASK = 0xD7E8 is set, else +1.
diag(s) scales the ROWS of H16, so H is not symmetric; H H^T = I.

The transform of xt [rows, cols] (cols % 16 == 0; xt is x.T, one row per feature) acts on each
consecutive 16-element group g of a row, as a row vector, g' = bf16_RNE(g H), evaluated in fp32 in this
order (the fast Walsh-Hadamard butterfly, which H16 = H2 (x) H2 (x) H2 (x) H2 allows):
    u_j = fl(g_j * s_j / 4)                                   (exact unless fp32-subnormal)
    for h = 1, 2, 4, 8: for every j with bit h clear: (u_j, u_{j+h}) <- (fl(u_j + u_{j+h}), fl(u_j - u_{j+h}))
    g'_k = bf16_RNE(u_k), a NaN u_k being the quiet NaN 0x7FC0 whatever its payload
Upstream sums inside an MMA in an order it does not specify; whenever the 16 values span less than about
2^12 (bf16 data almost always does) every order gives the same exact fp32 sum, so the bytes agree with
upstream's. The CUDA kernels evaluate the same butterfly, so both backends agree in every case.

Input dtypes: bf16 (upstream's), and, as fp4gen's own definition, fp16 and fp32: the same transform of the
exact input values, with the output always rounded to bf16.

Non-finite inputs are left to the arithmetic: a NaN in a group makes all 16 outputs of that group NaN, an
Inf makes them +-Inf (or NaN where +Inf and -Inf meet), and either then reaches the columnwise amax.
"""
from __future__ import annotations

import torch

from .formats import BLOCK

RHT_SIGN_MASK = 0xD7E8
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rht_matrix(device=None) -> torch.Tensor:
    """H = (1/4) diag(s) H16 as fp32 [16, 16]; H[j, k] = s_j (-1)^popcount(j & k) / 4."""
    idx = torch.arange(BLOCK, device=device)
    # (-1)^popcount(j & k): the parity of the set bits of j & k
    parity = torch.zeros(BLOCK, BLOCK, dtype=torch.int64, device=device)
    both = idx.reshape(-1, 1) & idx.reshape(1, -1)
    for bit in range(4):  # 16 = 2^4, so four bits
        parity ^= (both >> bit) & 1
    h16 = 1.0 - 2.0 * parity.to(torch.float32)
    signs = 1.0 - 2.0 * ((RHT_SIGN_MASK >> idx) & 1).to(torch.float32)
    return signs.reshape(-1, 1) * h16 * 0.25  # all exact: +-1 times +-1 times 1/4


def apply_rht(xt: torch.Tensor) -> torch.Tensor:
    """bf16 [rows, cols]: each 16-element group g of each row of xt replaced by bf16_RNE(g @ H), evaluated
    by the fp32 butterfly of the module docstring."""
    if xt.dim() != 2:
        raise ValueError(f"apply_rht takes a 2-D [rows, cols] tensor; got {xt.dim()} dimensions")
    if xt.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"apply_rht: dtype {xt.dtype} is not supported; use bfloat16, float16 or float32")
    rows, cols = xt.shape
    if cols % BLOCK != 0:
        raise ValueError(f"apply_rht: {cols} columns is not a multiple of {BLOCK}")
    idx = torch.arange(BLOCK, device=xt.device)
    quarter_signs = 0.25 * (1.0 - 2.0 * ((RHT_SIGN_MASK >> idx) & 1).to(torch.float32))
    u = xt.float().reshape(rows, cols // BLOCK, BLOCK) * quarter_signs  # exact widening, then fl(g_j s_j / 4)
    for h in (1, 2, 4, 8):
        pairs = u.reshape(rows, cols // BLOCK, BLOCK // (2 * h), 2, h)  # [..., j with bit h clear / set, ...]
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        u = torch.stack((low + high, low - high), dim=-2).reshape(rows, cols // BLOCK, BLOCK)
    out = u.to(torch.bfloat16)  # one RNE rounding
    # NaNs canonical, so that the amaxes' bit patterns depend on no backend's NaN payloads
    quiet_nan = torch.tensor(0x7FC0, dtype=torch.int16, device=u.device).view(torch.bfloat16)
    return torch.where(torch.isnan(out), quiet_nan, out).reshape(rows, cols)
