"""Play a GPU of less memory on a larger one: run a script (a bench or train_gpt.py) in a process whose CUDA
allocator refuses anything past GIB GiB, as a card of that size would (torch.cuda.set_per_process_memory_fraction,
which train_gpt.py's --micro_batch 0 reads back as the memory it may use).

    python records/bench/capped.py 24 train_gpt.py FLAGS...
    python records/bench/capped.py 24 records/bench/stagebench.py --out DIR --name cap24 -- FLAGS...
"""
import runpy
import sys

import torch


def main():
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    gib, script = float(sys.argv[1]), sys.argv[2]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, 0)
    print(f"capped.py: allocator capped at {gib} GiB of {total / 2**30:.1f}", flush=True)
    sys.argv = sys.argv[2:]
    sys.path.insert(0, ".")
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
