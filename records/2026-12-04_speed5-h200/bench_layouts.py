"""Each GEMM of the block matmuls at the training shape (49,152 tokens), timed alone as one torch.mm (no
autograd, whose host overhead hid 0.1 ms kernels in bench_gemm.py), for both ways of storing the weight:
as (out, in) and applied transposed (train_gpt.py's q, k, v, o and proj), or as (in, out) and applied plain
(its fc). Per weight layout, the three products of a training step: forward y = x W, dgrad dx = dy W^T and
wgrad dW = x^T dy, each in the operand layout autograd hands cuBLAS. Prints ms per call, TFLOP/s, and the
per-step sum (8 micro-steps; attention matmuls in 11 layers, MLP in 12) of each layout choice.

    python records/2026-12-04_speed5-h200/bench_layouts.py      (call 2: profiles/bench_layouts.txt)
"""
import torch
from triton.testing import do_bench

T = 49152
# name: (in, out, calls per micro-step, the layout train_gpt.py uses)
MATMULS = {"qk": (768, 1536, 11, "out,in"), "v": (768, 768, 11, "out,in"), "o": (768, 768, 11, "out,in"),
           "fc": (768, 3072, 12, "in,out"), "proj": (3072, 768, 12, "out,in")}


def products(x, dy, p, layout):
    """The step's three GEMMs for weight parameter p stored in this layout, as autograd computes them."""
    if layout == "out,in":  # y = x @ p.mT; grad of p is dy.mT @ x
        return {"fwd": lambda: x @ p.mT, "dgrad": lambda: dy @ p, "wgrad": lambda: dy.mT @ x}
    return {"fwd": lambda: x @ p, "dgrad": lambda: dy @ p.mT, "wgrad": lambda: x.mT @ dy}  # y = x @ p


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sums = {}
    for name, (din, dout, calls, used) in MATMULS.items():
        x = torch.randn(T, din, device="cuda", generator=gen).bfloat16()
        dy = torch.randn(T, dout, device="cuda", generator=gen).bfloat16()
        flops = 2 * T * din * dout
        for layout, shape in (("out,in", (dout, din)), ("in,out", (din, dout))):
            p = (torch.randn(shape, device="cuda", generator=gen) / din ** 0.5).bfloat16()
            cells = []
            total = 0.0
            for role, fn in products(x, dy, p, layout).items():
                ms = min(do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(3))
                total += ms
                cells.append(f"{role} {ms:6.3f} ms {flops / ms / 1e9:4.0f} TF/s")
            sums[(name, layout)] = 8 * calls * total
            mark = "*" if layout == used else " "
            print(f"{name:<5} {layout:<7}{mark} " + "  ".join(cells) + f"  step {8 * calls * total:6.1f} ms",
                  flush=True)
    now = sum(sums[(n, m[3])] for n, m in MATMULS.items())
    best = sum(min(sums[(n, "out,in")], sums[(n, "in,out")]) for n in MATMULS)
    print(f"per step: layouts as train_gpt.py stores them (*) {now:.1f} ms; the faster layout of each {best:.1f} ms")


if __name__ == "__main__":
    main()
