"""
records/baseline/train_gpt2.py: the "before" that every speedup of train_gpt.py is stated against.

GPT-2 small (124M) trained the classic way, as llm.c reproduces it: learned positions, GELU, LayerNorm, tied
embedding/lm_head, dense causal attention over 1024 tokens, AdamW (lr 6e-4, betas 0.9/0.95, wd 0.1) with
linear warm-up and cosine decay, 524,288-token batches, bf16 autocast, torch.compile. It reads the same shards
and scores the same val tokens as train_gpt.py, and logs in its format (source and environment first), so
records/tool.py reads both.

    python records/baseline/train_gpt2.py --train_files 'data/proxy/proxy_train_*.bin' \\
        --val_files 'data/proxy/proxy_val_*.bin' --val_tokens 1966080 --train_tokens 49000000
"""
import argparse
import json
import math
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from train_gpt import find_shards, load_shard, load_val_tokens, log_line, start_log  # noqa: E402

LLMC_WARMUP_FRAC = 700 / 19073  # llm.c's GPT-2 124M run: 700 warm-up steps of 19,073 (10B tokens)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.attn_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 50304, ctx: int = 1024, layers: int = 12, dim: int = 768, heads: int = 12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        for name, p in self.named_parameters():  # GPT-2's init: N(0, 0.02), residual projections / sqrt(2L)
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, round(LLMC_WARMUP_FRAC * steps))
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    p.add_argument("--train_files", default="data/fineweb10B/fineweb_train_*.bin")
    p.add_argument("--val_files", default="data/fineweb10B/fineweb_val_*.bin")
    p.add_argument("--val_tokens", type=int, default=10_485_760, help="rounded down to whole 1024-token rows")
    p.add_argument("--train_tokens", type=int, default=10_000_000_000, help="token budget (llm.c: 10B)")
    p.add_argument("--batch_tokens", type=int, default=524_288, help="tokens per step (llm.c: 2^19)")
    p.add_argument("--micro_batch", type=int, default=32, help="rows of 1024 tokens per forward")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--val_every", type=int, default=250)
    p.add_argument("--num_layers", type=int, default=12, help="GPT-2 small: 12; fewer only for smoke tests")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--log_dir", default="logs")
    p.add_argument("--run_id", default="")
    args = p.parse_args(argv)
    ctx, device = 1024, torch.device(args.device)
    steps = args.train_tokens // args.batch_tokens
    accum = args.batch_tokens // (args.micro_batch * ctx)
    run_id = args.run_id or str(uuid.uuid4())
    log_path = start_log(Path(args.log_dir) / f"{run_id}.txt", __file__)

    def amp():  # bf16 autocast on GPU; fp32 on CPU (tests only), where bf16 matmuls run 7-35x slower
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def log(line):
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    torch.manual_seed(0)
    model = GPT2(layers=args.num_layers).to(device)
    config = {**vars(args), "num_steps": steps, "tokens_per_step": args.batch_tokens, "seq_len": ctx,
              "num_layers": len(model.blocks), "model_dim": model.wte.embedding_dim,
              "vocab_size": model.wte.num_embeddings}
    log(log_line(config=json.dumps(config, separators=(",", ":")), world_size=1, run_id=run_id))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    fwd = torch.compile(model) if args.compile and device.type == "cuda" else model
    files, shard, pos = find_shards(args.train_files), 0, 0
    tokens = load_shard(files[0])
    num_val = args.val_tokens // ctx
    val = load_val_tokens(args.val_files, num_val * ctx).long()

    def next_rows():  # llm.c's loader: contiguous rows, no document alignment
        nonlocal shard, pos, tokens
        n = args.micro_batch * ctx
        if pos + n + 1 > len(tokens):
            shard, pos = (shard + 1) % len(files), 0
            tokens = load_shard(files[shard])
        chunk = torch.from_numpy(tokens[pos:pos + n + 1].astype("int64")).to(device)
        pos += n
        return chunk[:-1].view(-1, ctx), chunk[1:].view(-1, ctx)

    @torch.no_grad()
    def validate():
        model.eval()
        total = torch.zeros((), device=device)
        for i in range(0, num_val, args.micro_batch):
            rows = val[i * ctx:(i + args.micro_batch) * ctx + 1].to(device)
            n = (len(rows) - 1) // ctx
            with amp():
                total += fwd(rows[:n * ctx].view(n, ctx), rows[1:n * ctx + 1].view(n, ctx)) * n
        model.train()
        return (total / num_val).item()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # compile on one step, then restore the initial weights: the clock starts at a clean, compiled state
    t0 = time.perf_counter()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = next_rows()
    with amp():
        fwd(x, y).backward()
    validate()
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    shard, pos, tokens = 0, 0, load_shard(files[0])
    sync()
    log(log_line(warmup_steps=1, warmup_time=f"{(time.perf_counter() - t0) * 1000:.0f}ms"))

    train_ms, t0 = 0.0, time.perf_counter()
    for step in range(steps + 1):
        if step == steps or step % args.val_every == 0:
            sync()
            train_ms += (time.perf_counter() - t0) * 1000
            log(log_line(step=f"{step}/{steps}", val_loss=f"{validate():.4f}", train_time=f"{train_ms:.0f}ms",
                         step_avg=f"{train_ms / max(step, 1):.2f}ms"))
            sync()
            t0 = time.perf_counter()
        if step == steps:
            break
        loss = torch.zeros((), device=device)
        for _ in range(accum):
            x, y = next_rows()
            with amp():
                micro = fwd(x, y) / accum
            micro.backward()
            loss += micro.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = train_ms + (time.perf_counter() - t0) * 1000
        log(log_line(step=f"{step + 1}/{steps}", train_loss=f"{loss.item():.4f}", train_time=f"{now:.0f}ms",
                     step_avg=f"{now / (step + 1):.2f}ms"))
    if device.type == "cuda":
        log(log_line(peak_memory=f"{torch.cuda.max_memory_allocated() // 2**20}MiB",
                     reserved_memory=f"{torch.cuda.max_memory_reserved() // 2**20}MiB"))
    return log_path


if __name__ == "__main__":
    main()
