"""FlexAttention forward and backward at the training shape (one 49,152-token proxy sequence, 6 heads of 128,
the train mask at the windows of step 100 of the proxy bench: 11 blocks for long-window layers, 5 for the rest),
under a list of kernel options, each checked against Flex's defaults; then, with --autotune, inductor's own
max-autotune search over its Hopper configs (its AUTOTUNE tables go to stderr).

    python data/proxy.py --src .gpu --dst /tmp/proxy --train 1
    python records/2026-12-03_speed3-h200/bench_flex.py [--autotune]
"""
import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

T, HEADS, D = 49152, 6, 128
CONFIGS = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "bwd 64/64/64/64 s3 w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                              "bwd_num_stages": 3, "bwd_num_warps": 4},
}


def inputs():
    tokens = tg.load_shard(sorted(Path("/tmp/proxy").glob("proxy_train_*.bin"))[0])
    idx = torch.from_numpy(tokens[:T].astype("int64")).cuda()
    starts = tg.document_starts(idx)
    masks = {w: tg.attention_mask(starts, torch.tensor(w, device="cuda")) for w in (11, 5)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, T, D, device="cuda", generator=gen) for _ in range(3))
    q, k = tg.norm(q), tg.norm(k)  # the trainer's q and k are rms-normed
    dy = torch.randn(1, HEADS, T, D, device="cuda", generator=gen).bfloat16()
    return masks, [t.bfloat16().requires_grad_() for t in (q, k, v)], dy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--autotune", action="store_true")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    masks, (q, k, v), dy = inputs()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    flex = torch.compile(flex_attention, dynamic=False)
    ref = {}
    print(f"{'options':<26} {'window':>6} {'fwd ms':>7} {'bwd ms':>7} {'max|dy|':>8} {'max|dq|':>8}", flush=True)
    for name, opts in CONFIGS.items():
        for w, mask in masks.items():
            try:
                def fwd():
                    return flex(q, k, v, block_mask=mask, scale=0.12, kernel_options=opts)
                y = fwd()
                dq, = torch.autograd.grad(y, q, dy)
                if name == "default":
                    ref[w] = (y.detach(), dq)
                err_y = (y.detach().float() - ref[w][0].float()).abs().max().item()
                err_dq = (dq.float() - ref[w][1].float()).abs().max().item()
                f = do_bench(lambda: fwd(), warmup=10, rep=50, return_mode="median")
                fb = do_bench(lambda: torch.autograd.grad(fwd(), (q, k, v), dy), warmup=10, rep=50,
                              return_mode="median")
                print(f"{name:<26} {w:6d} {f:7.3f} {fb - f:7.3f} {err_y:8.1e} {err_dq:8.1e}", flush=True)
            except Exception as e:  # a config that does not compile is a row, not the end of the bench
                print(f"{name:<26} {w:6d} {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
    if args.autotune:
        torch._dynamo.reset()
        tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")
        for w, mask in masks.items():
            def fwd():
                return tuned(q, k, v, block_mask=mask, scale=0.12)
            torch.autograd.grad(fwd(), (q, k, v), dy)
            f = do_bench(lambda: fwd(), warmup=10, rep=50, return_mode="median")
            fb = do_bench(lambda: torch.autograd.grad(fwd(), (q, k, v), dy), warmup=10, rep=50, return_mode="median")
            print(f"{'max-autotune':<26} {w:6d} {f:7.3f} {fb - f:7.3f}", flush=True)


if __name__ == "__main__":
    main()
