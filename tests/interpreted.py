"""Run the Triton kernels (the optimizer's cautious_step_fused, the fp32 sums' add_into_fp32 and
add_rows_into_fp32, DC's, the cross-entropy's, the fused ReLU^2 matmul's FP8 forward, window_attention's) on
CPU in Triton's interpreter, where no GPU is at hand: needs triton installed (PyTorch's CPU wheels do not bring
it) and numpy<2 (the interpreter's scalars). Not run by pytest: the interpreter is slow. Six checks:

1. the fused optimizer step's cases (tests/test_training.py::fused_optimizer_step_cases) against their
   float64 rules, as test_cuda_fused_optimizer_steps_match_float64 checks them on a GPU;
2. a tiny 10-step run (tests/conftest.py's TINY: Adam steps, the untie, the extension) with those kernels and
   Polar Express's GEMM path (mm_add in fp32), against the same run on the torch rules: the GPU-side glue
   runs end to end, and the losses differ by rounding only (a CPU kernel set alone, ATEN_CPU_CAPABILITY=avx2,
   moves them by about 0.001);
3. DC's kernels (dc_mix and its backward), run in fp32 (the interpreter's bf16 is not numpy's), against
   dc_correction's torch rule in float64: the output and the grads of q, k, v and both mixes, on two
   sequences of documents, at DC's window (112), a short one and the longest (128), with the key side's heads
   in each program and in a grid of their own (DC_KV_HEADS_IN_GRID);
4. the softcapped cross-entropy kernel on fp32 logits, with and without the prefix-token term, against the
   rule (softcap_ce_parts): losses to 1e-5, the e5m2 grad within its rounding of the rule's; launched on rows
   that start part-way into a sequence (the bf16 head's chunks), and on targets of three token ids (a row's
   targets repeat), the fp32 grad to 1e-5; and the bf16 head (softcap_head_chunks) with its chunks through
   the kernel against the rule's: losses and grads;
5. the fused ReLU^2 kernel's FP8 forward for --fp8_down (its tile, and a candidate of 4 stages in 4 column
   blocks), persistent programs of two tiles each, against the op's torch path: post within bf16's rounding
   (the interpreter's bf16 is its own), the largest value exactly the kernel's post's, and the e4m3 copy
   fp8_post of the kernel's post but where the interpreter's e4m3 conversion rounds its own way (a rounding carry
   into the exponent dropped, 125 -> 64 where torch and the GPU give 128; subnormals rounded down a step); on an
   H100 the kernel's output equals the torch path's;
6. window_attention (--attn_kernel) and its backward through autograd, in fp32, against SDPA over the dense
   mask (dense_attention_mask) in float64: the output and the grads of q, k, v, on the mask tests' token
   layouts (documents on tile edges, one long document, a sequence starting mid-document), short and long
   windows and paired heads' interleaved sequence, with q and k strided views of one tensor as the model's
   are, in the Hopper tiles and smaller ones, the smaller ones also with the walked tiles by TMA descriptors.

    python tests/interpreted.py
"""
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from conftest import losses, make_sample_shards, tiny_args  # noqa: E402
from test_train_gpt import first_of, token_layouts  # noqa: E402
from test_training import FUSED_STEP_RTOL, fused_optimizer_step_cases  # noqa: E402

ROUNDING = 0.01  # largest loss difference taken for rounding in the 10-step run
DC_RTOL = 1e-5   # the DC kernels in fp32 against the rule in float64 (measured: 2.5e-7)


def dc_kernel_cases(heads_in_grid: bool = False):
    """(what, relative difference) of dc_mix's output and grads against dc_correction's rule in float64."""
    tg.DC_KV_HEADS_IN_GRID = heads_in_grid
    tokens = np.stack([token_layouts(512, 4)["block_edges"], token_layouts(512, 4)["random"]])
    N, H, D = tokens.size, 2, 32
    gen = torch.Generator().manual_seed(0)
    for window in (112, 5, 128):
        first = tg.first_visible(tg.document_starts(torch.from_numpy(tokens)), window - 1)
        leaves = [torch.randn(N, H, D, generator=gen) * s for s in (0.4, 0.4, 1.0)]
        leaves += [torch.randn(N, H, generator=gen) for _ in range(2)]
        ins = [t.clone().requires_grad_() for t in leaves]
        a = torch.nn.functional.rms_norm(ins[3], (H,), eps=1e-6)
        out = tg.dc_mix(*ins[:3], a, ins[4], first, window)[0]
        g = torch.randn(out.shape, generator=gen)
        grads = torch.autograd.grad(out, ins, g)
        ref = [t.double().requires_grad_() for t in leaves]
        want = tg.dc_correction(*(t.view(2, 512, H, D) for t in ref[:3]), *(t.view(2, 512, H) for t in ref[3:]),
                                first).reshape(N, H, D)
        wants = torch.autograd.grad(want, ref, g.double())
        for name, x, y in zip(["out", "dq", "dk", "dv", "d mix_in", "d mix_out"], (out, *grads), (want, *wants)):
            yield f"DC window {window} {name}{' (heads in the grid)' if heads_in_grid else ''}", \
                ((x.double() - y).norm() / y.norm()).item()


def ce_kernel_cases():
    """(what, largest loss difference, the grads' relative difference, its bound) of the CE kernel against the
    rule: the FP8 head's launches (e5m2 grad: 2 mantissa bits, about 5% rms), and the bf16 head's, a chunk of
    rows that starts part-way into a sequence (row0), and targets that repeat in a row's terms (the kernel
    writes a target's column after the rest, with the terms of every target on it), the grad in fp32 here."""
    gen = torch.Generator().manual_seed(0)
    T, V = 64, 500  # a vocab that is no multiple of the tile: the last tile's columns are masked
    z = torch.randn(T, V, generator=gen) * 5
    targets = torch.randint(0, V, (T,), generator=gen)
    prefix = torch.where(torch.rand(T, generator=gen) < 0.3, -1, torch.randint(0, V, (T,), generator=gen))
    for name, weights, pre in [("CE", [1.0, 0.5, 0.25], None), ("CE + prefix", [1.0, 0.5, 0.25, 0.25], prefix)]:
        w = torch.tensor(weights)
        loss, ntp, g = tg._softcap_ce_cuda(z, targets, w, tg.HEAD_GRAD_SCALE, (8, 128, 4), False, 32, prefix=pre)
        want_loss, want_ntp, dz = tg.softcap_ce_parts(z, targets, w, 32, pre)
        far = max((loss - want_loss).abs().max().item(), (ntp - want_ntp).abs().max().item())
        exact = dz / tg.HEAD_GRAD_SCALE
        yield name, far, ((g.float() - exact).norm() / exact.norm()).item(), 0.06
    w = torch.tensor([1.0, 0.5, 0.25, 0.25])
    for row0, rows, n in ((20, 25, T), (40, 20, 60)):  # rows 20-44 cross a sequence's end; 40-59 end where
        zc = z[row0:row0 + rows].clone()               # targets do, 4 rows short of their sequence's end
        out = (torch.empty(rows), torch.empty(rows), torch.empty(rows, V))
        loss, ntp, g = tg._softcap_ce_cuda(zc, targets[:n], w, 1.0, (8, 128, 4), False, 32, out, prefix[:n],
                                           row0=row0)
        want_loss, want_ntp, dz = tg.softcap_ce_parts(zc, targets[:n], w, 32, prefix[:n], row0=row0)
        far = max((loss - want_loss).abs().max().item(), (ntp - want_ntp).abs().max().item())
        yield f"CE + prefix, rows {row0}..{row0 + rows - 1} alone", far, ((g - dz).norm() / dz.norm()).item(), 1e-5
    # three token ids: a row's targets and prefix token often fall on one column, whose grad holds all their terms
    few = torch.randint(0, 3, (T,), generator=gen)
    few_prefix = torch.where(torch.rand(T, generator=gen) < 0.3, -1, torch.randint(0, 3, (T,), generator=gen))
    out = (torch.empty(T), torch.empty(T), torch.empty(T, V))
    loss, ntp, g = tg._softcap_ce_cuda(z, few, w, 1.0, (8, 128, 4), False, 32, out, few_prefix)
    want_loss, want_ntp, dz = tg.softcap_ce_parts(z, few, w, 32, few_prefix)
    far = max((loss - want_loss).abs().max().item(), (ntp - want_ntp).abs().max().item())
    yield "CE + prefix, repeating targets", far, ((g - dz).norm() / dz.norm()).item(), 1e-5


def bf16_head_case() -> tuple[float, float]:
    """softcap_head_chunks (the bf16 head) with its chunks through the CE kernel, the grad written in bf16 over
    the logits, against the rule's chunks: (largest relative difference of the two losses, of the grads wrt
    the rows and the weight). 96 rows in sequences of 32, chunks of 40 rows, the prefix term on."""
    gen = torch.Generator().manual_seed(1)
    N, S, V, dim = 96, 32, 500, 16
    x = torch.randn(N, dim, generator=gen).bfloat16()
    w = (torch.randn(V, dim, generator=gen) * 2).bfloat16()
    targets = torch.randint(0, V, (N,), generator=gen)
    prefix = torch.where(torch.rand(N, generator=gen) < 0.3, -1, torch.randint(0, V, (N,), generator=gen))
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    on_gpu, results = tg.on_gpu, []
    for kernel in (True, False):
        tg.on_gpu = lambda t: kernel
        results.append(tg.softcap_head_chunks(x, w, targets, weights, S, prefix, 40, (8, 128, 4), False))
    tg.on_gpu = on_gpu
    rel = [((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(*results)]
    return max(rel[:2]), max(rel[2:])


def relu_square_fp8_down_cases():
    """(tile, post's distance from the torch path's, top equal, copy bytes off but for the carry, equal share)"""
    tg.sm_count = lambda index: 2  # 4 tiles on 2 programs: each program loops over two
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen).bfloat16()
    w = (torch.randn(512, 128, generator=gen) * 0.1).bfloat16()
    w8, s_w = tg.fp8_weight(w)
    x8, scale = tg.fp8_input(x, s_w)
    act = torch.tensor([0.003])  # some of post past 448 x it: capped
    want, _, want_top = tg.relu_square_mm(x, w, None, [], (x8, w8, scale), act)
    for tile in (tg.MLP_HOPPER_TILES[3], (128, 256, 128, 8, 4, 4, 0, 1)):
        post, post8, top = tg._relu_square_mm_cuda(x, w, None, tile, (x8, w8, scale), act)
        got, rule = post8.float(), tg.fp8_post(post, act).float()
        # the interpreter's own e4m3 rounding: a carry into the exponent dropped, subnormals rounded down a step
        carry = (rule == 2 * got) & (torch.frexp(rule).mantissa == 0.5)
        truncated = (rule <= 2 ** -6) & (rule - got == 2 ** -9)
        yield (tile, ((post.float() - want.float()).norm() / want.float().norm()).item(),
               top.item() == post.float().max().item() == want_top.item(), int(((got != rule) & ~carry & ~truncated).sum()),
               (got == rule).float().mean().item())


ATTN_RTOL = 1e-5  # window_attention in fp32 against SDPA in float64


def window_attention_cases():
    """(what, relative difference) of window_attention's output and grads against SDPA in float64."""
    gen = torch.Generator().manual_seed(0)
    small = ((64, 32, 4, 1, 0), (64, 32, 4, 1, 0), (32, 64, 4, 1, 0))
    by_tma = tuple(tile[:-1] + (1,) for tile in small)  # the tiles each kernel walks by TMA descriptors
    for layout, tokens in token_layouts(1024, 5).items():
        for window, paired, tiles in [(300, False, tg.ATTN_HOPPER_TILES), (100, True, small), (2000, False, small),
                                      (300, True, by_tma), (2000, False, by_tma)]:
            first = first_of(tokens, window, paired).int()
            N, H, D = first.numel(), 2, 32
            leaves = [torch.randn(N, 2 * H, D, generator=gen) * 0.4, torch.randn(N, H, D, generator=gen)]
            ins = [t.clone().requires_grad_() for t in leaves]
            q, k = ins[0][:, :H], ins[0][:, H:]  # strided, as Attention.forward's q and k
            out = tg.window_attention(q, k, ins[1], first, [x for t in tiles for x in t])[0]
            g = torch.randn(out.shape, generator=gen)
            grads = torch.autograd.grad(out, ins, g)
            ref = [t.double().requires_grad_() for t in leaves]
            want = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1) for t in (ref[0][:, :H], ref[0][:, H:], ref[1])),
                attn_mask=tg.dense_attention_mask(first), scale=1.0).transpose(0, 1)
            wants = torch.autograd.grad(want, ref, g.double())
            what = (f"window_attention {layout}, window {window}{', paired' if paired else ''}, tiles {tiles[0][:2]}"
                    + (" by TMA" if tiles[0][-1] else ""))
            for name, x, y in zip(["out", "dq dk", "dv"], (out, *grads), (want, *wants)):
                yield f"{what} {name}", ((x.double() - y).norm() / y.norm()).item()


def main() -> int:
    if tg.triton is None:
        print("triton is not installed: pip install triton (and numpy<2 for its interpreter)")
        return 2
    tmp = Path(tempfile.mkdtemp())
    shards = make_sample_shards(tmp / "shards")
    rules = losses(tg.main(tiny_args(shards, tmp / "rules", "--num_steps", "10")).read_text())
    tg.on_gpu = lambda t: t.dtype == torch.float32  # fp32 tensors take the kernels; the float64 references not
    failed = 0
    for what, got, want, atol in fused_optimizer_step_cases("cpu"):
        ok = torch.allclose(got.double(), want, rtol=FUSED_STEP_RTOL, atol=atol)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}: largest difference {(got.double() - want).abs().max():.2e}")
    gemm = tg.mm_add
    tg.mm_add = lambda c, a, b, beta, alpha=1.0: gemm(c.float(), a.float(), b.float(), beta, alpha).bfloat16()
    kernels = losses(tg.main(tiny_args(shards, tmp / "kernels", "--num_steps", "10")).read_text())
    far = max(abs(kernels[s] - rules[s]) for s in rules)
    ok = kernels.keys() == rules.keys() and far <= ROUNDING
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} tiny run, kernels against rules: {len(kernels)} steps, losses at most "
          f"{far:.4f} apart")
    for what, far, rel, bound in ce_kernel_cases():
        ok = far <= 1e-5 and rel < bound
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what} kernel: losses {far:.1e} apart, grad {rel:.1e} from the rule's")
    losses_rel, grads_rel = bf16_head_case()
    ok = losses_rel < 1e-5 and grads_rel < 0.01  # the grads: bf16's rounding, through two matmuls
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} bf16 head's chunks through the CE kernel: losses {losses_rel:.1e} from the "
          f"rule's, grads {grads_rel:.1e}")
    for tile, rel, top_ok, off, equal in relu_square_fp8_down_cases():
        ok = rel < 0.02 and top_ok and off == 0 and equal > 0.99
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} ReLU^2 kernel's FP8 forward for --fp8_down, tile {tile}: post {rel:.1e} "
              f"from the torch path's, largest value {'equal' if top_ok else 'DIFFERENT'}, e4m3 copy {equal:.2%} "
              f"equal, {off} off but for the interpreter's rounding")
    for what, rel in [*dc_kernel_cases(), *dc_kernel_cases(heads_in_grid=True)]:
        failed += not rel <= DC_RTOL
        print(f"{'ok  ' if rel <= DC_RTOL else 'FAIL'} {what}: relative difference {rel:.1e}")
    for what, rel in window_attention_cases():
        failed += not rel <= ATTN_RTOL
        print(f"{'ok  ' if rel <= ATTN_RTOL else 'FAIL'} {what}: relative difference {rel:.1e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
