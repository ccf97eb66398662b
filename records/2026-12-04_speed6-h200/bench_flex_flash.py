"""FlexAttention's two backends at the training shape: its Triton kernels (what the trainer runs, with its sm_90
forward tiles) against BACKEND="FLASH", torch 2.11's route to FlashAttention-4's CuTe-DSL kernels (the
flash-attn-4 package, with NVIDIA's CUTLASS DSL). Same BlockMask (train_gpt's, with its mask_mod) at the
windows of step 33 (4 and 2 blocks) and step 100 (11 and 5), one 49,152-token proxy sequence, 6 heads of 128.

Prints, per backend: the first compiled forward + backward's seconds (cold compile), ms forward and backward
(median of do_bench), the largest difference of output and grads from the Triton backend's relative to their
largest magnitude, and whether two backward passes gave the same bits.

    python records/2026-12-04_speed6-h200/bench_flex_flash.py TOKENS.bin

The FLASH route needs, beside torch 2.11: flash-attn-4 4.0.0b14, nvidia-cutlass-dsl 4.4.2 with
nvidia-cutlass-dsl-libs-base 4.4.2, quack-kernels 0.4.0, apache-tvm-ffi 0.1.15.post2, torch-c-dlpack-ext 0.1.5
(wheels unzipped into one folder, on PYTHONPATH with its nvidia_cutlass_dsl/python_packages: the package's .pth
file is not read from PYTHONPATH). Newer flash-attn-4 betas need CUTLASS DSL 4.5+, whose CUDA library wheel
alone is 92 MB, over what one device call carries. Result in profiles/bench_flex_flash.txt (call 1): FLASH's
forward took ~0.75 ms at every window, so do_bench timed its host-side launch path (a Python call into FA4
per launch), not its kernels; the whole-step test in the same call (records/stepbench.py with
--set 'FLEX_HOPPER_TILES={"BACKEND":"FLASH"}') measured the kernels where the host runs ahead: equal.
"""
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-04_speed5-h200"))
import train_gpt as tg  # noqa: E402
from bench_flex_mask import attention_inputs  # noqa: E402
BACKENDS = {"triton": tg.FLEX_HOPPER_TILES, "flash": {"BACKEND": "FLASH"}}


def main(shard: str):
    torch._dynamo.config.cache_size_limit = 64
    idx, q, k, v, dy = attention_inputs(Path(shard))  # round five's inputs: same seed, same layout
    starts = tg.document_starts(idx)
    flex = torch.compile(flex_attention, dynamic=False)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for step, windows in ((33, (4, 2)), (100, (11, 5))):
        for w in windows:
            mask = tg.block_attention_mask(tg.first_visible(starts, torch.tensor(w, device="cuda")))
            print(f"step {step} window {w}: {mask.kv_num_blocks.sum().item()} partial and "
                  f"{mask.full_kv_num_blocks.sum().item()} full blocks of 128x128", flush=True)
            ref = None
            for name, opts in BACKENDS.items():
                def fwd():
                    return flex(q, k, v, block_mask=mask, scale=0.12, kernel_options=opts)
                try:
                    t0 = time.perf_counter()
                    y = fwd()
                    grads = torch.autograd.grad(y, (q, k, v), dy)
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                except Exception as e:  # the FLASH route can fail to compile: say how, go on with the rest
                    print(f"  {name:<6} failed: {type(e).__name__}: {str(e)[:600]}", flush=True)
                    continue
                out = (y.detach(), *grads)
                again = torch.autograd.grad(fwd(), (q, k, v), dy)
                same_bits = all(torch.equal(a, b) for a, b in zip(grads, again))
                ref = ref or out
                err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                          for a, b in zip(out, ref))
                f = do_bench(fwd, warmup=10, rep=50, return_mode="median")
                fb = do_bench(lambda: torch.autograd.grad(fwd(), (q, k, v), dy), warmup=10, rep=50,
                              return_mode="median")
                print(f"  {name:<6} first call {first_s:5.1f} s  fwd {f:6.3f} ms  bwd {fb - f:6.3f} ms  "
                      f"max diff from triton {err:.1e} of max  backward repeatable: {same_bits}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
