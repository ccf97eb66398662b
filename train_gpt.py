"""
train_gpt.py: train a GPT-2-small-class model on FineWeb .bin shards to val loss <= 3.28, as fast as possible.

    torchrun --standalone --nproc_per_node=8 train_gpt.py      # the record setup; any divisor of --batch_seqs
                                                               # (1, 2, 4 or 8 GPUs) runs the same training
    python train_gpt.py --help                                 # every hyperparameter; any one can be overridden

The recipe is the NanoGPT speedrun record of Aug 2025 (2.812 min on 8xH100: 1695 steps x 393,216 tokens, mean
val loss 3.2787). Each run writes logs/<run_id>.txt, which starts with this file's source and the environment,
so a log is enough to re-run and diff it; a resumed run appends to it. Sections: ops (FP8 matmul, attention
mask, Newton-Schulz, Adam), optimizer, model, data, Hyperparameters, checkpoints, the training steps, main().
"""

# ----------------------------------------------------------------------------------------------------------
# Imports

import argparse
import contextlib
import copy
import dataclasses
import errno
import glob
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention


class UserError(Exception):
    """Something the user can fix (a flag, a file, the launch). main() prints the message as one line, without
    a traceback, and exits non-zero."""


# ----------------------------------------------------------------------------------------------------------
# Ops: FP8 matmul for the lm_head, the attention mask, Newton-Schulz, Adam

BOS_ID = 50256       # <|endoftext|> in GPT-2's BPE; FineWeb shards put it before every document
GPT2_VOCAB = 50257   # token ids 0..50256; a shard holding anything larger is not GPT-2 BPE
MASK_BLOCK = 128     # FlexAttention's tile size; sliding windows are measured in whole blocks of it
E4M3_MAX = 448.0     # largest finite float8_e4m3fn
E5M2_MAX = 57344.0   # largest finite float8_e5m2
# lm_head FP8 scales of the Aug 2025 record: inputs are rms-normed (entries ~1, at most sqrt(dim)), so x/scale
# fits e4m3 with scale sqrt(dim)/448; weights (Adam lr 0.008 from zero) stay within 448 * 2^-9 = 0.875;
# logit grads of the summed, soft-capped loss are within +-1, i.e. +-448 in e5m2 units of 1/448.
HEAD_W_SCALE = 2**-9
HEAD_GRAD_SCALE = 1 / 448
SOFTCAP = 30.0       # logits are soft-capped to (0, 30) as 30 * sigmoid(z / 7.5) (Aug 2025 record)
SOFTCAP_DIV = 7.5


def softcap(z: Tensor) -> Tensor:
    """The head's logit cap, in fp32 (the Triton kernel below computes the same in its registers)."""
    return SOFTCAP * torch.sigmoid(z.float() / SOFTCAP_DIV)


_scale_tensors = {}


def scale_tensor(value: float, device) -> Tensor:
    """A python float as a cached fp32 device scalar: _scaled_mm takes its scales as tensors, and building one
    per call is a blocking host-to-device copy (6 per micro-step)."""
    key = (value, str(device))
    if key not in _scale_tensors:
        _scale_tensors[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return _scale_tensors[key]


def has_fp8_tensor_cores(capability: tuple) -> bool:
    return tuple(capability) >= (8, 9)  # Ada and Hopper; A100s (8.0) and older have none


def scaled_mm(a: Tensor, b: Tensor, scale_a: float, scale_b: float, out_dtype, fast_accum: bool) -> Tensor:
    """(a*scale_a) @ (b*scale_b) for fp8 a (row-major) and b (column-major). Uses the FP8 tensor cores of
    sm_89+ GPUs; elsewhere computes the same product of the same fp8 values in fp32."""
    if a.is_cuda and has_fp8_tensor_cores(torch.cuda.get_device_capability(a.device)):
        return torch._scaled_mm(a, b, scale_a=scale_tensor(scale_a, a.device), scale_b=scale_tensor(scale_b, a.device),
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def to_fp8(t: Tensor, scale: float, dtype) -> Tensor:
    """t / scale in fp8, saturating: torch's cast turns out-of-range values into NaN, not the largest value."""
    top = E4M3_MAX if dtype == torch.float8_e4m3fn else E5M2_MAX
    return t.div(scale).clamp(-top, top).to(dtype)


try:  # Triton comes with CUDA builds of torch; elsewhere softcap_ce_grad uses its torch fallback
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _tanh(x, APPROX: tl.constexpr):
        """tanh in one special-function-unit op (tanh.approx, max relative error 2^-10.99) or, exactly, in two."""
        if APPROX:
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return 2.0 / (1.0 + tl.exp2(x * -2.8853900817779268)) - 1.0  # 2 sigmoid(2x) - 1

    @triton.jit
    def _softcap_ce_kernel(z_ptr, targets_ptr, loss_ptr, g_ptr, T, inv_grad_s, V: tl.constexpr, CAP: tl.constexpr,
                           DIV: tl.constexpr, TOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                           APPROX: tl.constexpr):
        """Rows [pid*BLOCK_T, +BLOCK_T) of softcap_ce_grad: a pass over the vocab for the log-sum-exp, a second
        that writes each (BLOCK_T x BLOCK_V) tile of the e5m2 grad. The cap is written with tanh,
        sigmoid(u) = (1 + tanh(u/2)) / 2, so c - CAP = CAP/2 (t - 1) and dc/dz = CAP/(4 DIV) (1 - t^2).
        Exponentials are base 2 with log2(e) folded into the constants, and no running max is kept: the capped
        logits lie in (0, CAP), so exp(c - CAP) lies in (e^-CAP, 1] and a sum of them cannot overflow fp32."""
        LOG2E: tl.constexpr = 1.4426950408889634
        HALF_CAP2: tl.constexpr = 0.5 * CAP * LOG2E  # c - CAP in base-2 units, per unit of (t - 1)
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # offsets pass 2^31
        live = rows < T
        s = tl.zeros((BLOCK_T,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            inside = live[:, None] & (cols < V)[None, :]  # the last tile may pass the vocab's end
            z = tl.load(z_ptr + rows[:, None] * V + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            th = _tanh(z * (0.5 / DIV), APPROX)
            s += tl.sum(tl.where(inside, tl.exp2(th * HALF_CAP2 - HALF_CAP2), 0.0), axis=1)  # exp(c - CAP)
        lse2 = CAP * LOG2E + tl.log2(s)  # log2 of sum(exp(c))
        t = tl.load(targets_ptr + rows, mask=live, other=0).to(tl.int64)
        z_t = tl.load(z_ptr + rows * V + t, mask=live, other=0.0).to(tl.float32)
        th_t = _tanh(z_t * (0.5 / DIV), APPROX)
        tl.store(loss_ptr + rows, (lse2 - (th_t + 1.0) * HALF_CAP2) / LOG2E, mask=live)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            inside = live[:, None] & (cols < V)[None, :]
            z = tl.load(z_ptr + rows[:, None] * V + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            th = _tanh(z * (0.5 / DIV), APPROX)
            p = tl.exp2(th * HALF_CAP2 + (HALF_CAP2 - lse2[:, None]))
            dc = tl.where(cols[None, :] == t[:, None], p - 1.0, p)
            g = dc * (1.0 - th * th) * (inv_grad_s * CAP / (4.0 * DIV))
            g = tl.minimum(tl.maximum(g, -TOP), TOP).to(tl.float8e5)
            tl.store(g_ptr + rows[:, None] * V + cols[None, :], g, mask=inside)

    @triton.jit
    def _transpose_bytes_kernel(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """dst (C x R) = src (R x C) transposed, for 1-byte elements: a tile is read in rows and written in
        columns (torch's elementwise copy of a transposed 1-byte tensor is uncoalesced: 314 GB/s on an H200)."""
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
        inside = (r[:, None] < R) & (c[None, :] < C)
        tile = tl.load(src_ptr + r[:, None] * C + c[None, :], mask=inside)
        tl.store(dst_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=tl.trans(inside))

    @triton.jit
    def _add_into_fp32_kernel(acc_ptr, g_ptr, n, BLOCK: tl.constexpr):
        """acc[i] += g[i] for fp32 acc and a narrower g, in one pass over both."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        acc = tl.load(acc_ptr + i, mask=live)
        tl.store(acc_ptr + i, acc + tl.load(g_ptr + i, mask=live).to(tl.float32), mask=live)

    @triton.jit
    def _qk_rows(x_ptr, cos_ptr, sin_ptr, R, T, sx_b, sx_t, sx_h, eps, HEADS: tl.constexpr, D: tl.constexpr,
                 BLOCK_R: tl.constexpr):
        """What both QK-norm + rotary kernels start with, for this program's rows r = (b, t, head) of x
        (B, T, HEADS, D): each row's two halves in fp32 and its rms_norm factor, its position's cos and sin,
        and where the rows are (index, b, t, head, which are live, the half's column)."""
        HALF: tl.constexpr = D // 2
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        live = (r < R)[:, None]
        tok, head = r // HEADS, r % HEADS
        b, t = tok // T, tok % T
        j = tl.arange(0, HALF)[None, :]
        at_x = x_ptr + (b * sx_b + t * sx_t + head * sx_h)[:, None] + j
        x1 = tl.load(at_x, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(at_x + HALF, mask=live, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
        c = tl.load(cos_ptr + t[:, None] * HALF + j, mask=live, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * HALF + j, mask=live, other=0.0)
        return x1, x2, rstd, c, s, r, b, t, head, live, j

    @triton.jit
    def _qk_norm_rotary_fwd(x_ptr, cos_ptr, sin_ptr, y_ptr, R, T, sx_b, sx_t, sx_h, eps, HEADS: tl.constexpr,
                            D: tl.constexpr, BLOCK_R: tl.constexpr):
        """Rows r = (b, t, head) of x (B, T, HEADS, D), strides (sx_b, sx_t, sx_h, 1), into y (B, T, HEADS, D)
        contiguous: y = rotary(rms_norm(x)), the normed row rounded to bf16 before it is turned, as norm()
        hands it to rotary(). Each row is read once, as its two halves, and reduced in registers."""
        x1, x2, rstd, c, s, r, _, _, _, live, j = _qk_rows(x_ptr, cos_ptr, sin_ptr, R, T, sx_b, sx_t, sx_h, eps,
                                                           HEADS, D, BLOCK_R)
        n1 = (x1 * rstd).to(tl.bfloat16).to(tl.float32)
        n2 = (x2 * rstd).to(tl.bfloat16).to(tl.float32)
        dst = y_ptr + r[:, None] * D + j
        tl.store(dst, (n1 * c + n2 * s).to(tl.bfloat16), mask=live)
        tl.store(dst + D // 2, (n2 * c - n1 * s).to(tl.bfloat16), mask=live)

    @triton.jit
    def _qk_norm_rotary_bwd(x_ptr, g_ptr, cos_ptr, sin_ptr, dx_ptr, R, T, sx_b, sx_t, sx_h, sg_b, sg_t, sg_h,
                            sd_b, sd_t, sd_h, eps, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr):
        """dx (strides sd_*) for the rows of _qk_norm_rotary_fwd, given g = dL/dy (strides sg_*). As
        autograd computes it: the rotary's transpose in fp32, rounded to bf16 (the grad of norm()'s bf16
        output), then rms_norm's backward dx = rstd (gn - n mean(gn n)), n = x rstd unrounded."""
        HALF: tl.constexpr = D // 2
        x1, x2, rstd, c, s, _, b, t, head, live, j = _qk_rows(x_ptr, cos_ptr, sin_ptr, R, T, sx_b, sx_t, sx_h, eps,
                                                              HEADS, D, BLOCK_R)
        at_g = g_ptr + (b * sg_b + t * sg_t + head * sg_h)[:, None] + j
        at_d = dx_ptr + (b * sd_b + t * sd_t + head * sd_h)[:, None] + j
        g1 = tl.load(at_g, mask=live, other=0.0).to(tl.float32)
        g2 = tl.load(at_g + HALF, mask=live, other=0.0).to(tl.float32)
        gn1 = (g1 * c - g2 * s).to(tl.bfloat16).to(tl.float32)
        gn2 = (g1 * s + g2 * c).to(tl.bfloat16).to(tl.float32)
        n1, n2 = x1 * rstd, x2 * rstd
        dot = ((tl.sum(gn1 * n1, 1) + tl.sum(gn2 * n2, 1)) / D)[:, None]
        tl.store(at_d, (rstd * (gn1 - n1 * dot)).to(tl.bfloat16), mask=live)
        tl.store(at_d + HALF, (rstd * (gn2 - n2 * dot)).to(tl.bfloat16), mask=live)


# Launch settings measured on an H200 at 49,152 x 50,304. The CE kernel (BLOCK_T, BLOCK_V, num_warps): 8 rows
# of 512 in 8 warps took 4.34 ms per micro-step with the transpose, against 4.67 for round one's 32 x 128 in 4,
# the best of 13 tiles; a few programs per SM looping over rows of 1-2 (so that the second pass might read L2)
# took 7.6-15 ms (records/2026-12-04_speed5-h200/profiles/bench_ce_*.txt). The transpose's tile: 1.28 ms
# (3.9 TB/s; a device copy reaches 4.3; records/2026-12-03_speed-h200/pieces.txt)
CE_TILES = (8, 512, 8)
# The cap's tanh as tanh.approx: one special-function op per element, not two, in each of the CE kernel's two
# passes. That op bounds the kernel: 5.78 -> 4.67 ms per micro-step on an H200, for a loss error of at most
# 1.2e-4 per token (mean 7e-6) and 4e-5 of the e5m2 grads rounded one step differently
# (records/2026-12-03_speed2-h200/pieces.txt). False: the exact tanh, e.g. to compare rounding.
CE_TANH_APPROX = True
TRANSPOSE_TILE = (64, 128)


ACC_BLOCK = 4096  # elements per program of the fp32 accumulate


def add_into_fp32(acc: Tensor, g: Tensor):
    """acc += g, for a contiguous fp32 acc and a bf16 g of as many elements (a micro-step's grad of a bf16
    parameter into its fp32 sum). Torch's add of a bf16 tensor into an fp32 one runs its unvectorized
    mixed-dtype kernel: 0.17 ms per embedding grad (50,304 x 768) on an H200, about 2.3 TB/s, 5.6 ms per step
    for the four embeddings (records/2026-12-04_speed5-h200/profiles/new_s0_profile.txt)."""
    if acc.is_cuda and triton is not None:
        n = acc.numel()
        _add_into_fp32_kernel[(triton.cdiv(n, ACC_BLOCK),)](acc, g.contiguous(), n, BLOCK=ACC_BLOCK, num_warps=8)
    else:
        acc += g


def transposed(t: Tensor) -> Tensor:
    """t.T.contiguous() for a 2-D 1-byte (fp8) tensor; on GPU by the tiled Triton kernel (torch's copy of a
    transposed 1-byte tensor is an uncoalesced elementwise kernel: 16 ms for the 49,152 x 50,304 logit grad)."""
    if not (t.is_cuda and triton is not None):
        return t.T.contiguous()
    R, C = t.shape
    out = torch.empty(C, R, device=t.device, dtype=t.dtype)
    br, bc = TRANSPOSE_TILE
    _transpose_bytes_kernel[(triton.cdiv(R, br), triton.cdiv(C, bc))](t.view(torch.uint8), out.view(torch.uint8), R, C,
                                                                      BLOCK_R=br, BLOCK_C=bc, num_warps=8)
    return out


def softcap_ce_grad(z: Tensor, targets: Tensor, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """For logits z (tokens x vocab): per-token cross-entropy of the soft-capped logits c = 30 sigmoid(z / 7.5),
    and its grad dloss/dz in e5m2 units of grad_s, row-major and transposed (the two operands of the head's
    backward matmuls: FP8 matmuls take only K-contiguous operands, and K is the token dim for grad_w). On GPU
    a Triton kernel reads z twice and writes the fp8 grad, and a second one transposes it. (Stores of the
    transposed tile from the CE kernel itself went to wrong places on an H200 with triton 3.6, as fp8 or as
    bytes, through tl.trans (0.2 ms faster than the separate transpose, records/2026-12-03_speed-h200) or
    through transposed addresses (0.4 ms slower, records/2026-12-04_speed5-h200).)"""
    T, V = z.shape
    if z.is_cuda and triton is not None:
        loss = torch.empty(T, device=z.device, dtype=torch.float32)
        g = torch.empty(T, V, device=z.device, dtype=torch.float8_e5m2)
        block_t, block_v, warps = CE_TILES
        _softcap_ce_kernel[(triton.cdiv(T, block_t),)](z, targets, loss, g, T, 1 / grad_s, V=V, CAP=SOFTCAP,
                                                       DIV=SOFTCAP_DIV, TOP=E5M2_MAX, BLOCK_T=block_t,
                                                       BLOCK_V=block_v, APPROX=CE_TANH_APPROX, num_warps=warps)
        return loss, g, transposed(g)
    c = softcap(z)
    lse = torch.logsumexp(c, dim=-1)
    loss = lse - c.gather(1, targets[:, None].long())[:, 0]
    dc = torch.exp(c - lse[:, None])
    dc[torch.arange(T, device=z.device), targets.long()] -= 1
    sig = torch.sigmoid(z.float() / SOFTCAP_DIV)  # dc/dz = 30/7.5 * sigmoid'
    g = to_fp8(dc * (SOFTCAP / SOFTCAP_DIV) * sig * (1 - sig), grad_s, torch.float8_e5m2)
    return loss, g, g.T.contiguous()


@torch.library.custom_op("train_gpt::fp8_head_loss", mutates_args=())
def fp8_head_loss(x: Tensor, w: Tensor, x_f8: Tensor, w_f8: Tensor, targets: Tensor, x_s: float, w_s: float,
                  grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """The lm_head's summed soft-capped cross-entropy with x @ w.T in FP8: x_f8 and w_f8 are x and w divided by
    their scales and rounded to e4m3 (by the caller, where torch.compile fuses the casts with what makes x; in
    here they were 6 eager passes per micro-step). x and w are inputs only for autograd, which sends their grads
    straight through the casts. The logit grad is computed here, with the loss, so backward is two FP8
    matmuls. Returns (loss, and the e5m2 grad row-major and transposed, for backward)."""
    z = scaled_mm(x_f8, w_f8.T, x_s, w_s, torch.bfloat16, fast_accum=True)
    loss, g_f8, g_f8_t = softcap_ce_grad(z, targets, grad_s)
    return loss.sum(), g_f8, g_f8_t


@fp8_head_loss.register_fake
def _(x, w, x_f8, w_f8, targets, x_s, w_s, grad_s):
    T, V = x.size(0), w.size(0)
    return (x.new_empty((), dtype=torch.float32), x.new_empty(T, V, dtype=torch.float8_e5m2),
            x.new_empty(V, T, dtype=torch.float8_e5m2))


@torch.library.custom_op("train_gpt::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(g_f8: Tensor, g_f8_t: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[Tensor, Tensor]:
    """Grads of x @ w.T from the e5m2 output grad, given twice: row-major for grad_x and transposed for grad_w
    (FP8 matmuls take only K-contiguous operands, and K is the token dim for grad_w)."""
    grad_x = scaled_mm(g_f8, transposed(w_f8).T, grad_s, w_s, torch.bfloat16, fast_accum=False)
    grad_w = scaled_mm(g_f8_t, transposed(x_f8).T, grad_s, x_s, torch.float32, fast_accum=False)
    return grad_x, grad_w


@fp8_mm_backward.register_fake
def _(g_f8, g_f8_t, x_f8, w_f8, x_s, w_s, grad_s):
    return x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.float32)


def _fp8_head_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3], *output[1:])
    ctx.scales = inputs[5:]


def _fp8_head_grad(ctx, grad_loss, *_):
    x_f8, w_f8, g_f8, g_f8_t = ctx.saved_tensors
    grad_x, grad_w = fp8_mm_backward(g_f8, g_f8_t, x_f8, w_f8, *ctx.scales)
    return grad_x * grad_loss, grad_w * grad_loss, None, None, None, None, None, None


fp8_head_loss.register_autograd(_fp8_head_grad, setup_context=_fp8_head_setup)


# QK-norm and RoPE of q and k (norm, then rotary) as one op on GPU, with a hand-written kernel each way.
# Compiled from torch code, inductor's kernels took 0.18 ms forward and 0.21 ms backward per layer and
# micro-step on an H200 (a looped reduction that re-read its rows, and the cos/sin tables per head); these take
# 0.083 and 0.118 (records/2026-12-03_speed4-h200). The op owns the whole grad of its input, so q and k get a
# matmul of their own: were its input part of one qkv matmul's output, inductor would copy the op's grad into
# the qkv grad (a 151 MB read and write per call); whole steps ran 1-4 ms slower that way.
QK_ROWS = 32  # rows (token, head) per program: 16 to 64 timed the same on an H200
FP32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default eps for bf16 input, which it normalizes in fp32


@torch.library.custom_op("train_gpt::qk_norm_rotary", mutates_args=())
def qk_norm_rotary(qk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """CUDA and bf16 only (the model's norm_rotary_qk() is the rule, in torch): qk (B, T, 2 heads, head_dim), q's
    heads then k's, to q and k, each rotary(norm(.)) as (B, T, heads, head_dim); cos, sin: Rotary's tables
    (contiguous rows of head_dim/2 angles)."""
    B, T, H2, D = qk.shape
    rows = B * T * H2 // 2
    qk = qk if qk.stride(-1) == 1 else qk.contiguous()
    q, k = (qk.new_empty(B, T, H2 // 2, D) for _ in range(2))
    for x, y in zip(qk.chunk(2, dim=2), (q, k)):
        _qk_norm_rotary_fwd[(triton.cdiv(rows, QK_ROWS),)](x, cos, sin, y, rows, T, *x.stride()[:3], FP32_EPS,
                                                           HEADS=H2 // 2, D=D, BLOCK_R=QK_ROWS, num_warps=4)
    return q, k


@qk_norm_rotary.register_fake
def _(qk, cos, sin):
    B, T, H2, D = qk.shape
    return qk.new_empty(B, T, H2 // 2, D), qk.new_empty(B, T, H2 // 2, D)


@torch.library.custom_op("train_gpt::qk_norm_rotary_backward", mutates_args=())
def qk_norm_rotary_backward(qk: Tensor, dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The grad of qk_norm_rotary's input from those of its outputs (any strides), recomputing the norm."""
    B, T, H2, D = qk.shape
    rows = B * T * H2 // 2
    dqk = qk.new_empty(qk.shape)
    qk, dq, dk = (t if t.stride(-1) == 1 else t.contiguous() for t in (qk, dq, dk))
    for x, g, dx in zip(qk.chunk(2, dim=2), (dq, dk), dqk.chunk(2, dim=2)):
        _qk_norm_rotary_bwd[(triton.cdiv(rows, QK_ROWS),)](x, g, cos, sin, dx, rows, T, *x.stride()[:3],
                                                           *g.stride()[:3], *dx.stride()[:3], FP32_EPS,
                                                           HEADS=H2 // 2, D=D, BLOCK_R=QK_ROWS, num_warps=4)
    return dqk


@qk_norm_rotary_backward.register_fake
def _(qk, dq, dk, cos, sin):
    return qk.new_empty(qk.shape)


def _qk_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _qk_grad(ctx, dq, dk):
    qk, cos, sin = ctx.saved_tensors
    return qk_norm_rotary_backward(qk, dq, dk, cos, sin), None, None


qk_norm_rotary.register_autograd(_qk_grad, setup_context=_qk_setup)


def mask_rule(q_idx: Tensor, kv_idx: Tensor, first: Tensor) -> Tensor:
    """The attention mask, the one definition: query q sees the keys from first[q] to itself, where first is
    first_visible()'s. The dense fallback applies it to every pair, the BlockMask's mask_mod to the pairs of
    partial blocks. One gather per query: on an H200 Flex's forward and backward ran 7-12% faster with it than
    with same-document written as docs[q] == docs[kv] (two gathers) and the window as a block difference
    (records/2026-12-04_speed5-h200/profiles/bench_flex_mask.txt)."""
    return (kv_idx <= q_idx) & (kv_idx >= first[q_idx])


def document_starts(idx: Tensor) -> Tensor:
    """Where each token's document begins: every document starts with <|endoftext|>, so the position of the
    latest one so far (0 before the first)."""
    pos = torch.arange(idx.numel(), device=idx.device)
    return torch.where(idx == BOS_ID, pos, 0).cummax(0).values


def first_visible(starts: Tensor, window_blocks: Tensor) -> Tensor:
    """The first key each query sees: the later of its document's start and the start of the earliest 128-token
    block in its sliding window (the query's block and the window_blocks - 1 blocks before it). Rises along the
    sequence, as starts do."""
    pos = torch.arange(starts.numel(), device=starts.device)
    return torch.maximum(starts, (pos // MASK_BLOCK - window_blocks + 1) * MASK_BLOCK)


def dense_attention_mask(first: Tensor) -> Tensor:
    """mask_rule for every (query, key) pair: a (T, T) bool matrix, for SDPA on CPU."""
    idx = torch.arange(first.numel(), device=first.device)
    return mask_rule(idx[:, None], idx[None, :], first)


def ordered_blocks(visible: Tensor) -> tuple[Tensor, Tensor]:
    """A BlockMask's layout of bool matrices of blocks (..., rows, cols): per row, how many are true, and the
    column indices with the true ones first, each part in ascending order. That stable partition comes from one
    matmul and a scatter, not from a stable argsort as torch's BlockMask helpers find it: compiled, an argsort
    becomes a Triton sort whose cold compile is pathologically slow (pytorch issue 182060; on an H200 it took
    the training graph's cold compile from 51 to 115 s). Not from cumsums and row sums either: fused with the
    block comparisons into reductions over 384 columns, those hit an inductor codegen error on torch 2.11
    ("list indices must be integers or slices, not NoneType"; fixed in later releases)."""
    v = visible.float()
    cols = torch.arange(v.size(-1), device=v.device)
    earlier = (cols[:, None] < cols[None, :]).float()  # earlier[k, j]: column k comes before column j
    true_before = (v @ earlier).to(torch.int32)  # exact: ones (even in TF32) summed in fp32, below 2^24
    counts = true_before[..., -1] + visible[..., -1]
    # a true block goes after the true ones before it; a false one after all true ones and the false before it
    slot = torch.where(visible, true_before, counts[..., None] + cols.to(torch.int32) - true_before)
    order = torch.zeros_like(true_before).scatter(-1, slot.long(), cols.to(torch.int32).expand_as(slot))
    return counts, order


def block_attention_mask(first: Tensor) -> BlockMask:
    """mask_rule as FlexAttention's BlockMask: per query block, the key blocks where every pair is visible (no
    mask_mod needed) and those where some are (mask_rule decides per pair); and per key block, the same query
    blocks (what backward walks). first rises along the sequence, so a block pair is decided by first at the
    query block's first and last tokens."""
    num_blocks = first.numel() // MASK_BLOCK
    blk = torch.arange(num_blocks, device=first.device)
    q_blk, k_blk = blk[:, None], blk[None, :]
    earliest, latest = first.view(num_blocks, MASK_BLOCK)[:, 0], first.view(num_blocks, MASK_BLOCK)[:, -1]
    # some pair visible: the key block is not after the query block, and its last token is not before the
    # earliest key any of the block's queries sees
    some_visible = (q_blk >= k_blk) & (earliest[:, None] <= k_blk * MASK_BLOCK + MASK_BLOCK - 1)
    # every pair: the key block lies wholly before the query block, and at or after the latest first key
    full = (q_blk > k_blk) & (latest[:, None] <= k_blk * MASK_BLOCK)
    some = some_visible & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_rule(q_idx, kv_idx, first)

    counts, order = ordered_blocks(torch.stack([some, full, some.mT, full.mT])[:, None, None])
    kv_n, full_kv_n, q_n, full_q_n = counts.unbind()
    kv_i, full_kv_i, q_i, full_q_i = order.unbind()
    return BlockMask(seq_lengths=(first.numel(), first.numel()), kv_num_blocks=kv_n, kv_indices=kv_i,
                     full_kv_num_blocks=full_kv_n, full_kv_indices=full_kv_i, q_num_blocks=q_n, q_indices=q_i,
                     full_q_num_blocks=full_q_n, full_q_indices=full_q_i, BLOCK_SIZE=(MASK_BLOCK, MASK_BLOCK),
                     mask_mod=mask_mod)


def attention_mask(starts: Tensor, window_blocks: Tensor):
    """The mask in the form attention() takes on this device, for documents starting at starts and a window of
    window_blocks: a BlockMask for FlexAttention on GPU; on CPU, where Flex has no backward, the dense matrix
    for SDPA. Built once per forward for each window size."""
    first = first_visible(starts, window_blocks)
    return block_attention_mask(first) if first.is_cuda else dense_attention_mask(first)


# FlexAttention's default Triton tiles at head_dim 128 need more shared memory per thread block in the backward
# than GPUs below the A100/H100 class have (sm_86, sm_89, sm_120: 99 KiB; A100: 163 KiB; H100/H200: 227 KiB),
# and compiling then fails with "out of resource: shared memory". Halved tiles in one pipeline stage fit 99 KiB
# (the tile sizes users report working on an RTX 3090; not yet run on such a GPU here).
FLEX_SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                    "num_stages": 1}
FLEX_DEFAULT_TILES_SMEM = 160 * 1024  # bytes of shared memory per block from which Flex's own tiles fit
# On an H200 at the training shape (49,152 tokens, the windows of step 100), 64x64 forward tiles in 3 stages of
# 4 warps took 0.438 ms per call against 0.489 for Flex's sm_90 default of 128x64 with 8 warps (inductor's own
# max-autotune picked them too); its backward default was the fastest of 13. In whole steps 21-45, where
# windows are short, the gain was within the noise (records/2026-12-03_speed3-h200)
FLEX_HOPPER_TILES = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4}
flex_kernel_options = None  # passed to every flex_attention call; build() sets it from --flex_tiles


def choose_flex_tiles(choice: str, smem_per_block: int, capability: tuple):
    """FlexAttention kernel options for --flex_tiles on a GPU with this much shared memory per block (opt-in)
    and this compute capability: None keeps Flex's defaults."""
    if choice == "small" or (choice == "auto" and smem_per_block < FLEX_DEFAULT_TILES_SMEM):
        return dict(FLEX_SMALL_TILES)
    return dict(FLEX_HOPPER_TILES) if choice == "auto" and tuple(capability) == (9, 0) else None


def attention(q: Tensor, k: Tensor, v: Tensor, mask, scale: float) -> Tensor:
    """Masked attention over (B, T, heads, head_dim), with a mask from attention_mask()."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, BlockMask):
        y = flex_attention(q, k, v, block_mask=mask, scale=scale, kernel_options=flex_kernel_options)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return y.transpose(1, 2)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for bf16 a and b: what a GPU's bf16 GEMM computes (bf16 inputs, fp32 sums, one rounding to bf16).
    CPUs without bf16 matrix units run bf16 GEMMs 7-35x slower than fp32 (on 2 AVX2 cores one step of a
    768-wide model took 4 minutes); there the same function runs as an fp32 matmul of the bf16 values."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        return (a.float() @ b.float()).bfloat16()
    return a @ b


NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz coefficients from Muon (Jordan et al., 2024)


def newton_schulz5(G: Tensor, steps: int = 5) -> Tensor:
    """Approximately orthogonalize G (the U V^T of its SVD) in bf16. The coefficients trade exactness for speed:
    singular values land in roughly [0.7, 1.2], which trains as well as exact orthogonalization."""
    a, b, c = NS_COEFFS
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation: X @ X.T is then the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = mm(X, X.mT)
        X = a * X + mm(b * A + c * mm(A, A), X)
    return X.mT if tall else X


def muon_update(grad: Tensor, momentum_buf: Tensor, momentum: float) -> Tensor:
    """Muon's update for one matrix: Nesterov momentum, orthogonalized, scaled so tall matrices (fan-out >
    fan-in) take proportionally larger steps."""
    momentum_buf.lerp_(grad, 1 - momentum)
    update = newton_schulz5(grad.lerp(momentum_buf, momentum))
    return update.to(grad.dtype) * max(1.0, grad.size(-2) / grad.size(-1)) ** 0.5


def adam_update(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, betas, eps: float) -> Tensor:
    """Bias-corrected Adam direction (no weight decay), in the dtype of its state (bf16 for the embeddings, as
    the record keeps them)."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.lerp_(grad.square(), 1 - betas[1])
    m_hat = exp_avg / (1 - betas[0] ** step)
    v_hat = exp_avg_sq / (1 - betas[1] ** step)
    return m_hat / (v_hat.sqrt() + eps)


# ----------------------------------------------------------------------------------------------------------
# Optimizer: sharded across ranks, communication overlapped with backward

class Comm:
    """The collectives the trainer needs; with one process they are copies."""

    class _Done:
        def wait(self):
            pass

    def __init__(self, rank: int, world: int, device=None):
        self.rank, self.world, self.device = rank, world, device

    def reduce_scatter(self, out: Tensor, inp: Tensor):
        if self.world == 1:
            out.copy_(inp)
            return self._Done()
        return dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, async_op=True)

    def all_gather(self, out: Tensor, inp: Tensor):
        if self.world == 1:
            out.copy_(inp)
            return self._Done()
        return dist.all_gather_into_tensor(out, inp, async_op=True)

    def all_ok(self, ok: bool) -> bool:
        """True if ok is true on every rank: how ranks agree to go on after a step that can fail on one of them
        (reading a checkpoint, writing one), instead of the others hanging in their next collective."""
        if self.world == 1:
            return ok
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


class Bucket:
    """Parameters whose gradients travel together: laid end to end in `flat` (fp32), zero-padded to `world`
    shards of `shard_numel`. Rank r reduces, updates and broadcasts shard r. A Muon bucket holds up to `world`
    matrices of one shape with shard = one matrix, so each rank orthogonalizes whole matrices. The optimizer
    state is in the parameters' dtype (bf16 for the embeddings, as the record keeps it); the grads of bf16
    parameters are summed in fp32 (`acc`) micro-step by micro-step, so the sum is the same at any world size."""

    def __init__(self, params: list, kind: str, lr: float, shard_numel: int, world: int):
        dtype, device = params[0].dtype, params[0].device
        assert all(p.dtype == dtype for p in params), "a bucket's parameters share one dtype"
        self.params, self.kind, self.lr = params, kind, lr
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(world * shard_numel, device=device)
        self.grad = torch.zeros(shard_numel, device=device)
        names = ["momentum"] if kind == "muon" else ["exp_avg", "exp_avg_sq"]
        self.state = {name: torch.zeros(shard_numel, device=device, dtype=dtype) for name in names}
        self.acc = torch.zeros(self.numel, device=device) if dtype != torch.float32 else None
        self.ready = 0      # params of this bucket whose grads are final
        self.work = None    # the collective in flight


class ShardedOptimizer:
    """Muon for hidden matrices, Adam for the rest, ZeRO-1 style: gradients are reduce-scattered so each rank
    updates only its shard, then the updated parameters are all-gathered. A bucket's reduce-scatter starts
    from a post-accumulate-grad hook as soon as its last gradient is final (during the last micro-step's
    backward), so communication overlaps the rest of backward; step() waits on the handles."""

    def __init__(self, muon_params: list, muon_lr: float, adam_groups: list, adam_betas, adam_eps: float,
                 comm: Comm):
        self.comm, self.betas, self.eps = comm, adam_betas, adam_eps
        self.steps = 0
        self.reduce_in_backward = False  # set by the loop for the last micro-step of a batch
        self.buckets = []
        # backward produces the last layers' grads first, so bucket them first
        by_shape = {}
        for p in reversed(muon_params):
            by_shape.setdefault(tuple(p.shape), []).append(p)
        for same in by_shape.values():
            # several ranks: one matrix per rank, so a bucket's reduce-scatter starts as soon as backward has
            # made `world` of them. One GPU has nothing to overlap: every matrix of the shape in one bucket,
            # orthogonalized as one batch (one by one, 46 matrices were ~2,500 small kernels per step)
            per_rank = len(same) if comm.world == 1 else 1
            for i in range(0, len(same), per_rank * comm.world):
                self.buckets.append(Bucket(same[i:i + per_rank * comm.world], "muon", muon_lr,
                                           per_rank * same[0].numel(), comm.world))
        for lr, params in adam_groups:
            numel = sum(p.numel() for p in params)
            self.buckets.append(Bucket(params, "adam", lr, math.ceil(numel / comm.world), comm.world))
        self.params = [p for b in self.buckets for p in b.params]  # fixed order, the same at any world size
        for b in self.buckets:
            offset = 0
            for p in b.params:
                p.register_post_accumulate_grad_hook(partial(self._grad_ready, b, offset))
                offset += p.numel()

    @torch.no_grad()
    def _grad_ready(self, bucket: Bucket, offset: int, param: Tensor):
        if bucket.acc is not None:  # fold this micro-step's bf16 grad into the fp32 sum
            add_into_fp32(bucket.acc[offset:offset + param.numel()], param.grad.reshape(-1))
            param.grad = None
        if self.reduce_in_backward:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._reduce(bucket)

    @torch.no_grad()
    def _reduce(self, b: Bucket):
        if b.acc is not None:
            b.flat[:b.numel].copy_(b.acc)
            b.acc.zero_()
        else:
            torch.cat([p.grad.reshape(-1) for p in b.params], out=b.flat[:b.numel])
        b.work = self.comm.reduce_scatter(b.grad, b.flat)

    def _shard_slice(self, b: Bucket) -> slice:
        n = b.grad.numel()
        return slice(self.comm.rank * n, (self.comm.rank + 1) * n)

    @property
    def launched(self) -> int:
        return sum(b.work is not None for b in self.buckets)

    @torch.no_grad()
    def step(self, lr_factor: float, muon_momentum: float):
        self.steps += 1
        rank = self.comm.rank
        for b in self.buckets:
            if b.work is None:
                self._reduce(b)
        for b in self.buckets:
            b.work.wait()
            torch.cat([p.reshape(-1) for p in b.params], out=b.flat[:b.numel])
            shard = b.flat[self._shard_slice(b)].clone()
            lr = b.lr * lr_factor
            if b.kind == "adam":
                grad = b.grad.to(b.state["exp_avg"].dtype)
                shard -= lr * adam_update(grad, b.state["exp_avg"], b.state["exp_avg_sq"], self.steps,
                                          self.betas, self.eps)
            else:  # this rank's matrices are the bucket's [rank * k, rank * k + k); those past its end are padding
                shape, k = b.params[0].shape, b.grad.numel() // b.params[0].numel()
                mine = min(k, len(b.params) - rank * k)
                if mine > 0:
                    update = muon_update(b.grad.view(k, *shape)[:mine], b.state["momentum"].view(k, *shape)[:mine],
                                         muon_momentum)
                    shard[:update.numel()] -= lr * update.reshape(-1)
            b.work = self.comm.all_gather(b.flat, shard)
        for b in self.buckets:
            b.work.wait()
            b.work, b.ready = None, 0
        news = [new.view_as(p) for b in self.buckets
                for new, p in zip(b.flat[:b.numel].split([p.numel() for p in b.params]), b.params)]
        torch._foreach_copy_(self.params, news)  # one launch for every parameter, not one each
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def all_finite(self) -> Tensor:
        """Whether every parameter is finite, as a device bool (no sync): a diverged run can keep a finite,
        soft-capped loss for steps after its weights overflowed."""
        return torch.stack([b.flat[:b.numel].isfinite().all() for b in self.buckets]).all()

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Full (unsharded) state per parameter, so a checkpoint resumes at any world size. Collective."""
        state = [{} for _ in self.params]
        i = 0
        for b in self.buckets:
            for name, shard in b.state.items():
                full = b.flat.new_empty(b.flat.shape, dtype=shard.dtype)
                self.comm.all_gather(full, shard).wait()
                for j, t in enumerate(full[:b.numel].split([p.numel() for p in b.params])):
                    state[i + j][name] = t.view_as(b.params[j]).cpu().clone()
            i += len(b.params)
        return {"steps": self.steps, "state": state}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        self.steps = sd["steps"]
        i = 0
        for b in self.buckets:
            for name, shard in b.state.items():
                full = b.flat.new_zeros(b.flat.shape, dtype=shard.dtype)
                full[:b.numel] = torch.cat([sd["state"][i + j][name].reshape(-1) for j in range(len(b.params))])
                shard.copy_(full[self._shard_slice(b)])
            i += len(b.params)


# ----------------------------------------------------------------------------------------------------------
# Model

def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def init_uniform(shape: tuple, fan_in: int) -> Tensor:
    """Uniform with std 0.5/sqrt(fan_in) (the speedrun's CastedLinear init)."""
    bound = 3**0.5 * 0.5 * fan_in**-0.5
    return torch.empty(shape).uniform_(-bound, bound)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x (B, T, heads, head_dim) with tables (>= T, head_dim/2): dims j and j + head_dim/2 of each head
    turned together by position t's angle theta[t, j], in fp32."""
    cos, sin = cos[None, :x.size(1), None, :], sin[None, :x.size(1), None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


class Rotary(nn.Module):
    """RoPE's tables: head_dim/4 frequencies from 1 down to 1/1024 radians per token, and head_dim/4 zero
    frequencies, so half the dims carry position and half do not. One instance serves every layer (the tables
    for a 262K-token val sequence are 134 MB)."""

    def __init__(self, head_dim: int, max_len: int):
        super().__init__()
        freqs = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4)
        freqs = torch.cat([freqs, freqs.new_zeros(head_dim // 4)])
        theta = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return rotary(x, self.cos, self.sin)


def norm_rotary_qk(qk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """QK-norm, then RoPE: qk (B, T, 2 heads, head_dim) holds q's heads, then k's. On GPU the qk_norm_rotary op
    computes the same function with its own kernels (tests/test_training.py checks them against this)."""
    if qk.is_cuda and triton is not None and qk.dtype == torch.bfloat16:
        return qk_norm_rotary(qk, cos[:qk.size(1)], sin[:qk.size(1)])
    q, k = qk.chunk(2, dim=2)
    return rotary(norm(q), cos, sin), rotary(norm(k), cos, sin)


class Attention(nn.Module):
    SCALE = 0.12     # softmax scale after QK-norm; the speedrun's tuned value (1/sqrt(128) would be 0.088)
    GATE_DIMS = 12   # the output gate reads the first 12 dims of the block's normed input (Aug 2025 record)

    def __init__(self, dim: int, num_heads: int, head_dim: int, rotary: Rotary, has_ve: bool):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        qkvo = torch.stack([init_uniform((dim, dim), dim) for _ in range(4)])
        qkvo[3].zero_()  # output projection starts at zero: each block starts as the identity
        self.qkvo_w = nn.Parameter(qkvo)
        # per head, sigmoid(gate_w @ x[:12]) scales the head's output; zero init: every gate starts at 0.5
        self.gate_w = nn.Parameter(torch.zeros(num_heads, self.GATE_DIMS))
        # v is scaled by v_lambdas[0]; layers with a value embedding add v_lambdas[1] * ve
        self.v_lambdas = nn.Parameter(torch.tensor([0.5, 0.5] if has_ve else [0.5]))
        self.rotary = rotary

    def forward(self, x: Tensor, ve, mask) -> Tensor:
        B, T = x.shape[:2]
        # q and k from one matmul, v from another: see qk_norm_rotary for why not one
        qk = mm(x, self.qkvo_w[:2].flatten(0, 1).type_as(x).mT).view(B, T, 2 * self.num_heads, self.head_dim)
        q, k = norm_rotary_qk(qk, self.rotary.cos, self.rotary.sin)
        v = mm(x, self.qkvo_w[2].type_as(x).mT).view(B, T, self.num_heads, self.head_dim)
        v = self.v_lambdas[0] * v
        if ve is not None:
            v = v + self.v_lambdas[1] * ve.view_as(v)
        y = attention(q, k, v, mask, self.SCALE)
        gate = torch.sigmoid(mm(x[..., :self.GATE_DIMS], self.gate_w.type_as(x).mT))  # (B, T, heads)
        y = (y * gate[..., None]).reshape(B, T, -1)
        return mm(y, self.qkvo_w[3].type_as(y).mT)


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        # both matrices are stored (dim, 4*dim), the up-projection applied transposed, so Muon's shape factor
        # max(1, rows/cols)^0.5 is 1 for both and every hidden matrix trains at the same lr (Aug 2025 record)
        self.fc_w = nn.Parameter(init_uniform((dim, 4 * dim), dim))
        self.proj_w = nn.Parameter(torch.zeros(dim, 4 * dim))

    def forward(self, x: Tensor) -> Tensor:
        return mm(F.relu(mm(x, self.fc_w.type_as(x))).square(), self.proj_w.type_as(x).mT)  # ReLU^2


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, rotary: Rotary, has_attn: bool, has_ve: bool,
                 long_window: bool):
        super().__init__()
        self.attn = Attention(dim, num_heads, head_dim, rotary, has_ve) if has_attn else None
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # input = l0 * residual + l1 * embedding
        self.long_window = long_window

    def forward(self, x: Tensor, x0: Tensor, ve, mask, skip=None) -> Tensor:
        """skip: (weight, an earlier layer's output) of a U-Net connection, added first. Added here rather than
        by the caller so that a block-by-block compile fuses it with the rest (eager, its multiply and add and
        their backward were ~30 full passes over the residual stream per micro-step)."""
        if skip is not None:
            x = x + skip[0] * skip[1]
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(norm(x), ve, mask)
        return x + self.mlp(norm(x))


def softcapped_logits(x: Tensor, head_w: Tensor) -> Tensor:
    """The bf16 head: logits of the normed x, soft-capped into (0, 30), in fp32."""
    return softcap(mm(norm(x).bfloat16(), head_w.bfloat16().mT))


def head_loss(x: Tensor, head_w: Tensor, targets: Tensor, fp8: bool) -> Tensor:
    """Summed cross-entropy of the soft-capped logits. The sum (not mean) keeps logit grads within +-1,
    the range HEAD_GRAD_SCALE assumes; both optimizers are invariant to the loss's scale."""
    x = x.flatten(0, -2)
    if fp8:
        x = norm(x).bfloat16()
        x_s = x.size(-1) ** 0.5 / E4M3_MAX
        x_f8 = to_fp8(x.detach(), x_s, torch.float8_e4m3fn)
        w_f8 = to_fp8(head_w.detach(), HEAD_W_SCALE, torch.float8_e4m3fn)
        return fp8_head_loss(x, head_w, x_f8, w_f8, targets, x_s, HEAD_W_SCALE, HEAD_GRAD_SCALE)[0]
    return F.cross_entropy(softcapped_logits(x, head_w), targets, reduction="sum")


EVAL_CHUNK = 16384  # tokens per head_loss call in eval: a 262K-token val sequence's logits would take 52 GB


class GPT(nn.Module):
    def __init__(self, cfg: "Hyperparameters"):
        super().__init__()
        L, dim = cfg.num_layers, cfg.model_dim
        self.fp8_head = cfg.fp8_head
        # token and value embeddings are bf16 parameters, their Adam state too (Aug 2025 record)
        self.embed = nn.Embedding(cfg.vocab_size, dim).bfloat16()
        # value embeddings: table i feeds layer i and layer L-n+i (the first and last n layers)
        self.num_ve = min(3, L // 2)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, dim).bfloat16() for _ in range(self.num_ve))
        self.ve_layers = [*range(self.num_ve), *range(L - self.num_ve, L)]
        rotary = Rotary(cfg.head_dim, max(cfg.seq_len, cfg.val_seq_len))
        self.blocks = nn.ModuleList(
            Block(dim, cfg.num_heads, cfg.head_dim, rotary, i not in cfg.no_attn_layers, i in self.ve_layers,
                  i in cfg.long_window_layers) for i in range(L))
        self.skip_weights = nn.Parameter(torch.ones(L // 2))  # U-Net: layer L-1-i reads layer i's output
        self.head_w = nn.Parameter(torch.zeros(cfg.vocab_size, dim))
        self.head_loss = head_loss

    def compile_regions(self, whole: bool, backend: str = "inductor"):
        """torch.compile the blocks and the head, either as one graph (whole) or block by block. One graph fuses
        the glue between blocks (x0 and value-embedding grads summed, embedding norm) and the building of the
        attention masks (eager, that was ~80 tiny kernels per micro-step), and suits one GPU. Block by block,
        backward finishes block by block, so the grads of late layers are final (and their reduce-scatter
        starts) while early layers are still running: what several GPUs need."""
        # each block instance, with and without grad, is its own compiled variant: lift dynamo's cap of 8
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        if whole:
            self.hidden = torch.compile(self.hidden, dynamic=False, backend=backend)
        else:
            for block in self.blocks:
                block.compile(dynamic=False, backend=backend)
        self.head_loss = torch.compile(head_loss, dynamic=False, backend=backend)

    def hidden(self, idx: Tensor, window_blocks: Tensor) -> Tensor:
        """idx: (T,) token ids of one sequence. Returns the last block's output, (1, T, dim)."""
        starts = document_starts(idx)
        # long-window layers see window_blocks blocks back, the others half as many (at least one)
        masks = {True: attention_mask(starts, window_blocks),
                 False: attention_mask(starts, torch.clamp(window_blocks // 2, min=1))}
        return self.run_blocks(idx, masks)

    def run_blocks(self, idx: Tensor, masks: dict) -> Tensor:
        L = len(self.blocks)
        ve = [e(idx)[None] for e in self.value_embeds]
        ve_of_layer = ve + [None] * (L - 2 * self.num_ve) + ve
        x = x0 = norm(self.embed(idx)[None])
        skips = []
        for i, block in enumerate(self.blocks):
            skip = (self.skip_weights[L - 1 - i], skips.pop()) if i >= L - L // 2 else None
            x = block(x, x0, ve_of_layer[i], masks[block.long_window], skip)
            if i < L // 2:
                skips.append(x)
        return x

    def forward(self, idx: Tensor, targets: Tensor, window_blocks: Tensor) -> Tensor:
        """idx, targets: (T,) token ids of one sequence. Returns the summed loss over its T tokens."""
        x = self.hidden(idx, window_blocks)
        targets = targets.long()
        if self.training:
            return self.head_loss(x, self.head_w, targets, self.fp8_head)
        # validation as the record measures it: the bf16 head, in chunks (same sum, a fraction of the memory)
        return sum(self.head_loss(xc, self.head_w, tc, False)
                   for xc, tc in zip(x.flatten(0, -2).split(EVAL_CHUNK), targets.split(EVAL_CHUNK)))


def param_groups(model: GPT, cfg: "Hyperparameters") -> tuple[list, list]:
    """Muon gets the hidden matrices; Adam, with the speedrun's per-group learning rates, the rest."""
    muon = [p for p in model.blocks.parameters() if p.ndim >= 2]
    embeds = [model.embed.weight, *[e.weight for e in model.value_embeds]]
    scalars = [p for p in model.parameters() if p.ndim < 2 and p.numel()]  # a 1-layer model has no skips
    adam = [(cfg.head_lr, [model.head_w]), (cfg.embed_lr, embeds), (cfg.scalar_lr, scalars)]
    assert len(muon) + sum(len(ps) for _, ps in adam) == len([p for p in model.parameters() if p.numel()])
    return muon, adam


# ----------------------------------------------------------------------------------------------------------
# Data: FineWeb-format shards

SHARD_MAGIC = 20240520   # first int32 of a FineWeb .bin shard (llm.c's format)
SHARD_VERSION = 1
HEADER_BYTES = 256 * 4   # 256 int32: magic, version, token count, then zeros; uint16 tokens follow
DATA_HINT = ("get FineWeb shards with `python data/cached_fineweb10B.py 9`, or make shards from your own text "
             "with `python data/tokenize_text.py`")


class ShardFormatError(UserError):
    pass


def read_header(path: str) -> int:
    """Checks a shard's header against its size; returns its token count."""
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise ShardFormatError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header. {DATA_HINT}")
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ShardFormatError(f"{path}: header starts {header[0]}, {header[1]}; a shard starts {SHARD_MAGIC}, "
                               f"{SHARD_VERSION}. Not a FineWeb-format shard. {DATA_HINT}")
    num_tokens = int(header[2])
    if size != HEADER_BYTES + 2 * num_tokens:
        raise ShardFormatError(f"{path}: header says {num_tokens:,} tokens ({HEADER_BYTES + 2 * num_tokens:,} "
                               f"bytes) but the file has {size:,} bytes: truncated or corrupt. {DATA_HINT}")
    return num_tokens


def is_shard(path) -> bool:
    """True if path exists and its header matches its size: how the data scripts skip finished shards."""
    try:
        read_header(str(path))
        return True
    except (OSError, ShardFormatError):
        return False


def load_shard(path: str) -> np.ndarray:
    """A shard's tokens, checked to be GPT-2 ids: a larger id would crash the step that reaches it, and every
    resume after it, with an IndexError that names no file."""
    tokens = np.fromfile(path, dtype="<u2", count=read_header(path), offset=HEADER_BYTES)
    if tokens.size and tokens.max() >= GPT2_VOCAB:
        pos = int(np.argmax(tokens >= GPT2_VOCAB))
        raise ShardFormatError(f"{path}: token {int(tokens[pos])} at position {pos:,} is not a GPT-2 id (< "
                               f"{GPT2_VOCAB}). Check all shards with `python data/check.py FILES`; {DATA_HINT}")
    return tokens


def find_shards(pattern: str, flag: str = "--train_files") -> list:
    """The files the glob matches, sorted, each a readable shard: fail before training, not an hour into it."""
    if os.path.isdir(pattern):
        raise ShardFormatError(f"{flag} {pattern!r} is a folder: pass a glob of its shards, e.g. "
                               f"'{os.path.join(pattern, '*.bin')}'")
    files = sorted(glob.glob(pattern))
    if not files:
        raise ShardFormatError(f"no shards match {pattern!r}: {DATA_HINT}")
    for f in files:
        if os.path.isdir(f):
            raise ShardFormatError(f"{flag} {pattern!r} matches the folder {f}: make the glob match only shards")
        if not os.path.exists(f):  # glob lists a broken symbolic link
            raise ShardFormatError(f"{f} is a link to {os.readlink(f)!r}, which does not exist: fix or remove it")
        read_header(f)
    return files


FINGERPRINT_BYTES = 2**20


def shard_fingerprint(path: str) -> list:
    """[name, bytes, hash of the first and last MiB]: what a checkpoint records of each shard it read, so that a
    resume notices other data under the same glob without reading whole shards."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
        digest.update(f.read())
    return [os.path.basename(path), size, digest.hexdigest()[:16]]


def data_changes(flag: str, pattern: str, then: list, now: list) -> str:
    """How the shards a checkpoint read (`then`, shard_fingerprint lists) differ from the ones the glob matches
    now; empty if they are the same."""
    if len(then) != len(now):
        gone = sorted({n for n, *_ in then} - {n for n, *_ in now})
        return (f"{flag} {pattern!r} matches {len(now)} shards, and {len(then)} when the checkpoint was written"
                + (f" (missing now: {', '.join(gone[:5])})" if gone else ""))
    for (name, size, digest), (name_now, size_now, digest_now) in zip(then, now):
        if name != name_now:
            return f"{flag} matched {name} at this place when the checkpoint was written, {name_now} now"
        if (size, digest) != (size_now, digest_now):
            what = f"{size:,} bytes then, {size_now:,} now" if size != size_now else "the same size, other content"
            return f"shard {name} ({flag}) is not the one the checkpoint read: {what}"
    return ""


class TrainLoader:
    """Each step takes `batch_seqs` sequences of seq_len+1 tokens, each starting at a BOS token, walking the
    shards in order (cycling). Rank r keeps sequences r, r+W, ... (one per micro-step), so a step sees the
    same tokens at any world size."""

    def __init__(self, pattern: str, seq_len: int, batch_seqs: int, rank: int, world: int):
        self.files = find_shards(pattern)
        self.seq_len, self.batch_seqs, self.rank, self.world = seq_len, batch_seqs, rank, world
        self.load_state({"shard": 0, "pos": 0})
        self._next_start()  # shards without a single document start fail here, before the log is created
        if self.shard:
            self.load_state({"shard": 0, "pos": 0})

    def load_state(self, state: dict):
        if not 0 <= state["shard"] < len(self.files):
            raise UserError(f"the checkpoint's data position is shard {state['shard']}, but --train_files matches "
                            f"{len(self.files)} shards: resume with the shards the run trained on")
        self.shard, self.pos = state["shard"], state["pos"]
        self.tokens = load_shard(self.files[self.shard])
        self.bos = np.flatnonzero(self.tokens == BOS_ID)

    def state(self) -> dict:
        return {"shard": self.shard, "pos": self.pos}

    def _next_start(self) -> int:
        for _ in range(len(self.files) + 1):
            i = np.searchsorted(self.bos, self.pos)
            if i < len(self.bos) and self.bos[i] + self.seq_len + 1 <= len(self.tokens):
                return int(self.bos[i])
            self.load_state({"shard": (self.shard + 1) % len(self.files), "pos": 0})
        raise ShardFormatError(f"no shard of {self.files[0]}... holds a BOS ({BOS_ID}) followed by "
                               f"{self.seq_len} tokens: documents must start with <|endoftext|>. {DATA_HINT}")

    def next_batch(self) -> list:
        seqs = []
        for i in range(self.batch_seqs):
            start = self._next_start()
            if i % self.world == self.rank:
                seqs.append(torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int32)))
            self.pos = start + self.seq_len
        return seqs


def val_files_read(pattern: str, num_tokens: int) -> list:
    """The val shards that hold the first num_tokens (+1, the last target) val tokens, from their headers."""
    files, have = [], 0
    for f in find_shards(pattern, "--val_files"):
        files.append(f)
        have += read_header(f)
        if have >= num_tokens + 1:
            return files
    raise ShardFormatError(f"val shards {pattern!r} hold {have:,} tokens; --val_tokens asks for {num_tokens:,} "
                           f"(+1 for the last target). Lower --val_tokens or add val data.")


def load_val_tokens(pattern: str, num_tokens: int) -> Tensor:
    """The first num_tokens (+1, the last target) tokens of the val shards, in order."""
    tokens, have = [], 0
    for f in val_files_read(pattern, num_tokens):
        tokens.append(load_shard(f)[:num_tokens + 1 - have])
        have += len(tokens[-1])
    return torch.from_numpy(np.concatenate(tokens).astype(np.int32))


# ----------------------------------------------------------------------------------------------------------
# Hyperparameters

def H(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Hyperparameters:
    # data
    train_files: str = H("data/fineweb10B/fineweb_train_*.bin", "glob of training shards")
    val_files: str = H("data/fineweb10B/fineweb_val_*.bin", "glob of validation shards")
    val_tokens: int = H(10_485_760, "the first this many val tokens are scored, in whole --val_seq_len sequences "
                                    "(record: 10,485,760 = 40 x 262,144)")
    val_seq_len: int = H(4 * 64 * 1024, "tokens per val sequence, a multiple of 128 (record: 262,144)")
    seq_len: int = H(48 * 1024, "tokens per GPU per micro-step, a multiple of 128 (record: 48K)")
    batch_seqs: int = H(8, "sequences per optimizer step over all GPUs; 8 x 48K = 393,216 tokens (record)")
    # schedule
    num_steps: int = H(1695, "optimizer steps (record of Aug 2025)")
    cooldown_frac: float = H(0.45, "last fraction of steps over which lr falls linearly to 0.1x")
    max_window: int = H(1792, "sliding-window tokens at the end; it grows from 128 in 128-token blocks (record)")
    val_every: int = H(125, "steps between validations; 0 = only at the end")
    target_val_loss: float = H(3.28, "the speedrun's target (GPT-2 small's FineWeb loss in llm.c); the log notes "
                                     "the first val at or below it")
    stop_at_target: bool = H(False, "stop at the first val <= target_val_loss. Off by default: logs that stop "
                                    "there sit below the target by construction and bias a record's mean")
    # model (shrink these for smoke runs)
    vocab_size: int = H(50304, "GPT-2's 50257 tokens padded to a multiple of 128 for fast matmuls")
    num_layers: int = H(12, "transformer blocks")
    model_dim: int = H(768, "residual width")
    num_heads: int = H(6, "attention heads; num_heads * head_dim must equal model_dim")
    head_dim: int = H(128, "dims per head")
    long_window_layers: tuple = H((0, 4, 7, 11), "layers with the full window; the others get half (record)")
    no_attn_layers: tuple = H((7,), "layers without attention, MLP only (record: layer 7)")
    fp8_head: bool = H(True, "lm_head matmuls in FP8 while training (e4m3 forward, e5m2 grads); bf16 in eval")
    flex_tiles: str = H("auto", "FlexAttention's Triton tiles: default, small (fits GPUs with 99 KiB shared memory "
                                "per block, e.g. RTX 3090/4090), or auto: small below 160 KiB, "
                                "a faster forward tile on H100/H200")
    # optimizer (Aug 2025 record)
    muon_lr: float = H(0.05, "Muon lr for hidden matrices")
    head_lr: float = H(0.008, "Adam lr for lm_head")
    embed_lr: float = H(0.6, "Adam lr for token and value embeddings")
    scalar_lr: float = H(0.04, "Adam lr for the scalar gates and lambdas")
    adam_beta1: float = H(0.8, "Adam beta1")
    adam_beta2: float = H(0.95, "Adam beta2")
    adam_eps: float = H(1e-10, "Adam epsilon; tiny so the update does not depend on the loss scale")
    momentum_warmup_steps: int = H(300, "Muon momentum rises linearly from 0.85 to 0.95 over these steps")
    # run
    seed: int = H(0, "seed for the parameter init")
    device: str = H("cuda", "cuda, or cpu for tests and tiny smoke runs")
    compile: bool = H(True, "torch.compile the model and the head (CUDA only)")
    compile_scope: str = H("auto", "what one compiled graph holds: model (the attention masks and all blocks; "
                                   "2% faster per step on one H200 than blocks, measured before the masks joined "
                                   "it), blocks (one graph per block, so grads reduce during backward: for "
                                   "several GPUs, not yet measured there), or auto: model on one GPU, blocks on more")
    warmup_steps: int = H(10, "untimed steps run first to compile, then undone (state restored)")
    log_dir: str = H("logs", "where <run_id>.txt and checkpoints go")
    run_id: str = H("", "log file name; default: a fresh uuid")
    save_every: int = H(0, "save a checkpoint every this many steps and at the end; 0 = never")
    keep_last: int = H(2, "after each save, delete this run's older checkpoints but the newest this many; 0 = keep all")
    resume: str = H("", "checkpoint to continue from, with identical data order, schedule and optimizer state")
    profile_steps: tuple = H((), "A,B: profile train steps A..B (CUDA) into <log_dir>/<run_id>_profile.txt: GPU "
                                 "time per kernel category and the top kernels")


# settings that may differ between a checkpoint and the run resuming it: none of them changes the training
RESUME_FREE = ("log_dir", "run_id", "val_every", "save_every", "keep_last", "warmup_steps", "resume",
               "target_val_loss", "stop_at_target", "profile_steps", "flex_tiles")
# and these may change on resume too, logged: lower rates are how a diverged run continues from a checkpoint
RESUME_ADJUSTABLE = ("muon_lr", "head_lr", "embed_lr", "scalar_lr")
RUN_ID_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a plain file name; 200 leaves room for _step...


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage of 40 flags
        self.exit(2, f"error: {message} (`python train_gpt.py --help` lists every flag)\n")


def parse_bool(s: str) -> bool:
    value = {"1": True, "true": True, "0": False, "false": False}.get(s.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected 1, 0, true or false, not {s!r}")
    return value


def parse_layers(s: str) -> tuple:
    try:
        return tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, not {s!r}") from None


def parse_args(argv=None) -> Hyperparameters:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Hyperparameters):
        kind = {bool: parse_bool, tuple: parse_layers}.get(type(f.default), type(f.default))
        shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f"{f.metadata['help']} (default: {shown})")
    return Hyperparameters(**vars(parser.parse_args(argv)))


def hyperparameters_from(saved: dict) -> Hyperparameters:
    """The Hyperparameters of a config saved as JSON (a checkpoint's, a log's config line): lists back to
    tuples, keys this version does not know left out."""
    known = {f.name for f in dataclasses.fields(Hyperparameters)}
    return Hyperparameters(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known})


def check_config(cfg: Hyperparameters):
    """Refuse settings that cannot train, before anything is built."""
    for name in ["num_steps", "seq_len", "val_seq_len", "batch_seqs", "val_tokens", "momentum_warmup_steps",
                 "num_layers", "model_dim", "num_heads", "head_dim", "max_window"]:
        if getattr(cfg, name) <= 0:
            raise UserError(f"--{name} must be positive (it is {getattr(cfg, name)})")
    for name in ["val_every", "save_every", "keep_last", "warmup_steps"]:
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} must be 0 or more (it is {getattr(cfg, name)})")
    for name in ["seq_len", "val_seq_len", "max_window"]:
        if getattr(cfg, name) % MASK_BLOCK:
            raise UserError(f"--{name} {getattr(cfg, name)} must be a multiple of {MASK_BLOCK}")
    if cfg.num_heads * cfg.head_dim != cfg.model_dim:
        raise UserError(f"--num_heads {cfg.num_heads} x --head_dim {cfg.head_dim} = {cfg.num_heads * cfg.head_dim}, "
                        f"but --model_dim is {cfg.model_dim}: they must be equal")
    if cfg.head_dim % 4 or cfg.model_dim < Attention.GATE_DIMS:
        raise UserError(f"--head_dim must be a multiple of 4 and --model_dim at least {Attention.GATE_DIMS}")
    if cfg.vocab_size < GPT2_VOCAB:
        raise UserError(f"--vocab_size {cfg.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    if cfg.val_tokens < cfg.val_seq_len:
        raise UserError(f"--val_tokens {cfg.val_tokens} is less than one val sequence (--val_seq_len {cfg.val_seq_len})")
    bad = [i for i in (*cfg.long_window_layers, *cfg.no_attn_layers) if not 0 <= i < cfg.num_layers]
    if bad:
        raise UserError(f"layers {bad} in --long_window_layers/--no_attn_layers do not exist (0..{cfg.num_layers - 1})")
    if cfg.profile_steps and not (len(cfg.profile_steps) == 2 and 0 <= cfg.profile_steps[0] <= cfg.profile_steps[1]):
        raise UserError(f"--profile_steps takes two steps A,B with A <= B (it is {cfg.profile_steps})")
    for name in RESUME_ADJUSTABLE:  # the learning rates
        if not 0 <= getattr(cfg, name) < math.inf:
            raise UserError(f"--{name} must be a finite number, 0 or more (it is {getattr(cfg, name)})")
    for name in ["adam_beta1", "adam_beta2"]:
        if not 0 <= getattr(cfg, name) < 1:
            raise UserError(f"--{name} must be at least 0 and below 1 (it is {getattr(cfg, name)})")
    if not 0 < cfg.adam_eps < math.inf:
        raise UserError(f"--adam_eps must be a finite number above 0 (it is {cfg.adam_eps})")
    if cfg.device not in ("cuda", "cpu"):
        raise UserError(f"--device must be cuda or cpu (it is {cfg.device!r})")
    if cfg.run_id and not RUN_ID_CHARS.fullmatch(cfg.run_id):
        raise UserError(f"--run_id {cfg.run_id[:60]!r}{'...' if len(cfg.run_id) > 60 else ''} is not a plain file "
                        f"name: use letters, digits, '.', '_' and '-', at most 200 (it names the log and checkpoints)")
    if cfg.compile_scope not in ("auto", "model", "blocks"):
        raise UserError(f"--compile_scope must be auto, model or blocks (it is {cfg.compile_scope!r})")
    if cfg.flex_tiles not in ("auto", "default", "small"):
        raise UserError(f"--flex_tiles must be auto, default or small (it is {cfg.flex_tiles!r})")
    if not 0 <= cfg.cooldown_frac <= 1:
        raise UserError(f"--cooldown_frac must be within 0..1 (it is {cfg.cooldown_frac})")


def lr_factor(step: int, cfg: Hyperparameters) -> float:
    """1 until the cooldown, then linear down to 0.1 at the last step."""
    progress = step / cfg.num_steps
    if progress < 1 - cfg.cooldown_frac:
        return 1.0
    w = (1 - progress) / cfg.cooldown_frac
    return w + (1 - w) * 0.1


def muon_momentum(step: int, cfg: Hyperparameters) -> float:
    """0.85 rising linearly to 0.95 over the first momentum_warmup_steps steps."""
    return 0.85 + 0.10 * min(step / cfg.momentum_warmup_steps, 1.0)


def window_blocks(step: int, cfg: Hyperparameters) -> int:
    """Sliding window in 128-token blocks: the record's (max_window - 64) * step/num_steps tokens rounded up to a
    whole block, at least one. For 1792 that is ceil(13.5 * step/N): 1 block at the start, 14 in the last 1/27."""
    tokens_x_steps = (cfg.max_window - MASK_BLOCK // 2) * step
    return max(1, -(-tokens_x_steps // (MASK_BLOCK * cfg.num_steps)))  # exact integer ceil


# ----------------------------------------------------------------------------------------------------------
# Logs and checkpoints

def log_line(**fields) -> str:
    """The one log format: `key:value` pairs, read back by regex (records/tool.py)."""
    return " ".join(f"{k}:{v}" for k, v in fields.items())


SOURCE_END = "=" * 100  # the line that ends the copy of this script at the top of every log


def start_log(path: Path, script: str) -> Path:
    """A log starts with the script's source and the environment, each closed by SOURCE_END. The header is
    written to a file of its own and linked into place, which fails if the log exists: a disk too full for the
    header leaves no empty log behind, and of two launches with one run_id only one gets the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    header = f"{Path(script).read_text()}\n{SOURCE_END}\n{environment()}\n{SOURCE_END}\n"
    try:
        tmp.write_text(header)
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            with open(path, "x") as f:  # a file system without hard links: exclusive, if not atomic
                f.write(header)
    except FileExistsError:
        raise UserError(f"{path} exists: another launch with this --run_id took it first; pass another "
                        f"--run_id") from None
    except OSError as e:
        raise UserError(f"cannot write the log {path} ({e.strerror or e}): free disk space or pick another "
                        f"--log_dir") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def environment() -> str:
    lines = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"numpy {np.__version__}",
             f"cuda {torch.version.cuda}"]
    try:
        import triton
        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton not installed")
    try:
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.TimeoutExpired):
        lines.append("nvidia-smi: not available")
    return "\n".join(lines)


def source_sha256() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def config_diff(saved: dict, now: dict) -> dict:
    """Settings that differ between a checkpoint's config and this run's: {name: (saved, now)}."""
    saved, now = (json.loads(json.dumps(c)) for c in (saved, now))  # tuples and lists compare alike
    return {k: (saved.get(k), now.get(k)) for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)}


def write_durably(obj, path: Path):
    """torch.save to a .tmp file of this writer's own, fsync, rename over path, fsync the folder: after a crash
    or power loss the checkpoint is either complete or absent, never half-written, and an older one is never
    touched."""
    tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# what a checkpoint holds, with each value's type; "run_id" and "data" (shard fingerprints) since 2026-12-03
CHECKPOINT_KEYS = {"model": dict, "optimizer": dict, "loader": dict, "step": int, "train_ms": (int, float),
                   "config": dict, "source_sha256": str}


def checkpoint_problem(ckpt) -> str:
    """Why an unpickled object is not a checkpoint train_gpt.py can use, or ''."""
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS.keys() <= ckpt.keys():
        return "not a checkpoint written by train_gpt.py"
    wrong = [f"{k} is a {type(ckpt[k]).__name__}" for k, kind in CHECKPOINT_KEYS.items()
             if not isinstance(ckpt[k], kind)]
    if not wrong and not (isinstance(ckpt["loader"].get("shard"), int) and isinstance(ckpt["loader"].get("pos"), int)):
        wrong = ["its loader position is not two integers"]
    return f"not a checkpoint written by train_gpt.py ({'; '.join(wrong)})" if wrong else ""


def checkpoint_files(folder: Path, run_id: str) -> dict:
    """{step: path} of this run's checkpoints in folder, matched by exact name (a run_id is not a pattern)."""
    name = re.compile(re.escape(run_id) + r"_step(\d{6})\.pt")
    return {int(m.group(1)): folder / f for f in os.listdir(folder) if (m := name.fullmatch(f))}


def is_own_tmp(name: str, run_id: str) -> bool:
    """A .tmp file left by a checkpoint write of this run_id that a crash interrupted."""
    return re.fullmatch(re.escape(run_id) + r"_step\d{6}(\.[0-9a-f]{8})?\.tmp", name) is not None


# ----------------------------------------------------------------------------------------------------------
# The training steps: each takes the Trainer that build() sets up

class Stopwatch:
    """Training time in ms; stopped while validating and checkpointing. Synchronizes the GPU at each start and
    stop, so queued work is counted where it runs."""

    def __init__(self, device: torch.device, ms: float = 0.0):
        self.device, self.ms, self.t0 = device, ms, None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start(self):
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self):
        self._sync()
        self.ms += (time.perf_counter() - self.t0) * 1000
        self.t0 = None

    def elapsed_ms(self) -> float:
        return self.ms + (0.0 if self.t0 is None else (time.perf_counter() - self.t0) * 1000)


@dataclass
class Trainer:
    cfg: Hyperparameters
    comm: Comm
    device: torch.device
    model: GPT
    opt: ShardedOptimizer
    train_loader: TrainLoader
    val_tokens: Tensor
    run_id: str
    log_path: Path
    clock: Stopwatch
    step: int = 0                 # optimizer steps done
    last_checkpoint: str = ""     # the newest complete checkpoint of this run
    reached_target: bool = False
    log_open: bool = False
    windows: dict = field(default_factory=dict)
    profiler: object = None
    fingerprints: dict = None     # of the shards this run reads, once a checkpoint needs them

    def data(self) -> dict:
        """Fingerprints of the train shards and of the val shards that val_tokens reaches."""
        if self.fingerprints is None:
            cfg = self.cfg
            self.fingerprints = {"train": [shard_fingerprint(f) for f in self.train_loader.files],
                                 "val": [shard_fingerprint(f) for f in
                                         val_files_read(cfg.val_files, len(self.val_tokens) - 1)]}
        return self.fingerprints

    def log(self, line: str):
        if self.comm.rank == 0:
            print(line, flush=True)
            if self.log_open:
                with open(self.log_path, "a") as f:
                    f.write(line + "\n")

    def window(self, step: int) -> Tensor:
        """The step's window as a device tensor, one per size: a new value is new data, not a new graph."""
        blocks = window_blocks(step, self.cfg)
        if blocks not in self.windows:
            self.windows[blocks] = torch.tensor(blocks, dtype=torch.int32, device=self.device)
        return self.windows[blocks]


def setup(cfg: Hyperparameters):
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.batch_seqs % world:
        counts = ", ".join(str(n) for n in range(1, cfg.batch_seqs + 1) if cfg.batch_seqs % n == 0)
        raise UserError(f"{world} processes cannot split a batch of {cfg.batch_seqs} sequences evenly; launch "
                        f"with --nproc_per_node (x nodes) in {counts}, the divisors of --batch_seqs")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("no CUDA GPU is visible. train_gpt.py needs one per process; for a tiny CPU smoke run "
                            "pass --device cpu and a small model (README.md, 'CPU smoke run')")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(cfg.device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return rank, world, device


def read_checkpoint(cfg: Hyperparameters, comm: Comm) -> dict:
    """The checkpoint --resume names, read by every rank (weights only: a checkpoint never runs code), all of
    them succeeding; its settings must equal this run's but for RESUME_FREE and RESUME_ADJUSTABLE."""
    path, ckpt, problem = cfg.resume, None, ""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        problem = checkpoint_problem(ckpt)
    except FileNotFoundError:
        problem = "no such file"
    except Exception as e:  # truncated zip, foreign pickle, a pickled object that is not plain data
        problem = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'unreadable'}"
    if not comm.all_ok(not problem):
        raise UserError(f"cannot read checkpoint {path}: {problem or 'another rank could not read it'}. Pass a "
                        f"complete checkpoint of train_gpt.py, at a path every rank can read (with several "
                        f"nodes: a shared file system, or a copy at the same path on each node)")
    unknown = sorted(ckpt["config"].keys() - {f.name for f in dataclasses.fields(Hyperparameters)})
    if unknown:
        raise UserError(f"checkpoint {path} was written by another version of train_gpt.py, with settings this one "
                        f"does not know: {', '.join(unknown)}. Resume it with the version that wrote it (its source "
                        f"sha256 starts {ckpt['source_sha256'][:16]}; its log holds that source)")
    diff = {k: v for k, v in config_diff(ckpt["config"], dataclasses.asdict(cfg)).items()
            if k not in RESUME_FREE + RESUME_ADJUSTABLE}
    if diff:
        listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in diff.items())
        raise UserError(f"checkpoint {path} belongs to another run: {listed}. Resume with its settings (only "
                        f"{', '.join(RESUME_FREE + RESUME_ADJUSTABLE)} may change)")
    if ckpt["step"] >= cfg.num_steps:
        raise UserError(f"checkpoint {path} is at step {ckpt['step']}, the run's last (--num_steps "
                        f"{cfg.num_steps}): there is nothing left to train")
    return ckpt


def log_owner(log_path: Path):
    """(run_id, config) from a log's config line, or None if it has none."""
    for line in log_path.read_text(errors="replace").split(f"\n{SOURCE_END}\n")[-1].splitlines():
        if m := re.match(r"config:(\S+) .*\brun_id:(\S+)", line):
            return m.group(2), json.loads(m.group(1))
    return None


def check_log_dir(cfg: Hyperparameters, log_path: Path, comm: Comm, ckpt):
    """Rank 0 writes the log: refuse a folder it cannot write, a log that exists (logs are only appended: a new
    run must not overwrite an old one's), and, on resume, a log that belongs to another run."""
    problem = ""
    if comm.rank == 0:
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path.parent / f".{log_path.stem}.probe", "w"):
                pass
            (log_path.parent / f".{log_path.stem}.probe").unlink()
        except OSError as e:
            problem = f"cannot write to --log_dir {cfg.log_dir!r} ({e.strerror or e}); pick a writable folder"
        if not problem and log_path.exists() and not cfg.resume:
            problem = (f"{log_path} exists: pass another --run_id, or --resume one of its checkpoints to "
                       f"continue it")
        elif not problem and log_path.exists():
            problem = resume_log_problem(log_path, ckpt, cfg.resume)
    if not comm.all_ok(not problem):
        raise UserError(problem or "rank 0 cannot write the log")


def resume_log_problem(log_path: Path, ckpt: dict, ckpt_path: str) -> str:
    """Why a resumed run must not append to this existing log (it is another run's), or ''."""
    owner = log_owner(log_path)
    if owner is None:
        return f"{log_path} has no config line, so it is no run's log to continue: pass another --run_id"
    run_id, config = owner
    if "run_id" in ckpt:
        same = ckpt["run_id"] == run_id
    else:  # checkpoints before 2026-12-03 do not name their run: compare the settings that define it
        same = not {k for k in config_diff(config, ckpt["config"]) if k not in RESUME_FREE + RESUME_ADJUSTABLE}
    return "" if same else (f"{log_path} is the log of run {run_id}, and {ckpt_path} is a checkpoint of another "
                            f"run: pass --run_id {ckpt.get('run_id', '<its run id>')} to append to its log, or a "
                            f"new --run_id for a log of its own")


def restore(t: Trainer, ckpt: dict):
    """Continue from a checkpoint read by read_checkpoint: the same data, then every state."""
    cfg = t.cfg
    if "data" in ckpt:
        now = t.data()
        change = (data_changes("--train_files", cfg.train_files, ckpt["data"]["train"], now["train"])
                  or data_changes("--val_files", cfg.val_files, ckpt["data"]["val"], now["val"]))
        if change:
            raise UserError(f"{change}. Checkpoint {cfg.resume} continues only on the data it was trained on")
    try:
        t.model.load_state_dict(ckpt["model"])
        t.opt.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, KeyError, IndexError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {cfg.resume} does not fit this model: {str(e).strip().splitlines()[0]}") from None
    t.train_loader.load_state(ckpt["loader"])
    t.step, t.clock.ms, t.last_checkpoint = ckpt["step"], ckpt["train_ms"], cfg.resume


def open_log(t: Trainer, ckpt):
    """A new log starts with the source, environment and config; a resumed run appends a resumed_from line (to
    its own log, or after the config line of a new one)."""
    cfg = t.cfg
    new, problem = False, ""
    if t.comm.rank == 0:
        print(f"log: {t.log_path}", flush=True)
        if ckpt is None or not t.log_path.exists():  # a fresh run's log must not exist, even if one appeared
            try:                                     # since check_log_dir looked: another launch's
                start_log(t.log_path, __file__)
                new = True
            except UserError as e:
                problem = str(e)
        for stale in os.listdir(t.log_path.parent):  # a checkpoint write that a crash interrupted
            if is_own_tmp(stale, t.run_id):
                (t.log_path.parent / stale).unlink()
    if not t.comm.all_ok(not problem):
        raise UserError(problem or "rank 0 could not create the log")
    t.log_open = True
    if new or ckpt is None:
        t.log(log_line(config=json.dumps(dataclasses.asdict(cfg), separators=(",", ":")),
                       world_size=t.comm.world, run_id=t.run_id))
    if ckpt is None:
        return
    changed = {k: new for k, (_, new) in config_diff(ckpt["config"], dataclasses.asdict(cfg)).items()}
    t.log(log_line(resumed_from=cfg.resume, step=t.step, world_size=t.comm.world,
                   changed=json.dumps(changed, separators=(",", ":"))))
    rates = {k: changed[k] for k in RESUME_ADJUSTABLE if k in changed}
    if rates:
        t.log(log_line(note="resumed_with_changed_learning_rates", **{k: f"{ckpt['config'][k]}->{v}"
                                                                     for k, v in rates.items()}))
    source = source_sha256()
    if ckpt["source_sha256"] != source:
        t.log(log_line(warning="resumed_with_changed_source", checkpoint_sha256=ckpt["source_sha256"][:16],
                       source_sha256=source[:16]))


def build(cfg: Hyperparameters) -> Trainer:
    """Everything that can fail on the user's input, before the log is created: flags, launch, checkpoint, log
    folder, data."""
    check_config(cfg)
    rank, world, device = setup(cfg)
    comm = Comm(rank, world, device)
    notes = []
    if cfg.fp8_head and device.type == "cuda" and not has_fp8_tensor_cores(torch.cuda.get_device_capability(device)):
        cfg = dataclasses.replace(cfg, fp8_head=False)  # emulated FP8 would be slower than bf16
        notes.append(log_line(note="fp8_head_off", why=f"{torch.cuda.get_device_name(device).replace(' ', '_')}"
                                   f"_has_no_FP8_tensor_cores"))
    if device.type == "cuda":
        global flex_kernel_options
        smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        flex_kernel_options = choose_flex_tiles(cfg.flex_tiles, smem, torch.cuda.get_device_capability(device))
        if flex_kernel_options == FLEX_SMALL_TILES and cfg.flex_tiles == "auto":
            notes.append(log_line(note="flex_small_tiles", why=f"{smem // 1024}KiB_shared_memory_per_block"))
    ckpt = read_checkpoint(cfg, comm) if cfg.resume else None
    # a resumed run keeps its run_id, and so its log, unless told otherwise
    run_id = cfg.run_id or (ckpt or {}).get("run_id") or str(uuid.uuid4())
    log_path = Path(cfg.log_dir) / f"{run_id}.txt"
    check_log_dir(cfg, log_path, comm, ckpt)
    train_loader = TrainLoader(cfg.train_files, cfg.seq_len, cfg.batch_seqs, rank, world)
    val_tokens = load_val_tokens(cfg.val_files, cfg.val_tokens // cfg.val_seq_len * cfg.val_seq_len)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg).to(device)
    muon_params, adam_groups = param_groups(model, cfg)
    opt = ShardedOptimizer(muon_params, cfg.muon_lr, adam_groups, (cfg.adam_beta1, cfg.adam_beta2),
                           cfg.adam_eps, comm)
    t = Trainer(cfg, comm, device, model, opt, train_loader, val_tokens, run_id, log_path, Stopwatch(device))
    if ckpt is not None:
        restore(t, ckpt)
    if cfg.compile and device.type == "cuda":
        model.compile_regions(whole=cfg.compile_scope == "model" or (cfg.compile_scope == "auto" and world == 1))
    open_log(t, ckpt)
    for note in notes:
        t.log(note)
    return t


def diverged(t: Trainer, what: str) -> UserError:
    """The error that stops a diverged run: what went wrong and where, and the checkpoint to go back to."""
    return UserError(f"{what}: the run diverged. Newest good checkpoint: {t.last_checkpoint or 'none'}. Resume from "
                     f"it with lower learning rates (--{', --'.join(RESUME_ADJUSTABLE)} may change on resume), or "
                     f"start again with lower ones")


LEARNING_BY_STEP = 10  # a run whose train loss is no better (by 0.01) than a uniform guess by this step stops


def train_step(t: Trainer, step: int) -> float:
    """One optimizer step over batch_seqs sequences (this rank's share, one per micro-step); returns the mean
    train loss. Stops the run at the first non-finite loss or parameter, and at a loss that is still no better
    than guessing uniformly after LEARNING_BY_STEP steps: weights blown up by a huge learning rate can keep a
    finite, soft-capped loss forever (the recipe's runs are below that loss from step 2)."""
    cfg = t.cfg
    window = t.window(step)
    loss = torch.zeros((), device=t.device)
    seqs = t.train_loader.next_batch()
    for i, seq in enumerate(seqs):
        seq = seq.to(t.device, non_blocking=True)
        t.opt.reduce_in_backward = i == len(seqs) - 1  # the last micro-step's grads are final: reduce them now
        micro_loss = t.model(seq[:-1], seq[1:], window)
        micro_loss.backward()
        loss += micro_loss.detach()
    t.opt.step(lr_factor(step, cfg), muon_momentum(step, cfg))
    stats = torch.stack([loss, t.opt.all_finite().float()])
    if t.comm.world > 1:
        dist.all_reduce(stats)
    loss_sum, finite = stats.tolist()  # the step's one host sync
    train_loss, t.step = loss_sum / (cfg.batch_seqs * cfg.seq_len), step + 1
    if not math.isfinite(train_loss) or finite < t.comm.world:
        what = "the parameters" if math.isfinite(train_loss) else f"the train loss ({train_loss})"
        raise diverged(t, f"{what} became non-finite at step {t.step}")
    uniform = math.log(cfg.vocab_size)
    if t.step >= LEARNING_BY_STEP and train_loss > uniform - 0.01:
        raise diverged(t, f"the train loss at step {t.step}, {train_loss:.4f}, is no better than guessing uniformly "
                          f"among {cfg.vocab_size:,} tokens (ln {cfg.vocab_size} = {uniform:.4f})")
    return train_loss


def log_train(t: Trainer, train_loss: float):
    ms, n = t.clock.elapsed_ms(), t.cfg.num_steps
    t.log(log_line(step=f"{t.step}/{n}", train_loss=f"{train_loss:.4f}", train_time=f"{ms:.0f}ms",
                   step_avg=f"{ms / t.step:.2f}ms", eta=f"{ms / t.step * (n - t.step) / 1000:.0f}s"))


@torch.no_grad()
def validate(t: Trainer, step: int) -> bool:
    """Mean loss over the first val_tokens val tokens, in val_seq_len sequences split over the ranks, with the
    bf16 head, as the record measures it. Logs it; returns whether it is at or below the target."""
    cfg = t.cfg
    t.clock.stop()
    t.model.eval()
    total = torch.zeros(2, device=t.device)
    for i in range(t.comm.rank, len(t.val_tokens) // cfg.val_seq_len, t.comm.world):
        seq = t.val_tokens[i * cfg.val_seq_len:(i + 1) * cfg.val_seq_len + 1].to(t.device)
        total[0] += t.model(seq[:-1], seq[1:], t.window(step))
        total[1] += cfg.val_seq_len
    if t.comm.world > 1:
        dist.all_reduce(total)
    t.model.train()
    val_loss = (total[0] / total[1]).item()
    t.log(log_line(step=f"{step}/{cfg.num_steps}", val_loss=f"{val_loss:.4f}", train_time=f"{t.clock.ms:.0f}ms",
                   step_avg=f"{t.clock.ms / max(step, 1):.2f}ms"))
    if not math.isfinite(val_loss):
        raise diverged(t, f"val loss is {val_loss} at step {step}")
    reached = val_loss <= cfg.target_val_loss
    if reached and not t.reached_target:
        t.reached_target = True
        t.log(log_line(reached_target=cfg.target_val_loss, at_step=step, train_time=f"{t.clock.ms:.0f}ms"))
    t.clock.start()
    return reached


def save_checkpoint(t: Trainer):
    """A checkpoint of everything a bitwise-identical continuation needs. Collective: every rank builds the
    unsharded optimizer state, rank 0 writes it, and all stop together if the write fails."""
    cfg = t.cfg
    t.clock.stop()
    if not all(torch.isfinite(p).all() for p in t.model.parameters()):
        raise diverged(t, f"non-finite parameters at step {t.step}, so no checkpoint was written")
    ckpt = {"model": t.model.state_dict(), "optimizer": t.opt.state_dict(), "loader": t.train_loader.state(),
            "step": t.step, "train_ms": t.clock.ms, "config": dataclasses.asdict(cfg),
            "source_sha256": source_sha256(), "run_id": t.run_id, "data": t.data()}
    path = Path(cfg.log_dir) / f"{t.run_id}_step{t.step:06d}.pt"
    problem = ""
    if t.comm.rank == 0:
        try:
            write_durably(ckpt, path)
        except OSError as e:
            problem = e.strerror or str(e)
        except RuntimeError as e:  # torch.save's zip writer turns a failed write into "unexpected pos ..."
            free = shutil.disk_usage(path.parent).free
            problem = f"torch.save: {str(e).strip().splitlines()[0][:120]}; {free / 2**20:,.0f} MiB free on that disk"
    if not t.comm.all_ok(not problem):
        raise UserError(f"could not write checkpoint {path} ({problem or 'rank 0 failed'}); the newest complete "
                        f"one, {t.last_checkpoint or 'none'}, is intact. Free disk space or point --log_dir elsewhere")
    t.last_checkpoint = str(path)
    t.log(log_line(checkpoint=path))
    if t.comm.rank == 0 and cfg.keep_last:
        saved = checkpoint_files(path.parent, t.run_id)
        for step in sorted(saved)[:-cfg.keep_last]:
            if saved[step] != path:
                saved[step].unlink()
    t.clock.start()


# GPU kernels by name, first match wins: where a step's time goes (--profile_steps). cuBLAS names its FP8
# GEMMs nvjet_sm90_q*; torch's copy kernels (float8_copy_kernel_cuda, ...) are copies, not FP8 GEMMs.
KERNEL_CATEGORIES = [("copies and fills", r"[Mm]emcpy|[Mm]emset|copy_kernel|[Ff]ill"),
                     ("softcap CE + fp8 transposes", r"_softcap_ce|_transpose_bytes"),
                     ("QK-norm + rotary", r"_qk_norm_rotary"),
                     ("FlexAttention", r"flex|triton_tem"),
                     ("FP8 GEMM", r"nvjet_sm90_q|e4m3|e5m2"), ("bf16 GEMM", r"gemm|xmma|cutlass|nvjet|cublas"),
                     ("NCCL", r"nccl"), ("Triton fused (compiled)", r"triton"), ("other", r"")]


def kernel_category(kernel: str) -> str:
    return next(name for name, rule in KERNEL_CATEGORIES if re.search(rule, kernel))


@contextlib.contextmanager
def profiled(t: Trainer, step: int):
    """Under --profile_steps A,B: torch.profiler from train step A through B, then a table of GPU time per
    kernel category and the 25 costliest kernels, per step, in <log_dir>/<run_id>_profile.txt."""
    first, last = t.cfg.profile_steps or (-1, -1)
    if step == first and t.device.type == "cuda":
        t.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        t.profiler.__enter__()
        t.profiler.clock_ms = t.clock.elapsed_ms()  # the clock synchronized when it last started
    yield
    if step == last and t.profiler is not None:
        t.clock.stop()  # summarizing takes seconds: not training time
        t.profiler.__exit__(None, None, None)
        steps = last - first + 1
        wall = (t.clock.ms - t.profiler.clock_ms) / steps
        kernels = [(e.key, e.self_device_time_total / 1000 / steps) for e in t.profiler.key_averages()
                   if e.self_device_time_total > 0]
        busy = sum(ms for _, ms in kernels)
        by_category = {name: 0.0 for name, _ in KERNEL_CATEGORIES}
        for key, ms in kernels:
            by_category[kernel_category(key)] += ms
        lines = [f"GPU time per train step, steps {first}..{last} (rank {t.comm.rank}): {busy:.1f} ms of kernels in "
                 f"{wall:.1f} ms of training time per step ({busy / wall:.0%} busy; the profiler itself slows the "
                 f"host); step_avg so far {t.clock.ms / max(t.step, 1):.1f} ms"]
        lines += [f"{name:<26} {ms:9.2f} ms" for name, ms in by_category.items()]
        lines += ["", "costliest kernels (ms per step):"]
        lines += [f"{ms:9.2f}  {key[:150]}" for key, ms in sorted(kernels, key=lambda k: -k[1])[:25]]
        if t.comm.rank == 0:
            path = Path(t.cfg.log_dir) / f"{t.run_id}_profile.txt"
            path.write_text("\n".join(lines) + "\n")
            t.log(log_line(profile=path))
        t.profiler = None
        t.clock.start()


def warm_up(t: Trainer):
    """Compile and autotune on real batches, then put everything back: the timed run starts clean."""
    cfg = t.cfg
    if not cfg.warmup_steps:
        return
    saved = copy.deepcopy((t.model.state_dict(), [b.state for b in t.opt.buckets], t.opt.steps,
                           t.train_loader.state(), t.step))
    start = time.perf_counter()
    for i in range(cfg.warmup_steps):
        train_step(t, min(saved[4] + i, cfg.num_steps - 1))
        t.log(log_line(warmup_step=f"{i + 1}/{cfg.warmup_steps}", time=f"{time.perf_counter() - start:.0f}s"))
    t.model.load_state_dict(saved[0])
    for b, state in zip(t.opt.buckets, saved[1]):
        b.state = state
    t.opt.steps, t.step = saved[2], saved[4]
    t.train_loader.load_state(saved[3])
    t.log(log_line(warmup_steps=cfg.warmup_steps, warmup_time=f"{(time.perf_counter() - start) * 1000:.0f}ms"))


# ----------------------------------------------------------------------------------------------------------
# Sampling from a checkpoint: python train_gpt.py --generate CKPT --prompt "..."

def gpt2_encoding():
    """GPT-2's BPE from the ranks shipped in data/, through data/tokenize_text.py (needs tiktoken)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tokenize_text", Path(__file__).parent / "data" / "tokenize_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpt2_encoding()


@torch.no_grad()
def sample(model: GPT, prompt: list, max_new_tokens: int, window: Tensor, temperature: float, top_k: int,
           gen: torch.Generator) -> list:
    """Continue the token list `prompt` (which starts with <|endoftext|>) one token at a time. No KV cache: each
    token runs the whole sequence, padded to whole 128-token blocks (padding after the last token is causally
    invisible to it)."""
    tokens = list(prompt)
    device = window.device
    for _ in range(max_new_tokens):
        n = len(tokens)
        idx = torch.tensor(tokens + [0] * (-n % MASK_BLOCK), dtype=torch.int32, device=device)
        logits = softcapped_logits(model.hidden(idx, window)[0, n - 1], model.head_w)[:GPT2_VOCAB]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            top = torch.topk(logits / temperature, min(top_k, GPT2_VOCAB) if top_k > 0 else GPT2_VOCAB)
            nxt = int(top.indices[torch.multinomial(top.values.softmax(-1).cpu(), 1, generator=gen)])
        tokens.append(nxt)
    return tokens


def generate(argv) -> str:
    parser = _Parser(description="Continue a prompt with a model trained by train_gpt.py.")
    parser.add_argument("--generate", required=True, metavar="CKPT", help="a checkpoint written by --save_every")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens to add (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = always the likeliest (default: 0.8)")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest; 0 = all (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"--device {args.device}: " + ("no CUDA GPU is visible; pass --device cpu"
                                                       if args.device == "cuda" else "must be cuda or cpu"))
    try:
        ckpt = torch.load(args.generate, map_location="cpu", weights_only=True)
        problem = checkpoint_problem(ckpt)
    except Exception as e:
        problem = type(e).__name__
    if problem:
        raise UserError(f"cannot read checkpoint {args.generate} ({problem}): pass one written by train_gpt.py "
                        f"--save_every")
    try:
        cfg = hyperparameters_from(ckpt["config"])
        check_config(dataclasses.replace(cfg, device=args.device))
    except (TypeError, UserError) as e:
        raise UserError(f"checkpoint {args.generate} holds settings this train_gpt.py cannot build a model from "
                        f"({str(e).splitlines()[0]})") from None
    enc = gpt2_encoding()
    prompt = [BOS_ID, *enc.encode_ordinary(args.prompt)]
    limit = max(cfg.seq_len, cfg.val_seq_len)
    if len(prompt) == 1:
        raise UserError("the prompt is empty: pass some text with --prompt")
    if len(prompt) + args.max_new_tokens > limit:
        raise UserError(f"the prompt ({len(prompt) - 1} tokens) plus --max_new_tokens {args.max_new_tokens} is "
                        f"longer than the {limit - 1} tokens this model has positions for: shorten one of them")
    if args.max_new_tokens < 1 or args.temperature < 0:
        raise UserError("--max_new_tokens must be positive and --temperature 0 or more")
    device = torch.device(args.device)
    model = GPT(cfg).to(device).eval()
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {args.generate}: its weights do not fit the model its settings describe "
                        f"({str(e).strip().splitlines()[0][:200]})") from None
    window = torch.tensor(window_blocks(cfg.num_steps, cfg), dtype=torch.int32, device=device)
    tokens = sample(model, prompt, args.max_new_tokens, window, args.temperature, args.top_k,
                    torch.Generator().manual_seed(args.seed))
    return enc.decode(tokens[1:])


# ----------------------------------------------------------------------------------------------------------
# main

def gpu_error_message(e: Exception, cfg: Hyperparameters):
    """One line for the GPU failures that a flag fixes, or None: any other error keeps its traceback."""
    if isinstance(e, torch.OutOfMemoryError):
        return (f"out of GPU memory with --seq_len {cfg.seq_len} --batch_seqs {cfg.batch_seqs}: keep the tokens per "
                f"step in shorter sequences, e.g. --seq_len {cfg.seq_len // 2} --batch_seqs {cfg.batch_seqs * 2} "
                f"(README: GPUs with less memory); in validation, a shorter --val_seq_len")
    if "out of resource" in str(e):  # Triton's OutOfResources, raised directly or inside a compile error
        if cfg.flex_tiles != "small":
            return "FlexAttention's kernels need more shared memory than this GPU has: run with --flex_tiles small"
        return ("FlexAttention's kernels need more shared memory than this GPU has, even with --flex_tiles small: "
                "try --head_dim 64 --num_heads 12, or a GPU of the A100/H100 class")
    return None


def main(argv=None):
    """Train (returns the log's path), or with --generate sample from a checkpoint (returns the text)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--generate" or a.startswith("--generate=") for a in argv):
        try:
            text = generate(argv)
        except UserError as e:
            raise SystemExit(f"error: {e}") from None
        print(text)
        return text
    cfg = parse_args(argv)
    t = None
    try:
        t = build(cfg)
        warm_up(t)
        t.clock.start()
        for step in range(t.step, cfg.num_steps + 1):
            last_step = step == cfg.num_steps
            if last_step or (cfg.val_every and step % cfg.val_every == 0):
                last_step |= validate(t, step) and cfg.stop_at_target
            if last_step:
                break
            with profiled(t, step):
                log_train(t, train_step(t, step))
            if cfg.save_every and t.step % cfg.save_every == 0 and t.step < cfg.num_steps:
                save_checkpoint(t)
        if cfg.save_every:
            save_checkpoint(t)
        if t.device.type == "cuda":
            t.log(log_line(peak_memory=f"{torch.cuda.max_memory_allocated() // 2**20}MiB",
                           reserved_memory=f"{torch.cuda.max_memory_reserved() // 2**20}MiB"))
        return t.log_path
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C: a checkpoint write it cut off left no file behind
            message = (f"interrupted at step {t.step if t else 0}; the newest complete checkpoint is "
                       f"{t.last_checkpoint if t and t.last_checkpoint else 'none'}")
        else:
            message = str(e) if isinstance(e, UserError) else gpu_error_message(e, cfg)
        if message is None:
            raise
        if t is not None and t.log_open and t.comm.rank == 0:
            with open(t.log_path, "a") as f:
                f.write(f"error: {message}\n")
        raise SystemExit(f"error: {message}" if int(os.environ.get("RANK", 0)) == 0 else 1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
