"""Run the fp32 Triton kernels (the optimizer's cautious_step_fused, the fp32 sums' add_into_fp32 and
add_rows_into_fp32) on CPU in Triton's interpreter, where no GPU is at hand: needs triton installed (PyTorch's
CPU wheels do not bring it). Not run by pytest: the interpreter is slow. Two checks:

1. the fused optimizer step's cases (tests/test_training.py::fused_optimizer_step_cases) against their
   float64 rules, as test_cuda_fused_optimizer_steps_match_float64 checks them on a GPU;
2. a tiny 10-step run (tests/conftest.py's TINY: Adam steps, the untie, the extension) with those kernels and
   Polar Express's GEMM path (mm_add in fp32), against the same run on the torch rules: the GPU-side glue
   runs end to end, and the losses differ by rounding only (a CPU kernel set alone, ATEN_CPU_CAPABILITY=avx2,
   moves them by about 0.001).

    python tests/interpreted.py
"""
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

import train_gpt as tg  # noqa: E402
from conftest import losses, make_sample_shards, tiny_args  # noqa: E402
from test_training import FUSED_STEP_RTOL, fused_optimizer_step_cases  # noqa: E402

ROUNDING = 0.01  # largest loss difference taken for rounding in the 10-step run


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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
