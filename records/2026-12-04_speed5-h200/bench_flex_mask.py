"""What FlexAttention's mask_mod costs at the training shape (one 49,152-token proxy sequence, 6 heads of 128):
the train BlockMask at the windows of step 33 of the proxy bench (4 blocks for long-window layers, 2 for the
rest) and of step 100 (11 and 5), with its mask_mod, the per-pair rule Flex runs on partial blocks, written
four ways:
- "docs": the rule before this round: same document (docs[q] == docs[kv], two gathers), causal, and the block
  window (q // 128 - kv // 128 < window);
- "start": one gather, kv at or after the first token of q's document, and causal; no window term;
- "causal": causal only, a wrong mask, as the floor of what any mask_mod can cost;
- "trainer": train_gpt.py's mask_rule now, kv from first[q] (the later of q's document start and its window's
  first token) to q: one gather, and the whole mask, as Flex's contract asks (its eager path applies mask_mod
  to every pair, so a mask_mod without the window, like "start", is only right inside the compiled kernel).
The block lists are train_gpt's for all four. Prints partial and full block counts, ms forward and backward,
and the largest output difference from "docs". Call 3 ran the first three (the "docs" rule then came from
train_gpt.py itself); call 4 all four: profiles/bench_flex_mask.txt.

    python data/proxy.py --src .gpu --dst /tmp/proxy --train 1
    python records/2026-12-04_speed5-h200/bench_flex_mask.py
"""
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

T, HEADS, D = 49152, 6, 128


def with_mask_mod(m: BlockMask, mask_mod) -> BlockMask:
    return BlockMask(seq_lengths=m.seq_lengths, kv_num_blocks=m.kv_num_blocks, kv_indices=m.kv_indices,
                     full_kv_num_blocks=m.full_kv_num_blocks, full_kv_indices=m.full_kv_indices,
                     q_num_blocks=m.q_num_blocks, q_indices=m.q_indices, full_q_num_blocks=m.full_q_num_blocks,
                     full_q_indices=m.full_q_indices, BLOCK_SIZE=m.BLOCK_SIZE, mask_mod=mask_mod)


def attention_inputs(shard: Path):
    """The shard's first T tokens on the GPU, and seeded q, k (normed, as QK-norm leaves them), v and an
    output grad of the training shape, in bf16, q, k, v requiring grad."""
    idx = torch.from_numpy(tg.load_shard(shard)[:T].astype("int64")).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, T, D, device="cuda", generator=gen) for _ in range(3))
    q, k = tg.norm(q), tg.norm(k)
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    return idx, q, k, v, torch.randn(1, HEADS, T, D, device="cuda", generator=gen).bfloat16()


def main():
    torch._dynamo.config.cache_size_limit = 64
    idx, q, k, v, dy = attention_inputs(sorted(Path("/tmp/proxy").glob("proxy_train_*.bin"))[0])
    docs = (idx == tg.BOS_ID).cumsum(0)  # which document each token is in
    starts = tg.document_starts(idx)
    flex = torch.compile(flex_attention, dynamic=False)
    opts = tg.FLEX_HOPPER_TILES
    print(torch.cuda.get_device_name(), torch.__version__, "fwd options", opts, flush=True)
    for step, windows in ((33, (4, 2)), (100, (11, 5))):
        for w in windows:
            wt = torch.tensor(w, device="cuda")
            base = tg.block_attention_mask(tg.first_visible(starts, wt))
            rules = {"docs": lambda b, h, qi, ki: ((qi >= ki) & (docs[qi] == docs[ki])
                                                   & (qi // tg.MASK_BLOCK - ki // tg.MASK_BLOCK < wt)),
                     "start": lambda b, h, qi, ki: (qi >= ki) & (ki >= starts[qi]),
                     "causal": lambda b, h, qi, ki: qi >= ki,
                     "trainer": None}
            partial, full = base.kv_num_blocks.sum().item(), base.full_kv_num_blocks.sum().item()
            print(f"step {step} window {w}: {partial} partial and {full} full blocks of 128x128", flush=True)
            ref = None
            for name, rule in rules.items():
                mask = base if rule is None else with_mask_mod(base, rule)

                def fwd():
                    return flex(q, k, v, block_mask=mask, scale=0.12, kernel_options=opts)
                y = fwd()
                dq, dk = torch.autograd.grad(y, (q, k), dy)
                if ref is None:
                    ref = (y.detach(), dq, dk)
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip((y, dq, dk), ref))
                f = do_bench(fwd, warmup=10, rep=50, return_mode="median")
                fb = do_bench(lambda: torch.autograd.grad(fwd(), (q, k, v), dy), warmup=10, rep=50,
                              return_mode="median")
                print(f"  {name:<7} fwd {f:6.3f} ms  bwd {fb - f:6.3f} ms  max diff from docs {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
