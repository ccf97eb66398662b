"""Break the code on purpose, one way at a time, in a scratch copy, and check that the CPU suite notices.

    python tests/mutants.py                  # every mutant, each against the test files named beside it
    python tests/mutants.py nesterov plot    # some of them (by a word of their name)
    python tests/mutants.py --all-tests      # each against the whole default suite (slow)

Prints one line per mutant: the tests that failed, or SURVIVED if none did (then a test is missing). Not run by
pytest itself: a scratch copy per mutant is minutes of CPU.
"""
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

REFERENCE = "tests/test_train_gpt.py::test_model_equals_float64_reference"
GOLDEN = "tests/test_training.py::test_golden_loss_curve"

# name: (file, [(text in the file, what it becomes)], the tests (files or node ids) expected to catch it)
MUTANTS = {
    "document masking removed everywhere": ("train_gpt.py", [
        ("    return torch.where(idx == BOS_ID, pos, 0).cummax(0).values", "    return torch.zeros_like(pos)")],
        ["tests/test_train_gpt.py"]),
    "mask_mod causal only (the block lists alone keep documents and window)": ("train_gpt.py", [
        ("        return mask_rule(q_idx, kv_idx, first)", "        return mask_rule(q_idx, kv_idx, torch.zeros_like(first))")],
        ["tests/test_train_gpt.py::test_dense_and_block_masks_equal_brute_force",
         "tests/test_train_gpt.py::test_flex_and_sdpa_paths_equal_reference_attention"]),
    "block masks' full blocks a token too late": ("train_gpt.py", [
        ("full = (q_blk > k_blk) & (latest[:, None] <= k_blk * MASK_BLOCK)",
         "full = (q_blk > k_blk) & (latest[:, None] <= k_blk * MASK_BLOCK + 1)")],
        ["tests/test_train_gpt.py::test_dense_and_block_masks_equal_brute_force"]),
    "Nesterov removed from Muon": ("train_gpt.py", [
        ("newton_schulz5(grad.lerp(momentum_buf, momentum))", "newton_schulz5(momentum_buf)")],
        ["tests/test_train_gpt.py"]),
    "Adam bias correction removed": ("train_gpt.py", [
        ("m_hat = exp_avg / (1 - betas[0] ** step)", "m_hat = exp_avg"),
        ("v_hat = exp_avg_sq / (1 - betas[1] ** step)", "v_hat = exp_avg_sq")], ["tests/test_train_gpt.py"]),
    "long and short windows swapped": ("train_gpt.py", [
        ("masks[block.long_window]", "masks[not block.long_window]")], ["tests/test_train_gpt.py"]),
    "U-Net skip connections dropped": ("train_gpt.py", [
        ("skip = (self.skip_weights[L - 1 - i], skips.pop()) if", "skip = (skips.pop(), None)[1] if")],
        ["tests/test_train_gpt.py"]),
    "U-Net skip weights applied in the wrong order": ("train_gpt.py", [
        ("skip = (self.skip_weights[L - 1 - i], skips.pop()) if",
         "skip = (self.skip_weights[i - L // 2], skips.pop()) if")],
        [REFERENCE]),
    "QK-norm removed": ("train_gpt.py", [
        ("return rotary(norm(q), cos, sin), rotary(norm(k), cos, sin)", "return rotary(q, cos, sin), rotary(k, cos, sin)")],
        [REFERENCE, GOLDEN]),
    "rotary turned the other way": ("train_gpt.py", [
        ("(x1 * cos + x2 * sin, x2 * cos - x1 * sin)", "(x1 * cos - x2 * sin, x2 * cos + x1 * sin)")],
        [REFERENCE, GOLDEN]),
    "attention gate after the output projection": ("train_gpt.py", [
        ("        y = (y * gate[..., None]).reshape(B, T, -1)\n        return mm(y, self.qkvo_w[3].type_as(y).mT)\n",
         "        y = mm(y.reshape(B, T, -1), self.qkvo_w[3].type_as(y).mT)\n"
         "        return (y.view(B, T, self.num_heads, -1) * gate[..., None]).view(B, T, -1)\n")], [REFERENCE]),
    "v not scaled by its lambda": ("train_gpt.py", [
        ("        v = self.v_lambdas[0] * v\n", "        v = v + 0 * self.v_lambdas[0]\n")], [REFERENCE]),
    "x0 mixing weights swapped": ("train_gpt.py", [
        ("x = self.lambdas[0] * x + self.lambdas[1] * x0", "x = self.lambdas[1] * x + self.lambdas[0] * x0")],
        [REFERENCE]),
    "value embeddings fed to the wrong layers": ("train_gpt.py", [
        ("ve_of_layer = ve + [None] * (L - 2 * self.num_ve) + ve", "ve_of_layer = ve + [None] * (L - 2 * self.num_ve) + ve[::-1]")],
        ["tests/test_train_gpt.py"]),
    "lm_head soft-cap removed": ("train_gpt.py", [
        ("    return SOFTCAP * torch.sigmoid(z.float() / SOFTCAP_DIV)", "    return z.float()"),
        ("    g = to_fp8(dc * (SOFTCAP / SOFTCAP_DIV) * sig * (1 - sig), grad_s, torch.float8_e5m2)",
         "    g = to_fp8(dc, grad_s, torch.float8_e5m2)")],
        [REFERENCE, "tests/test_training.py::test_softcap_ce_grad_equals_its_formula"]),
    "whole-model compile done block by block": ("train_gpt.py", [("        if whole:\n", "        if False:\n")],
        ["tests/test_training.py::test_both_compile_scopes_compute_the_eager_step"]),
    "one GPU's Muon batch orthogonalizes only its first matrix": ("train_gpt.py", [
        ("mine = min(k, len(b.params) - rank * k)", "mine = min(1, len(b.params) - rank * k)")],
        ["tests/test_training.py::test_gloo_processes_equal_one_with_accumulation"]),
    "bf16 grads' fp32 sum keeps only the last micro-step": ("train_gpt.py", [
        ("    else:\n        acc += g\n", "    else:\n        acc.copy_(g)\n")],
        ["tests/test_training.py::test_gloo_processes_equal_one_with_accumulation"]),
    "one Muon matrix per bucket on one GPU too": ("train_gpt.py", [
        ("per_rank = len(same) if comm.world == 1 else 1", "per_rank = 1")],
        ["tests/test_training.py::test_reduce_scatter_starts_during_backward"]),
    "block masks ordered by argsort (compiled: a slow Triton sort)": ("train_gpt.py", [
        ("order = torch.zeros_like(true_before).scatter(-1, slot.long(), cols.to(torch.int32).expand_as(slot))",
         "order = torch.argsort(v, dim=-1, descending=True, stable=True).to(torch.int32)")],
        ["tests/test_train_gpt.py::test_block_masks_are_built_without_sorts_or_reductions"]),
    "block masks counted by cumsum (torch 2.11's inductor fails on it)": ("train_gpt.py", [
        ("true_before = (v @ earlier).to(torch.int32)",
         "true_before = visible.to(torch.int32).cumsum(-1) - visible.to(torch.int32)")],
        ["tests/test_train_gpt.py::test_block_masks_are_built_without_sorts_or_reductions"]),
    "block masks' query side not transposed": ("train_gpt.py", [
        ("torch.stack([some, full, some.mT, full.mT])", "torch.stack([some, full, some, full])")],
        ["tests/test_train_gpt.py::test_dense_and_block_masks_equal_brute_force"]),
    "Hopper's Flex forward tiles never chosen": ("train_gpt.py", [
        ('choice == "auto" and tuple(capability) == (9, 0)', 'choice == "auto" and False')],
        ["tests/test_trust.py::test_flex_tiles_fit_the_gpus_shared_memory"]),
    "profiler counts torch's copy kernels as other kernels": ("train_gpt.py", [
        ('r"[Mm]emcpy|[Mm]emset|copy_kernel|[Ff]ill"', 'r"[Mm]emcpy|[Mm]emset|[Ff]ill"')],
        ["tests/test_training.py::test_profiler_sorts_kernels_by_what_they_do"]),
    "plot draws nothing": ("records/tool.py", [
        ('        by_time.plot([t / 1000 for t in ms], losses, marker=".", label=label)\n', ""),
        ('        by_step.plot(steps, losses, marker=".", label=label)\n', "")], ["tests/test_records.py"]),
    "loader not aligned to BOS": ("train_gpt.py", [
        ("                return int(self.bos[i])", "                return int(self.pos)")],
        ["tests/test_training.py::test_loader_aligns_to_bos_and_splits_by_rank", "tests/test_trust.py"]),
    "lm_head at an older lr (0.22) that outgrows FP8": ("train_gpt.py", [
        ('head_lr: float = H(0.008,', 'head_lr: float = H(0.22,')],
        ["tests/test_training.py::test_full_width_fp8_head_stays_within_its_scales_while_training"]),
    "GPU out-of-memory shown as a traceback": ("train_gpt.py", [
        ("    if isinstance(e, torch.OutOfMemoryError):", "    if False:")], ["tests/test_trust.py"]),
}


def run(name: str, all_tests: bool) -> str:
    path, edits, tests = MUTANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "repo"
        shutil.copytree(REPO, scratch, ignore=shutil.ignore_patterns(".git", ".gpu", "logs", "__pycache__"))
        text = (scratch / path).read_text()
        for old, new in edits:
            assert text.count(old) == 1, f"{name}: {old!r} is not in {path} exactly once: update the mutant"
            text = text.replace(old, new)
        (scratch / path).write_text(text)
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                              *(["tests"] if all_tests else tests)], cwd=scratch, capture_output=True, text=True)
    failed = sorted(set(re.findall(r"^FAILED (.+?)(?: - .*)?$", out.stdout, re.M)))
    return f"{name}: " + (f"{len(failed)} failed: {', '.join(failed)}" if failed else "SURVIVED")


if __name__ == "__main__":
    words = [a for a in sys.argv[1:] if not a.startswith("--")]
    chosen = [n for n in MUTANTS if not words or any(w.lower() in n.lower() for w in words)]
    survivors = 0
    for name in chosen:
        line = run(name, "--all-tests" in sys.argv)
        survivors += line.endswith("SURVIVED")
        print(line, flush=True)
    sys.exit(1 if survivors else 0)
