"""
train_gpt.py: train a GPT-2-small-class model on FineWeb .bin shards until val loss <= 3.28, as fast as possible.

    torchrun --standalone --nproc_per_node=8 train_gpt.py      # the record setup; 1, 2 or 4 GPUs give the same run
    python train_gpt.py --help                                 # every hyperparameter; any one can be overridden

The recipe is the NanoGPT speedrun's FlexAttention era (record of Aug 2025: 1695 steps x 393,216 tokens on
8xH100). Each run writes logs/<run_id>.txt, which starts with this file's source and the environment, so a
log is enough to re-run and diff it. Sections: ops (FP8 matmul, attention masks, Newton-Schulz), optimizer,
model, data, Hyperparameters, main().
"""

# ----------------------------------------------------------------------------------------------------------
# Imports

import argparse
import copy
import dataclasses
import glob
import json
import math
import os
import platform
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

# ----------------------------------------------------------------------------------------------------------
# Ops: FP8 matmul for the lm_head, attention masks, Newton-Schulz

BOS_ID = 50256       # <|endoftext|> in GPT-2's BPE; FineWeb shards put it before every document
MASK_BLOCK = 128     # FlexAttention's tile size; sliding windows are measured in whole blocks of it
E4M3_MAX = 448.0     # largest finite float8_e4m3fn
E5M2_MAX = 57344.0   # largest finite float8_e5m2
# lm_head weights up to +-24 stay in range: with zero init and Adam lr 0.22, each step moves a weight by up to
# 0.22, so 2^-9 (+-0.875, an older record's scale) overflows within 4 steps (seen on an H200: NaN at step 6).
HEAD_W_SCALE = 24 / 448      # the FlexAttention-era record's constant
HEAD_GRAD_SCALE = 1 / 448    # logit grads of a summed, soft-capped loss are within +-1: +-448 in e5m2 (record's)


def scaled_mm(a: Tensor, b: Tensor, scale_a: float, scale_b: float, out_dtype, fast_accum: bool) -> Tensor:
    """(a*scale_a) @ (b*scale_b) for fp8 a (row-major) and b (column-major). Uses the FP8 tensor cores of
    sm_89+ GPUs; elsewhere computes the same product of the same fp8 values in fp32."""
    if a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 9):
        sa = torch.tensor(scale_a, dtype=torch.float32, device=a.device)
        sb = torch.tensor(scale_b, dtype=torch.float32, device=a.device)
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def to_fp8(t: Tensor, scale: float, dtype) -> Tensor:
    """t / scale in fp8, saturating: torch's cast turns out-of-range values into NaN, not the largest value."""
    top = E4M3_MAX if dtype == torch.float8_e4m3fn else E5M2_MAX
    return t.div(scale).clamp(-top, top).to(dtype)


@torch.library.custom_op("train_gpt::fp8_mm", mutates_args=())
def fp8_mm(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w.T with both operands rounded to e4m3 after dividing by their scales; returns the fp8 copies too,
    so backward reuses them instead of saving the bf16/fp32 originals."""
    x_f8 = to_fp8(x, x_s, torch.float8_e4m3fn)
    w_f8 = to_fp8(w, w_s, torch.float8_e4m3fn)
    out = scaled_mm(x_f8, w_f8.T, x_s, w_s, torch.bfloat16, fast_accum=True)
    return out, x_f8, w_f8


@fp8_mm.register_fake
def _(x, w, x_s, w_s, grad_s):
    return (x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16),
            x.new_empty(x.shape, dtype=torch.float8_e4m3fn), w.new_empty(w.shape, dtype=torch.float8_e4m3fn))


@torch.library.custom_op("train_gpt::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(g_f8: Tensor, g_f8_t: Tensor, x_f8: Tensor, w_f8: Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[Tensor, Tensor]:
    """Grads of fp8_mm from the e5m2 output grad, given twice: row-major for grad_x and transposed for grad_w
    (FP8 matmuls take only K-contiguous operands, and K is the token dim for grad_w)."""
    grad_x = scaled_mm(g_f8, w_f8.T.contiguous().T, grad_s, w_s, torch.bfloat16, fast_accum=False)
    grad_w = scaled_mm(g_f8_t, x_f8.T.contiguous().T, grad_s, x_s, torch.float32, fast_accum=False)
    return grad_x, grad_w


@fp8_mm_backward.register_fake
def _(g_f8, g_f8_t, x_f8, w_f8, x_s, w_s, grad_s):
    return x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.float32)


def _fp8_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.scales = inputs[2:]


def _fp8_mm_grad(ctx, grad_out, *_):
    x_f8, w_f8 = ctx.saved_tensors
    # the e5m2 cast and the transpose of the (tokens x vocab) grad stay outside the op so that torch.compile
    # fuses them into the loss's backward kernel. Inside the op they were four eager kernels over the 48K x 50304
    # grad (~30 GB of traffic a micro-step) and made the FP8 head slower than bf16: on an H200, 913 ms/step vs
    # 773 (bf16 head) before, 768 after (records/2026-12-02_proxy-h200/)
    g_f8 = to_fp8(grad_out, ctx.scales[2], torch.float8_e5m2)
    grad_x, grad_w = fp8_mm_backward(g_f8, g_f8.T.contiguous(), x_f8, w_f8, *ctx.scales)
    return grad_x, grad_w, None, None, None


fp8_mm.register_autograd(_fp8_mm_grad, setup_context=_fp8_mm_setup)


def dense_attention_mask(docs: Tensor, window_blocks: Tensor) -> Tensor:
    """The mask's definition, token by token: causal, same document, and the key's block at most
    window_blocks - 1 blocks before the query's block."""
    q = torch.arange(docs.numel(), device=docs.device)[:, None]
    k = q.T
    return (q >= k) & (docs[q] == docs[k]) & (q // MASK_BLOCK - k // MASK_BLOCK < window_blocks)


def block_attention_mask(docs: Tensor, window_blocks: Tensor) -> BlockMask:
    """The same mask as dense_attention_mask, as FlexAttention's BlockMask: per query block, the key blocks
    that are fully visible (no mask_mod needed) and those that are partly visible (mask_mod decides)."""
    num_blocks = docs.numel() // MASK_BLOCK
    blk = torch.arange(num_blocks, device=docs.device)
    q_blk, k_blk = blk[:, None], blk[None, :]
    first, last = docs.view(num_blocks, MASK_BLOCK)[:, 0], docs.view(num_blocks, MASK_BLOCK)[:, -1]
    # doc ids rise along the sequence, so a block spans docs first..last
    in_window = (q_blk >= k_blk) & (q_blk - k_blk < window_blocks)
    docs_meet = (first[:, None] <= last[None, :]) & (last[:, None] >= first[None, :])
    one_doc = (first[:, None] == last[None, :]) & (last[:, None] == first[None, :])
    full = in_window & one_doc & (q_blk > k_blk)
    partial = in_window & docs_meet & ~full

    def sparse(visible):
        counts = visible.sum(-1, dtype=torch.int32)
        order = torch.argsort(visible.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None].contiguous(), order[None, None].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (docs[q_idx] == docs[kv_idx])
                & (q_idx // MASK_BLOCK - kv_idx // MASK_BLOCK < window_blocks))

    return BlockMask.from_kv_blocks(*sparse(partial), *sparse(full), BLOCK_SIZE=MASK_BLOCK, mask_mod=mask_mod)


def attention(q: Tensor, k: Tensor, v: Tensor, docs: Tensor, window_blocks: Tensor, scale: float) -> Tensor:
    """Masked attention over (B, T, heads, head_dim). FlexAttention on GPU; on CPU, where Flex has no backward,
    SDPA with the equal dense mask."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if q.is_cuda:
        y = flex_attention(q, k, v, block_mask=block_attention_mask(docs, window_blocks), scale=scale)
    else:
        mask = dense_attention_mask(docs, window_blocks)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return y.transpose(1, 2)


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
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def muon_update(grad: Tensor, momentum_buf: Tensor, momentum: float) -> Tensor:
    """Muon's update for one matrix: Nesterov momentum, orthogonalized, scaled so tall matrices (fan-out >
    fan-in) take proportionally larger steps."""
    momentum_buf.lerp_(grad, 1 - momentum)
    update = newton_schulz5(grad.lerp(momentum_buf, momentum))
    return update.to(grad.dtype) * max(1.0, grad.size(-2) / grad.size(-1)) ** 0.5


def adam_update(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, betas, eps: float) -> Tensor:
    """Bias-corrected Adam direction (no weight decay)."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.lerp_(grad.square(), 1 - betas[1])
    m_hat = exp_avg / (1 - betas[0] ** step)
    v_hat = exp_avg_sq / (1 - betas[1] ** step)
    return m_hat / (v_hat.sqrt() + eps)


# ----------------------------------------------------------------------------------------------------------
# Optimizer: sharded across ranks, communication overlapped with backward

class Comm:
    """The two collectives the optimizer needs; with one process they are copies."""

    class _Done:
        def wait(self):
            pass

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

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


class Bucket:
    """Parameters whose gradients travel together: laid end to end in `flat`, zero-padded to `world` shards of
    `shard_numel`. Rank r reduces, updates and broadcasts shard r. A Muon bucket holds up to `world` matrices
    of one shape with shard = one matrix, so each rank orthogonalizes whole matrices."""

    def __init__(self, params: list, kind: str, lr: float, shard_numel: int, world: int):
        self.params, self.kind, self.lr = params, kind, lr
        self.numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(world * shard_numel, device=params[0].device)
        self.grad = torch.zeros(shard_numel, device=params[0].device)
        names = ["momentum"] if kind == "muon" else ["exp_avg", "exp_avg_sq"]
        self.state = {name: torch.zeros_like(self.grad) for name in names}
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
            for i in range(0, len(same), comm.world):
                self.buckets.append(Bucket(same[i:i + comm.world], "muon", muon_lr, same[0].numel(), comm.world))
        for lr, params in adam_groups:
            numel = sum(p.numel() for p in params)
            self.buckets.append(Bucket(params, "adam", lr, math.ceil(numel / comm.world), comm.world))
        self.params = [p for b in self.buckets for p in b.params]  # fixed order, the same at any world size
        for b in self.buckets:
            for p in b.params:
                p.register_post_accumulate_grad_hook(partial(self._grad_ready, b))

    def _grad_ready(self, bucket: Bucket, _param: Tensor):
        if self.reduce_in_backward:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._reduce(bucket)

    @torch.no_grad()
    def _reduce(self, b: Bucket):
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
                shard -= lr * adam_update(b.grad, b.state["exp_avg"], b.state["exp_avg_sq"], self.steps,
                                          self.betas, self.eps)
            elif rank < len(b.params):  # ranks past the end of a short Muon bucket hold only padding
                shape = b.params[rank].shape
                update = muon_update(b.grad.view(shape), b.state["momentum"].view(shape), muon_momentum)
                shard -= lr * update.reshape(-1)
            b.work = self.comm.all_gather(b.flat, shard)
        for b in self.buckets:
            b.work.wait()
            b.work, b.ready = None, 0
            for p, new in zip(b.params, b.flat[:b.numel].split([p.numel() for p in b.params])):
                p.copy_(new.view_as(p))
                p.grad = None

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Full (unsharded) state per parameter, so a checkpoint resumes at any world size. Collective."""
        state = [{} for _ in self.params]
        i = 0
        for b in self.buckets:
            for name, shard in b.state.items():
                full = torch.empty_like(b.flat)
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
                full = torch.zeros_like(b.flat)
                full[:b.numel] = torch.cat([sd["state"][i + j][name].reshape(-1) for j in range(len(b.params))])
                shard.copy_(full[self._shard_slice(b)])
            i += len(b.params)


# ----------------------------------------------------------------------------------------------------------
# Model

def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def init_linear(out_features: int, in_features: int) -> Tensor:
    """Uniform with std 0.5/sqrt(fan_in) (the speedrun's CastedLinear init)."""
    bound = 3**0.5 * 0.5 * in_features**-0.5
    return torch.empty(out_features, in_features).uniform_(-bound, bound)


class Rotary(nn.Module):
    """RoPE on half of each head's dims: head_dim/4 frequencies from 1 down to 1/1024 turns per token, and
    head_dim/4 zero frequencies, so half the dims carry position and half do not."""

    def __init__(self, head_dim: int, max_len: int):
        super().__init__()
        freqs = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4)
        freqs = torch.cat([freqs, freqs.new_zeros(head_dim // 4)])
        theta = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, heads, head_dim)
        cos, sin = self.cos[None, :x.size(1), None, :], self.sin[None, :x.size(1), None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    SCALE = 0.12  # softmax scale after QK-norm; the speedrun's tuned value (1/sqrt(128) would be 0.088)

    def __init__(self, dim: int, num_heads: int, head_dim: int, max_len: int, has_ve: bool):
        super().__init__()
        assert num_heads * head_dim == dim, "q, k, v and out projections share one (4, dim, dim) parameter"
        self.num_heads, self.head_dim = num_heads, head_dim
        qkvo = torch.stack([init_linear(dim, dim) for _ in range(4)])
        qkvo[3].zero_()  # output projection starts at zero: each block starts as the identity
        self.qkvo_w = nn.Parameter(qkvo)
        if has_ve:  # mix of v and the value embedding
            self.ve_lambdas = nn.Parameter(torch.tensor([0.5, 0.5]))
        self.rotary = Rotary(head_dim, max_len)

    def forward(self, x: Tensor, ve, docs: Tensor, window_blocks: Tensor) -> Tensor:
        B, T = x.shape[:2]
        qkv = F.linear(x, self.qkvo_w[:3].flatten(0, 1).type_as(x))
        q, k, v = qkv.view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=2)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))
        if ve is not None:
            v = self.ve_lambdas[0] * v + self.ve_lambdas[1] * ve.view_as(v)
        y = attention(q, k, v, docs, window_blocks, self.SCALE).reshape(B, T, -1)
        return F.linear(y, self.qkvo_w[3].type_as(y))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc_w = nn.Parameter(init_linear(4 * dim, dim))
        self.proj_w = nn.Parameter(torch.zeros(dim, 4 * dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.relu(F.linear(x, self.fc_w.type_as(x))).square(), self.proj_w.type_as(x))  # ReLU^2


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, max_len: int, has_attn: bool, has_ve: bool,
                 long_window: bool):
        super().__init__()
        self.attn = Attention(dim, num_heads, head_dim, max_len, has_ve) if has_attn else None
        self.mlp = MLP(dim)
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))  # input = l0 * residual + l1 * embedding
        self.long_window = long_window

    def forward(self, x: Tensor, x0: Tensor, ve, docs: Tensor, window_blocks: Tensor) -> Tensor:
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            window = window_blocks if self.long_window else torch.clamp(window_blocks // 2, min=1)
            x = x + self.attn(norm(x), ve, docs, window)
        return x + self.mlp(norm(x))


def head_loss(x: Tensor, head_w: Tensor, targets: Tensor, fp8: bool) -> Tensor:
    """Summed cross-entropy of the soft-capped logits. The sum (not mean) keeps logit grads within +-1,
    the range HEAD_GRAD_SCALE assumes; both optimizers are invariant to the loss's scale."""
    x = norm(x).flatten(0, -2).bfloat16()
    if fp8:
        logits = fp8_mm(x, head_w, x.size(-1) ** 0.5 / E4M3_MAX, HEAD_W_SCALE, HEAD_GRAD_SCALE)[0]
    else:
        logits = F.linear(x, head_w.bfloat16())
    # soft-cap into (0, 30). The FlexAttention-era record divides by 7.5*sqrt(dim): its head (lr 0.22, weights up
    # to 24) makes logits ~sqrt(dim) larger than the Jan 2025 head that /7.5 was tuned for; with /7.5 alone the
    # cap saturated on an H200 (loss 13 at step 2, 8.6 after 50 steps).
    logits = 30 * torch.sigmoid(logits.float() / (7.5 * x.size(-1) ** 0.5))
    return F.cross_entropy(logits, targets, reduction="sum")


class GPT(nn.Module):
    def __init__(self, cfg: "Hyperparameters"):
        super().__init__()
        L, dim = cfg.num_layers, cfg.model_dim
        self.fp8_head = cfg.fp8_head
        self.embed = nn.Embedding(cfg.vocab_size, dim)
        # value embeddings: table i feeds layer i and layer L-n+i (the first and last n layers)
        self.num_ve = min(3, L // 2)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, dim) for _ in range(self.num_ve))
        self.ve_layers = [*range(self.num_ve), *range(L - self.num_ve, L)]
        self.blocks = nn.ModuleList(
            Block(dim, cfg.num_heads, cfg.head_dim, cfg.seq_len, i not in cfg.no_attn_layers, i in self.ve_layers,
                  i in cfg.long_window_layers) for i in range(L))
        self.skip_weights = nn.Parameter(torch.ones(L // 2))  # U-Net: layer L-1-i reads layer i's output
        self.head_w = nn.Parameter(torch.zeros(cfg.vocab_size, dim))
        self.head_loss = head_loss

    def compile_regions(self):
        """Compile each block and the head on its own: backward then finishes block by block, so the grads
        of late layers are final (and their reduce-scatter starts) while early layers are still running."""
        # each block instance, with and without grad, is its own compiled variant: lift dynamo's cap of 8
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        for block in self.blocks:
            block.compile(dynamic=False)
        self.head_loss = torch.compile(head_loss, dynamic=False)

    def forward(self, idx: Tensor, targets: Tensor, window_blocks: Tensor) -> Tensor:
        """idx, targets: (T,) token ids of one sequence. Returns the summed loss over its T tokens."""
        L = len(self.blocks)
        docs = (idx == BOS_ID).cumsum(0)
        ve = [e(idx)[None].bfloat16() for e in self.value_embeds]
        ve_of_layer = ve + [None] * (L - 2 * self.num_ve) + ve
        x = x0 = norm(self.embed(idx)[None].bfloat16())
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= L - L // 2:
                x = x + self.skip_weights[L - 1 - i] * skips.pop()
            x = block(x, x0, ve_of_layer[i], docs, window_blocks)
            if i < L // 2:
                skips.append(x)
        return self.head_loss(x, self.head_w, targets.long(), self.fp8_head)


def param_groups(model: GPT, cfg: "Hyperparameters") -> tuple[list, list]:
    """Muon gets the hidden matrices; Adam, with the speedrun's per-group learning rates, the rest."""
    muon = [p for p in model.blocks.parameters() if p.ndim >= 2]
    embeds = [model.embed.weight, *[e.weight for e in model.value_embeds]]
    scalars = [p for p in model.parameters() if p.ndim < 2]
    adam = [(cfg.head_lr, [model.head_w]), (cfg.embed_lr, embeds), (cfg.scalar_lr, scalars)]
    assert len(muon) + sum(len(ps) for _, ps in adam) == len(list(model.parameters()))
    return muon, adam


# ----------------------------------------------------------------------------------------------------------
# Data: FineWeb-format shards

SHARD_MAGIC = 20240520   # first int32 of a FineWeb .bin shard (llm.c's format)
SHARD_VERSION = 1
HEADER_BYTES = 256 * 4   # 256 int32: magic, version, token count, then zeros; uint16 tokens follow
DATA_HINT = ("get FineWeb shards with `python data/cached_fineweb10B.py 9`, or make shards from your own text "
             "with `python data/tokenize_text.py`")


class ShardFormatError(ValueError):
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
    return np.fromfile(path, dtype="<u2", count=read_header(path), offset=HEADER_BYTES)


def find_shards(pattern: str) -> list:
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no shards match {pattern!r}: {DATA_HINT}")
    for f in files:
        read_header(f)  # fail before training, not an hour into it
    return files


class TrainLoader:
    """Each step takes `batch_seqs` sequences of seq_len+1 tokens, each starting at a BOS token, walking the
    shards in order (cycling). Rank r keeps sequences r, r+W, ... (one per micro-step), so a step sees the
    same tokens at any world size."""

    def __init__(self, pattern: str, seq_len: int, batch_seqs: int, rank: int, world: int):
        self.files = find_shards(pattern)
        self.seq_len, self.batch_seqs, self.rank, self.world = seq_len, batch_seqs, rank, world
        self.load_state({"shard": 0, "pos": 0})

    def load_state(self, state: dict):
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


def load_val_tokens(pattern: str, num_tokens: int) -> Tensor:
    tokens, have = [], 0
    for f in find_shards(pattern):
        tokens.append(load_shard(f)[:num_tokens + 1 - have])
        have += len(tokens[-1])
        if have == num_tokens + 1:
            return torch.from_numpy(np.concatenate(tokens).astype(np.int32))
    raise ShardFormatError(f"val shards {pattern!r} hold {have:,} tokens; --val_tokens asks for {num_tokens:,} "
                           f"(+1 for the last target). Lower --val_tokens or add val data.")


# ----------------------------------------------------------------------------------------------------------
# Hyperparameters

def H(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Hyperparameters:
    # data
    train_files: str = H("data/fineweb10B/fineweb_train_*.bin", "glob of training shards")
    val_files: str = H("data/fineweb10B/fineweb_val_*.bin", "glob of validation shards")
    val_tokens: int = H(10_485_760, "val tokens scored each time, rounded down to whole sequences (speedrun: 10M)")
    seq_len: int = H(48 * 1024, "tokens per GPU per micro-step, a multiple of 128 (speedrun: 48K)")
    batch_seqs: int = H(8, "sequences per optimizer step over all GPUs; 8 x 48K = 393,216 tokens (speedrun)")
    # schedule
    num_steps: int = H(1695, "optimizer steps (speedrun record of Aug 2025)")
    cooldown_frac: float = H(0.45, "last fraction of steps over which lr falls linearly to 0.1x")
    max_window: int = H(1792, "sliding-window tokens at the end; it grows linearly from 128 (speedrun)")
    val_every: int = H(125, "steps between validations; 0 = only at the end")
    target_val_loss: float = H(3.28, "stop as soon as val loss <= this (GPT-2 small's FineWeb loss in llm.c)")
    # model (shrink these for smoke runs)
    vocab_size: int = H(50304, "GPT-2's 50257 tokens padded to a multiple of 128 for fast matmuls")
    num_layers: int = H(12, "transformer blocks")
    model_dim: int = H(768, "residual width")
    num_heads: int = H(6, "attention heads; num_heads * head_dim must equal model_dim")
    head_dim: int = H(128, "dims per head")
    long_window_layers: tuple = H((0, 4, 7, 11), "layers with the full window; the others get half (speedrun)")
    no_attn_layers: tuple = H((7,), "layers without attention, MLP only (speedrun drops layer 7's)")
    fp8_head: bool = H(True, "lm_head matmuls in FP8 (e4m3 forward, e5m2 grads)")
    # optimizer (speedrun constants)
    muon_lr: float = H(0.05, "Muon lr for hidden matrices")
    head_lr: float = H(0.22, "Adam lr for lm_head")
    embed_lr: float = H(0.6, "Adam lr for token and value embeddings")
    scalar_lr: float = H(0.04, "Adam lr for the scalar gates")
    adam_beta1: float = H(0.8, "Adam beta1")
    adam_beta2: float = H(0.95, "Adam beta2")
    adam_eps: float = H(1e-10, "Adam epsilon; tiny so the update does not depend on the loss scale")
    momentum_warmup_steps: int = H(300, "Muon momentum rises linearly from 0.85 to 0.95 over these steps")
    # run
    seed: int = H(0, "seed for the parameter init")
    device: str = H("cuda", "cuda, or cpu for tests and tiny smoke runs")
    compile: bool = H(True, "torch.compile each block and the head (CUDA only)")
    warmup_steps: int = H(10, "untimed steps run first to compile, then undone (state restored)")
    log_dir: str = H("logs", "where <run_id>.txt and checkpoints go")
    run_id: str = H("", "log file name; default: a fresh uuid")
    save_every: int = H(0, "save a checkpoint every this many steps and at the end; 0 = never")
    resume: str = H("", "checkpoint to continue from, with identical data order, schedule and optimizer state")


def parse_args(argv=None) -> Hyperparameters:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Hyperparameters):
        if isinstance(f.default, bool):
            kind = lambda s: {"1": True, "true": True, "0": False, "false": False}[s.lower()]
        elif isinstance(f.default, tuple):
            kind = lambda s: tuple(int(v) for v in s.split(",") if v.strip())
        else:
            kind = type(f.default)
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=f"{f.metadata['help']} "
                            f"(default: {','.join(map(str, f.default)) if isinstance(f.default, tuple) else f.default})")
    return Hyperparameters(**vars(parser.parse_args(argv)))


def lr_factor(step: int, cfg: Hyperparameters) -> float:
    """1 until the cooldown, then linear down to 0.1 at the last step."""
    progress = step / cfg.num_steps
    if progress < 1 - cfg.cooldown_frac:
        return 1.0
    w = (1 - progress) / cfg.cooldown_frac
    return w + (1 - w) * 0.1


def window_blocks(step: int, cfg: Hyperparameters) -> int:
    """Sliding window in 128-token blocks, from 1 block at step 0 to max_window at the end."""
    top = cfg.max_window // MASK_BLOCK
    return round(1 + (top - 1) * min(step / cfg.num_steps, 1.0))


def log_line(**fields) -> str:
    """The one log format: `key:value` pairs, read back by regex (records/tool.py)."""
    return " ".join(f"{k}:{v}" for k, v in fields.items())


SOURCE_END = "=" * 100  # the line that ends the copy of this script at the top of every log


def start_log(path: Path, script: str) -> Path:
    """A log starts with the script's source and the environment, each closed by SOURCE_END."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{Path(script).read_text()}\n{SOURCE_END}\n{environment()}\n{SOURCE_END}\n")
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


# ----------------------------------------------------------------------------------------------------------
# main

def setup(cfg: Hyperparameters):
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.batch_seqs % world:
        sys.exit(f"error: {world} processes cannot split a batch of {cfg.batch_seqs} sequences evenly; "
                 f"launch with --nproc_per_node in 1, 2, 4, 8 (a divisor of --batch_seqs).")
    if cfg.seq_len % MASK_BLOCK:
        sys.exit(f"error: --seq_len {cfg.seq_len} must be a multiple of {MASK_BLOCK}.")
    if cfg.val_tokens < cfg.seq_len:
        sys.exit(f"error: --val_tokens {cfg.val_tokens} is less than one sequence (--seq_len {cfg.seq_len}).")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: no CUDA GPU is visible. train_gpt.py needs one per process; "
                     "for a tiny CPU smoke run pass --device cpu and a small model (see README).")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(cfg.device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return rank, world, device


def main(argv=None):
    cfg = parse_args(argv)
    rank, world, device = setup(cfg)
    comm, master = Comm(rank, world), rank == 0
    run_id = cfg.run_id or str(uuid.uuid4())
    log_path = Path(cfg.log_dir) / f"{run_id}.txt"
    if master:
        start_log(log_path, __file__)

    def log(line: str):
        if master:
            print(line, flush=True)
            with open(log_path, "a") as f:
                f.write(line + "\n")

    log(log_line(config=json.dumps(dataclasses.asdict(cfg), separators=(",", ":")), world_size=world, run_id=run_id))
    torch.manual_seed(cfg.seed)
    model = GPT(cfg).to(device)
    muon_params, adam_groups = param_groups(model, cfg)
    opt = ShardedOptimizer(muon_params, cfg.muon_lr, adam_groups, (cfg.adam_beta1, cfg.adam_beta2),
                           cfg.adam_eps, comm)
    if cfg.compile and device.type == "cuda":
        model.compile_regions()
    train_loader = TrainLoader(cfg.train_files, cfg.seq_len, cfg.batch_seqs, rank, world)
    num_val_seqs = cfg.val_tokens // cfg.seq_len
    val_tokens = load_val_tokens(cfg.val_files, num_val_seqs * cfg.seq_len)
    windows = {}  # window sizes as device tensors: a new value is new data, not a new graph

    def window(step: int) -> Tensor:
        blocks = window_blocks(step, cfg)
        if blocks not in windows:
            windows[blocks] = torch.tensor(blocks, dtype=torch.int32, device=device)
        return windows[blocks]

    def train_step(step: int) -> float:
        frac = min(step / cfg.momentum_warmup_steps, 1.0)
        seqs = train_loader.next_batch()
        loss = 0.0
        for i, seq in enumerate(seqs):
            seq = seq.to(device, non_blocking=True)
            opt.reduce_in_backward = i == len(seqs) - 1
            micro_loss = model(seq[:-1], seq[1:], window(step))
            micro_loss.backward()
            loss += micro_loss.detach()
        opt.step(lr_factor(step, cfg), 0.85 + 0.10 * frac)
        total = torch.stack([loss, torch.tensor(len(seqs) * cfg.seq_len, device=device, dtype=loss.dtype)])
        if world > 1:
            dist.all_reduce(total)
        return (total[0] / total[1]).item()

    @torch.no_grad()
    def validate(step: int) -> float:
        model.eval()
        total = torch.zeros(2, device=device)
        for i in range(rank, num_val_seqs, world):
            seq = val_tokens[i * cfg.seq_len:(i + 1) * cfg.seq_len + 1].to(device)
            total[0] += model(seq[:-1], seq[1:], window(step))
            total[1] += cfg.seq_len
        if world > 1:
            dist.all_reduce(total)
        model.train()
        return (total[0] / total[1]).item()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    start_step, train_ms = 0, 0.0
    if cfg.resume:
        ckpt = torch.load(cfg.resume, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        train_loader.load_state(ckpt["loader"])
        start_step, train_ms = ckpt["step"], ckpt["train_ms"]
        log(log_line(resumed_from=cfg.resume, step=start_step))

    if cfg.warmup_steps and start_step < cfg.num_steps:
        # compile and autotune on real batches, then put everything back: the timed run starts clean
        saved = copy.deepcopy((model.state_dict(), [b.state for b in opt.buckets], opt.steps, train_loader.state()))
        t0 = time.perf_counter()
        for i in range(cfg.warmup_steps):
            train_step(start_step + i)
        model.load_state_dict(saved[0])
        for b, state in zip(opt.buckets, saved[1]):
            b.state = state
        opt.steps = saved[2]
        train_loader.load_state(saved[3])
        sync()
        log(log_line(warmup_steps=cfg.warmup_steps, warmup_time=f"{(time.perf_counter() - t0) * 1000:.0f}ms"))

    def save_checkpoint(step: int):
        ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": train_loader.state(),
                "step": step, "train_ms": train_ms, "config": dataclasses.asdict(cfg)}
        if master:
            path = Path(cfg.log_dir) / f"{run_id}_step{step:06d}.pt"
            torch.save(ckpt, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)  # atomic: a crash never leaves a half-written checkpoint
            log(log_line(checkpoint=path))

    sync()
    t0 = time.perf_counter()
    for step in range(start_step, cfg.num_steps + 1):
        last_step = step == cfg.num_steps
        if last_step or (cfg.val_every and step % cfg.val_every == 0):
            sync()
            train_ms += (time.perf_counter() - t0) * 1000
            val_loss = validate(step)
            log(log_line(step=f"{step}/{cfg.num_steps}", val_loss=f"{val_loss:.4f}", train_time=f"{train_ms:.0f}ms",
                         step_avg=f"{train_ms / max(step - start_step, 1):.2f}ms"))
            if val_loss <= cfg.target_val_loss and not last_step:
                log(log_line(step=f"{step}/{cfg.num_steps}", reached_target=cfg.target_val_loss))
                last_step = True
            sync()
            t0 = time.perf_counter()
        if last_step:
            if cfg.save_every:
                save_checkpoint(step)
            break
        train_loss = train_step(step)
        now_ms = train_ms + (time.perf_counter() - t0) * 1000
        log(log_line(step=f"{step + 1}/{cfg.num_steps}", train_loss=f"{train_loss:.4f}",
                     train_time=f"{now_ms:.0f}ms", step_avg=f"{now_ms / (step + 1 - start_step):.2f}ms"))
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.num_steps:
            sync()
            train_ms += (time.perf_counter() - t0) * 1000
            save_checkpoint(step + 1)
            t0 = time.perf_counter()

    if device.type == "cuda":
        log(log_line(peak_memory=f"{torch.cuda.max_memory_allocated() // 2**20}MiB",
                     reserved_memory=f"{torch.cuda.max_memory_reserved() // 2**20}MiB"))
    if world > 1:
        dist.destroy_process_group()
    return log_path


if __name__ == "__main__":
    main()
