"""Count the machine instructions a hand-written kernel's loops issue per element, with no GPU: Triton compiles
the kernel for an H100 (sm_90: its front end, its lowering and the ptxas it ships), cuobjdump gives the SASS,
and each innermost loop (a backward branch) is counted, instructions by opcode, over the elements one trip of
it handles. ptxas unrolls loops, so the elements are counted by their special-function ops (MUFU): two for
each of the CE kernel's logits in either pass (tanh.approx and exp2), one for each attention score (exp2; the
forward's rescales add a few a tile). Where a kernel is bound by issuing instructions
(records/2026-12-08_ce-sass), this predicts a change before a GPU can time it. Needs triton (PyTorch's CPU
wheels do not bring it); not run by pytest.

    python records/bench/sasscount.py [--script train_gpt.py] [--ce_launch ROWS COLUMNS WARPS] [--out DIR]

Kernels: the soft-capped cross-entropy (_softcap_ce_kernel) at the training launch (KernelSettings.ce_tiles, or
--ce_launch's; a 16,384-row sequence, the prefix term, tanh.approx, e5m2 grad), and window_attention's three at
ATTN_HOPPER_TILES' launches, with and without TMA descriptors; integer and pointer arguments specialized as
the training's launches are (16-byte aligned, multiples of 16). --out keeps each kernel's SASS.
"""
import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stagebench import REPO, load_trainer  # noqa: E402  a trainer's file loaded as train_gpt


def compile_sm90(kernel, types: dict, constants: dict, aligned: list, warps: int, stages: int = 3):
    """The kernel's cubin for sm_90: types maps each runtime argument to Triton's type string, constants each
    constexpr to its value; the arguments in aligned are specialized as divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = kernel.arg_names
    signature = {**types, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["cubin"]


def sass(cubin: bytes) -> tuple[str, str]:
    """(SASS, resource usage) of a cubin, by the cuobjdump Triton ships."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return text, next((line.strip() for line in usage.splitlines() if "REG:" in line), "")


def loops(text: str) -> list[tuple[int, collections.Counter]]:
    """Each innermost loop's instructions, by opcode: from a backward branch's target to the branch, where no
    other such span lies inside (TMA's pipelines branch back around whole loops)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    index = {address: i for i, (address, _) in enumerate(lines)}
    spans = []
    for i, (address, instruction) in enumerate(lines):
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", instruction)
        if branch and int(branch.group(1), 16) < address and int(branch.group(1), 16) in index:
            spans.append((index[int(branch.group(1), 16)], i))
    found = []
    for start, end in spans:
        if any(start <= a and b <= end and (a, b) != (start, end) for a, b in spans):
            continue
        ops = collections.Counter(re.sub(r"^@!?U?P[0-9T]\s+", "", x).split()[0].split(".")[0]
                                  for _, x in lines[start:end + 1])
        if ops["MUFU"]:  # an mbarrier's wait is a loop of its own, with no math
            found.append((lines[start][0], ops))
    return found


def ce_kernel(tg, launch=None):
    rows, columns, warps = launch or tg.KernelSettings().ce_tiles
    types = {"z_ptr": "*bf16", "targets_ptr": "*i64", "weights_ptr": "*fp32", "loss_ptr": "*fp32",
             "ntp_ptr": "*fp32", "g_ptr": "*fp8e5", "T": "i32", "N": "i32", "row0": "i32", "S": "i32",
             "inv_grad_s": "fp32", "prefix_ptr": "*i64"}
    constants = dict(V=50304, CAP=tg.SOFTCAP, SHIFT=tg.SOFTCAP_SHIFT, DIV=tg.SOFTCAP_DIV, TOP=tg.E5M2_MAX,
                     BLOCK_T=rows, BLOCK_V=columns, APPROX=True, PREFIX=True)
    if "WHOLE_ROWS" in tg._softcap_ce_kernel.arg_names:  # since records/2026-12-08_ce-sass
        constants["WHOLE_ROWS"] = True
    aligned = [n for n, t in types.items() if t.startswith("*")] + ["T", "N", "row0", "S"]
    return "_softcap_ce_kernel", compile_sm90(tg._softcap_ce_kernel, types, constants, aligned, warps), 2


def attention_kernels(tg, tma: bool):
    """window_attention's three kernels at ATTN_HOPPER_TILES' launches (tma: their walked tiles by TMA
    descriptors), stage 3's 6 heads of 128; their elements are scores, one exp2 (MUFU) each a trip but the
    forward's rescales (kept in the count: a few in a tile)."""
    H, D = 6, 128
    strides = ("sq", "sk", "sv", "so", "sg", "sdq", "sdk", "sdv", "hq", "hk", "hv", "ho", "hg", "hdq", "hdk", "hdv")
    for name, tile in zip(("fwd", "dq", "dkdv"), tg.ATTN_HOPPER_TILES):
        bm, bn, warps, stages = tile[:4]
        kernel = getattr(tg, f"_attn_{name}_kernel")
        types = {n: ("i32" if n in strides or n == "N" else "*fp32" if n in ("lse_ptr", "delta_ptr") else
                     "*i32" if n in ("first_ptr", "q_end_ptr", "q_full_ptr") else "*bf16")
                 for n in kernel.arg_names if n not in ("H", "D", "BM", "BN", "TMA")}
        constants = dict(H=H, D=D, BM=bm, BN=bn)
        if "TMA" in kernel.arg_names:  # since records/2026-12-08_ce-sass
            constants["TMA"] = tma
            walked, rows = (("q_ptr", "g_ptr"), bm) if name == "dkdv" else (("k_ptr", "v_ptr"), bn)
            types.update({n: f"tensordesc<bf16[{rows},{D}]>" for n in walked} if tma else {})
        aligned = [n for n, t in types.items() if n != "N" and not t.startswith("tensordesc")]
        yield (f"_attn_{name}_kernel{' (TMA)' if tma else ''}",
               compile_sm90(kernel, types, constants, aligned, warps, stages), 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", default=str(REPO / "train_gpt.py"), help="the trainer whose kernels to count")
    parser.add_argument("--out", default=None, help="a folder for each kernel's SASS")
    parser.add_argument("--ce_launch", type=int, nargs=3, metavar=("ROWS", "COLUMNS", "WARPS"),
                        help="the CE kernel's launch (KernelSettings.ce_tiles' by default)")
    args = parser.parse_args(argv)
    tg = load_trainer(args.script)
    print(f"{Path(args.script).name}: sm_90 SASS per thread, per element a thread handles in a loop's trip")
    kernels = [ce_kernel(tg, args.ce_launch), *attention_kernels(tg, False)]
    if "TMA" in tg._attn_fwd_kernel.arg_names:
        kernels += attention_kernels(tg, True)
    for name, cubin, mufu_per_element in kernels:
        text, usage = sass(cubin)
        print(f"{name}: {usage}")
        total = 0.0
        for start, ops in loops(text):
            n, elements = sum(ops.values()), ops["MUFU"] / mufu_per_element
            total += n / elements
            print(f"  loop at {start:#06x}: {n} instructions, {elements:g} elements a trip: {n / elements:.2f} "
                  "per element; " + " ".join(f"{op} {k}" for op, k in ops.most_common(12)))
        print(f"  loops together: {total:.2f} instructions per element")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{name.replace(' (TMA)', '_tma')}.sass").write_text(text)


if __name__ == "__main__":
    main()
