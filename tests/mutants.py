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
T = "tests/test_train_gpt.py"
MASKS = f"{T}::test_dense_and_block_masks_equal_brute_force"
SCHEDULES = f"{T}::test_schedules_follow_the_record"
GLOO = "tests/test_training.py::test_gloo_processes_equal_one_with_accumulation"
MUTANTS = {
    # the attention mask
    "document masking removed everywhere": ("train_gpt.py", [
        ("    return at[doc]", "    return torch.zeros_like(pos)")], [T]),
    "the non-starts write document 0's start": ("train_gpt.py", [
        ("torch.where(first, doc, pos.numel()), pos)", "torch.where(first, doc, 0), pos)")], [MASKS]),
    "mask_mod causal only (the block lists alone keep documents and window)": ("train_gpt.py", [
        ("        return mask_rule(q_idx, kv_idx, stored)", "        return mask_rule(q_idx, kv_idx, torch.zeros_like(stored))")],
        [MASKS, f"{T}::test_flex_and_sdpa_paths_equal_reference_attention"]),
    "window one token wider": ("train_gpt.py", [
        ("torch.arange(starts.numel(), device=starts.device) - window)",
         "torch.arange(starts.numel(), device=starts.device) - window - 1)")], [MASKS, REFERENCE]),
    "block masks' full blocks from the block of the latest first key (floor, not ceil)": ("train_gpt.py", [
        ("hi = (per_block[:, -1] + MASK_BLOCK - 1) // MASK_BLOCK", "hi = per_block[:, -1] // MASK_BLOCK")], [MASKS]),
    "block masks' kv lists miss the diagonal": ("train_gpt.py", [
        ("counts = [before + 1, ", "counts = [before.clamp(min=1), ")], [MASKS]),
    "paired heads' documents not interleaved": ("train_gpt.py", [
        ("    return (2 * starts).repeat_interleave(2)", "    return starts.repeat_interleave(2)")], [MASKS, REFERENCE]),
    "block masks ordered by argsort (compiled: a slow Triton sort)": ("train_gpt.py", [
        ("    last_full = torch.searchsorted(hi, blk, right=True) - 1",
         "    last_full = torch.sort(hi).values[torch.searchsorted(hi, blk, right=True) - 1] * 0 + torch.searchsorted(hi, blk, right=True) - 1")],
        [f"{T}::test_block_masks_are_built_without_sorts_reductions_or_matmuls"]),
    "window_attention handed k and v swapped": ("train_gpt.py", [
        ("return window_attention(*flat, mask.first, list(mask.tiles))[0].view(q.shape)",
         "return window_attention(flat[0], flat[2], flat[1], mask.first, list(mask.tiles))[0].view(q.shape)")],
        [f"{T}::test_window_mask_hands_window_attention_each_token_and_head"]),
    "window_attention's output read back with the batch's sequences swapped": ("train_gpt.py", [
        ("return window_attention(*flat, mask.first, list(mask.tiles))[0].view(q.shape)",
         "return window_attention(*flat, mask.first, list(mask.tiles))[0].view(q.shape).flip(0)")],
        [f"{T}::test_window_mask_hands_window_attention_each_token_and_head"]),
    # the model
    "QK-norm removed": ("train_gpt.py", [
        ("return rotary(norm(q), rot.cos, rot.sin, paired, rot.scale), rotary(norm(k), rot.cos, rot.sin, paired)",
         "return rotary(q, rot.cos, rot.sin, paired, rot.scale), rotary(k, rot.cos, rot.sin, paired)")], [REFERENCE, GOLDEN]),
    "rotary turned the other way": ("train_gpt.py", [
        ("(x1 * cos + x2 * sin, x2 * cos - x1 * sin)", "(x1 * cos - x2 * sin, x2 * cos + x1 * sin)")], [REFERENCE, GOLDEN]),
    "attention scale not applied to q": ("train_gpt.py", [
        ("return rotary(norm(q), rot.cos, rot.sin, paired, rot.scale),", "return rotary(norm(q), rot.cos, rot.sin, paired),")],
        [REFERENCE]),
    "YaRN keeps every frequency": ("train_gpt.py", [
        ("        freqs = freqs * (old / new + keep * (1 - old / new))\n", "")], [f"{T}::test_yarn_follows_its_formula", REFERENCE]),
    "paired heads at their token's position": ("train_gpt.py", [
        ("    return 2 * torch.arange(T, device=device)[:, None] + (torch.arange(heads, device=device) % 2)[None, :]",
         "    return torch.arange(T, device=device)[:, None] + 0 * torch.arange(heads, device=device)[None, :]")],
        [REFERENCE]),
    "key offset on every dim": ("train_gpt.py", [
        ("    still = j % (k.size(-1) // 2) >= k.size(-1) // 4", "    still = j >= 0")],
        [f"{T}::test_stationary_keys_take_their_predecessors_values", REFERENCE]),
    "attention gate after the output projection": ("train_gpt.py", [
        ("        if out_gate is not None:\n            y = y * out_gate.type_as(y)[..., None]\n"
         "        return sa[1] * mm(y.reshape(B, T, H * D), vo_w[1].mT)\n",
         "        y = sa[1] * mm(y.reshape(B, T, H * D), vo_w[1].mT)\n"
         "        return y if out_gate is None else (y.view(B, T, H, D) * out_gate[..., None]).view(B, T, H * D)\n")],
        [REFERENCE]),
    "v not scaled by its lambda": ("train_gpt.py", [
        ("        v = sa[0] * mm(x, vo_w[0]", "        v = 1 * mm(x, vo_w[0]")], [REFERENCE]),
    "value-embedding gate ignored": ("train_gpt.py", [
        ("            v = v + 2 * gate(ve_in, self.ve_gate_w)[..., None] * ve.view_as(v)", "            v = v + ve.view_as(v)")],
        [REFERENCE, f"{T}::test_attention_and_value_gates_scale_each_head"]),
    "paired-head value-embedding gate reads x[:12] (as before the master of 2026-05-27 v3)": ("train_gpt.py", [
        ("            ve_in = torch.cat([x[..., :VE_GATE_X],", "            ve_in = x if self.paired else torch.cat([x[..., :VE_GATE_X],")],
        [REFERENCE]),
    "x0 is the normed embedding, not the stream layer 0 gets (the record's in-place bigram add)": ("train_gpt.py", [
        ("        if self.gate is None:\n            x0 = first\n", "")], [REFERENCE]),
    "bigram sign table unused": ("train_gpt.py", [
        ("            bigram = bigram * self.bigram_sign_table[", "            bigram = bigram + 0 * self.bigram_sign_table[")],
        [REFERENCE]),
    "bigram sign row from the token alone": ("train_gpt.py", [
        ("torch.bitwise_xor(x[..., :-1], x[..., 1:]) % rows", "x[..., 1:] % rows")],
        [f"{T}::test_bigram_hash_equals_python_integers"]),
    "bigram added to the stream's last dims": ("train_gpt.py", [
        ("    return torch.cat([x[..., :y.size(-1)] + y, x[..., y.size(-1):]], dim=-1)",
         "    return torch.cat([x[..., :-y.size(-1)], x[..., -y.size(-1):] + y], dim=-1)")], [REFERENCE]),
    "FP8 MLP weights not refreshed after an optimizer step": ("train_gpt.py", [
        ("        for i in (i for i in stale if i in self.fp8):", "        for i in (i for i in stale if False):")],
        ["tests/test_training.py::test_fp8_mlp_weights_follow_each_optimizer_step"]),
    "FP8 MLP weight scale in fp32, not the record's bf16": ("train_gpt.py", [
        ("    scale = w.detach().abs().amax().clamp(min=1e-12) / E4M3_MAX",
         "    scale = w.detach().abs().amax().float().clamp(min=1e-12) / E4M3_MAX")],
        ["tests/test_training.py::test_fp8_mlp_weights_follow_each_optimizer_step"]),
    "FP8 MLP product not scaled by the input's amax": ("train_gpt.py", [
        ("torch.float8_e4m3fn), w_scale * amax / E4M3_MAX", "torch.float8_e4m3fn), w_scale * 1.0")],
        ["tests/test_training.py::test_fp8_mlp_is_the_records_fp8_product_with_bf16_grads"]),
    # the down projection in FP8 (2026-07-17_FP8DownProjection)
    "FP8 down: activation headroom 1.25 (the record kernel's default argument)": ("train_gpt.py", [
        ("FP8_DOWN_ACT_HEADROOM = 1.8", "FP8_DOWN_ACT_HEADROOM = 1.25")], ["tests/test_training.py::test_fp8_down_scales_follow_the_records_schedule"]),
    "FP8 down: the last pass's largest activation, not the step's": ("train_gpt.py", [
        ("down[3].copy_(torch.maximum(down[3], top))", "down[3].copy_(top)")], ["tests/test_training.py::test_fp8_down_scales_follow_the_records_schedule", "tests/test_training.py::test_fp8_down_is_the_records_fp8_product_with_bf16_grads"]),
    "FP8 down: delayed weight scales from the first step": ("train_gpt.py", [
        ("exact=step < FP8_DOWN_EXACT_STEPS)", "exact=False)")], ["tests/test_training.py::test_fp8_down_scales_follow_the_records_schedule"]),
    "FP8 down: weight headroom 1": ("train_gpt.py", [
        ("FP8_DOWN_WEIGHT_HEADROOM = 1.12", "FP8_DOWN_WEIGHT_HEADROOM = 1.0")], ["tests/test_training.py::test_fp8_down_scales_follow_the_records_schedule"]),
    "FP8 down: the weights' copy not remade after a step": ("train_gpt.py", [
        ("            held.copy_(fp8_down_weight(self.copies[i], scale))\n", "")], ["tests/test_training.py::test_fp8_down_scales_follow_the_records_schedule"]),
    "FP8 down: post not divided by its scale": ("train_gpt.py", [
        ("(post.float() * act_scale.reciprocal())", "post.float()")], ["tests/test_training.py::test_fp8_down_is_the_records_fp8_product_with_bf16_grads"]),
    "FP8 down: each rank its own activation scale": ("train_gpt.py", [
        ("    comm.all_max(amax)\n", "")],
        ["tests/test_training.py::test_fp8_down_activation_scales_are_the_largest_over_the_ranks"]),
    "FP8 down: on without the FP8 up projection": ("train_gpt.py", [
        ("        self.fp8_down = self.fp8_down and self.fp8_mlp", "        self.fp8_down = self.fp8_down")],
        ["tests/test_training.py::test_fp8_down_goes_with_the_fp8_up_projection"]),
    "FP8 down: the scales not in checkpoints": ("train_gpt.py", [
        ('self.register_buffer("fp8_down_scales", torch.ones(L, 4) if cfg.fp8_down else None)',
         'self.register_buffer("fp8_down_scales", torch.ones(L, 4) if cfg.fp8_down else None, persistent=False)')],
        ["tests/test_trust.py::test_fp8_down_scales_resume_bitwise"]),
    "FP8 MLP in eval too": ("train_gpt.py", [
        ("        if self.training and self.fc_fp8 is not None", "        if self.fc_fp8 is not None")],
        ["tests/test_training.py::test_fp8_mlp_is_the_records_fp8_product_with_bf16_grads"]),
    "MUDD after layer 9 weighs its own output by m, not 1 + m": ("train_gpt.py", [
        ("        x = (1 + r[..., 2:3]) * x +", "        x = r[..., 2:3] * x +")], [REFERENCE]),
    "MUDD's v addition with 2026-04-22's 1.15 on x0's": ("train_gpt.py", [
        ("        v_add = v[..., 0:1] * x0 +", "        v_add = 1.15 * v[..., 0:1] * x0 +")], [REFERENCE]),
    "MUDD at 2026-04-22's scale": ("train_gpt.py", [
        ("MUDD_SCALE = 0.1 ", "MUDD_SCALE = 0.2 / 3 ** 0.5 ")], [REFERENCE]),
    "the last layer's MUDD value gate without its 2": ("train_gpt.py", [
        ("        bias[0, :, 3] = 2 / MUDD_SCALE", "        bias[0, :, 3] = 0 / MUDD_SCALE")],
        [f"{T}::test_full_size_model_has_the_record_parameters"]),
    "MUDD's value-gate channels alternate heads, not halves": ("train_gpt.py", [
        ("m[..., 3].repeat_interleave(self.heads // 2, dim=-1)", "m[..., 3].repeat(1, 1, self.heads // 2)")], [REFERENCE]),
    "MUDD's last mix leaves out the skip's source": ("train_gpt.py", [
        ("second_last, ve[self.mudd_ve], skipped])", "second_last, ve[self.mudd_ve]])")], [REFERENCE]),
    "--generate does not say another version wrote the checkpoint": ("train_gpt.py", [
        ('other_train_gpt.py)" if ckpt["source_sha256"] != source_sha256() else "")',
         'other_train_gpt.py)" if False else "")')],
        ["tests/test_trust.py::test_checkpoints_with_the_right_keys_and_wrong_contents"]),
    "XSA's share without its tanh": ("train_gpt.py", [
        ("        xsa = torch.tanh(self.xsa_w)[:, None] if", "        xsa = self.xsa_w[:, None] if")], [REFERENCE]),
    "the MUDD gate's XSA shares without their tanh": ("train_gpt.py", [
        ("None if gates.xsa is None else torch.tanh(gates.xsa)[..., None]", "None if gates.xsa is None else gates.xsa[..., None]")],
        [REFERENCE]),
    "XSA's part along v over |v|, not |v|^2": ("train_gpt.py", [
        ("/ v.square().sum(-1, keepdim=True).clamp_min(1e-8)", "/ v.norm(dim=-1, keepdim=True).clamp_min(1e-4)")],
        [REFERENCE]),
    "XSA on paired heads too (their values interleaved)": ("train_gpt.py", [
        ('("--xsa_layers", cfg.xsa_layers if cfg.xsa else (), single,', '("--xsa_layers", cfg.xsa_layers if cfg.xsa else (), attn,')],
        ["tests/test_train_gpt.py::test_gate_and_dc_layouts_are_checked"]),
    "MUDD's last layer keeps a value gate of its own": ("train_gpt.py", [
        ("    return cfg.value_embeds[i] >= 0 and not (cfg.mudd and i == cfg.num_layers - 1)\n",
         "    return cfg.value_embeds[i] >= 0\n")], [f"{T}::test_full_size_model_has_the_record_parameters"]),
    "MUDD's layout not checked": ("train_gpt.py", [
        ("        if why:\n            raise UserError(f\"--mudd needs", "        if False:\n            raise UserError(f\"--mudd needs")],
        ["tests/test_trust.py::test_bad_settings_are_refused_in_one_line"]),
    "weight copies never remade after their matrices change": ("train_gpt.py", [
        ("        if stale:\n            torch._foreach_copy_", "        if False:\n            torch._foreach_copy_")],
        ["tests/test_training.py::test_weight_copies_train_bitwise_as_casting_in_forward"]),
    "matrices cast in forward though copies are kept": ("train_gpt.py", [
        ("    return copy if copy is not None and copy.dtype == x.dtype else getattr(module, name).type_as(x)",
         "    return getattr(module, name).type_as(x)")], ["tests/test_training.py::test_weight_copies_train_bitwise_as_casting_in_forward"]),
    "copies' grads summed at each other's offsets": ("train_gpt.py", [
        ("            self._hook_grads(i, [next(copies) for _ in b.params])",
         "            self._hook_grads(i, [next(copies) for _ in b.params][::-1])")], ["tests/test_training.py::test_weight_copies_train_bitwise_as_casting_in_forward"]),
    "fused MLP's backward: relu(pre)'s grad without its 2": ("train_gpt.py", [
        ("    return (2 * post.to(f).sqrt() * s.to(f)).to(s.dtype)", "    return (post.to(f).sqrt() * s.to(f)).to(s.dtype)")],
        ["tests/test_training.py::test_relu_square_mlp_op_has_the_rules_grads"]),
    "fused MLP's backward: post for relu(pre), not its square root": ("train_gpt.py", [
        ("    return (2 * post.to(f).sqrt() * s.to(f)).to(s.dtype)", "    return (2 * post.to(f) * s.to(f)).to(s.dtype)")],
        ["tests/test_training.py::test_relu_square_mlp_op_has_the_rules_grads"]),
    "fused MLP's backward: proj's grad from pre's grad, not post": ("train_gpt.py", [
        ("mm(dpre.mT, x2), mm(post.mT, g2), *[None]", "mm(dpre.mT, x2), mm(dpre.mT, g2), *[None]")],
        ["tests/test_training.py::test_relu_square_mlp_op_has_the_rules_grads"]),
    "fused MLP's forward: post is relu(pre), not squared": ("train_gpt.py", [
        ("    post = F.relu(s.to(f)).square().to(s.dtype)", "    post = F.relu(s.to(f)).to(s.dtype)")],
        ["tests/test_training.py::test_relu_square_mlp_op_has_the_rules_grads"]),
    "without the MLP kernel a GPU runs the ReLU^2 epilogue eagerly": ("train_gpt.py", [
        ("(compiled_relu_square_epilogue() if on_gpu(s) else relu_square_epilogue)", "relu_square_epilogue")],
        ["tests/test_training.py::test_without_the_mlp_kernel_a_gpu_compiles_the_relu_square_epilogue"]),
    "the compiled ReLU^2 epilogue squares nothing": ("train_gpt.py", [
        ("    return torch.compile(relu_square_epilogue, dynamic=False",
         "    return torch.compile(lambda s, post, act: relu_square_epilogue(s.abs().sqrt() * s.sign() if post is None "
         "else s, post, act), dynamic=False")],
        ["tests/test_training.py::test_without_the_mlp_kernel_a_gpu_compiles_the_relu_square_epilogue"]),
    "fused MLP's backward: two programs per multiprocessor that do not both fit": ("train_gpt.py", [
        ("(128, 128, 64, 8, 3, 4, 0, 2), (", "(128, 128, 64, 8, 3, 2, 0, 2), (")],
        ["tests/test_training.py::test_mlp_hopper_tiles_fit_the_shared_memory"]),
    "MUDD's backout bias left at zero": ("train_gpt.py", [
        ("        bias[1, 1, 1] = MUDD_BACKOUT_BIAS\n", "")], [f"{T}::test_full_size_model_has_the_record_parameters"]),
    "residual and output weights swapped": ("train_gpt.py", [
        ("            x = mix[0] * x + mix[1] * y + mix[4] * x0\n", "            x = mix[1] * x + mix[0] * y + mix[4] * x0\n")],
        [REFERENCE]),
    "late layers attend to x": ("train_gpt.py", [
        ("norm(x if attn_in is None else attn_in)", "norm(x)")],
        [REFERENCE, f"{T}::test_skip_backout_bigram_and_value_embeddings_follow_the_record"]),
    "bigram joins layer 0 twice": ("train_gpt.py", [
        ("x = block(x, x0, bigram if i > 0 else None,", "x = block(x, x0, bigram,")],
        [REFERENCE, f"{T}::test_skip_backout_bigram_and_value_embeddings_follow_the_record"]),
    "x0 left out of the injection": ("train_gpt.py", [
        ("            x = mix[0] * x + mix[1] * y + mix[4] * x0\n", "            x = mix[0] * x + mix[1] * y\n")],
        [REFERENCE, f"{T}::test_skip_backout_bigram_and_value_embeddings_follow_the_record"]),
    "bigram hash of the token alone": ("train_gpt.py", [
        ("torch.bitwise_xor(BIGRAM_MULS[0] * x[..., 1:], BIGRAM_MULS[1] * x[..., :-1])", "BIGRAM_MULS[0] * x[..., 1:]")],
        [f"{T}::test_bigram_hash_equals_python_integers", REFERENCE]),
    "smear mixes in the token itself": ("train_gpt.py", [
        ("x[:, 1:] + share * x[:, :-1]", "x[:, 1:] + share * x[:, 1:]")], [REFERENCE]),
    "no backout": ("train_gpt.py", [("        return x - backout * backout_x\n", "        return x\n")], [REFERENCE]),
    "skip gate ignores x0": ("train_gpt.py", [
        ("else 2 * gate(x0, self.skip_gate_w)", "else 2")], [REFERENCE]),
    # the MUDD gate and DC (2026-05-27-MuddGatedAndDC v3)
    "the MUDD gate's second MLP reads x0": ("train_gpt.py", [
        ("                coef.update(self.gate.coefficients(x, 1))", "                coef.update(self.gate.coefficients(x0, 1))")],
        [REFERENCE]),
    "the MUDD gate without its learned scale": ("train_gpt.py", [
        ("self.bias[j, :n], self.scale.type_as(x))", "self.bias[j, :n], GATE_SCALE_INIT)")],
        [REFERENCE]),
    "the MUDD gate's bigram and x0 shares swapped": ("train_gpt.py", [
        ('for i in own(inject) for kind in ("x0", "bigram")]', 'for i in own(inject) for kind in ("bigram", "x0")]')],
        [REFERENCE, f"{T}::test_full_size_model_has_the_record_parameters"]),
    "the gated output gates through a sigmoid": ("train_gpt.py", [
        ("        out_gate = gate(x, self.gate_w) if self.gate_w is not None else gates.out\n",
         "        out_gate = gate(x, self.gate_w) if self.gate_w is not None else gates.out and gates.out.sigmoid()\n")],
        [REFERENCE]),
    "the MUDD gate's skip weight unused": ("train_gpt.py", [
        ('                weight = coef["skip", i] if self.gate is not None', '                weight = 1.0 if self.gate is not None')],
        [REFERENCE]),
    "DC's window one token wider": ("train_gpt.py", [
        ('        masks["dc"] = first_visible(starts, dc_window - 1)', '        masks["dc"] = first_visible(starts, dc_window)')],
        [REFERENCE]),
    "DC's head mix not rms-normed": ("train_gpt.py", [
        ("    a = F.rms_norm(mix_in.float(), (H,), eps=1e-6).type_as(mix_in)", "    a = mix_in")],
        [f"{T}::test_dc_correction_equals_brute_force", REFERENCE]),
    "DC's output not scaled per head": ("train_gpt.py", [
        ("    return (mix_out.reshape(nb, n, H, 1).type_as(out) * out).reshape(B, T, H, D)", "    return out.reshape(B, T, H, D)")],
        [f"{T}::test_dc_correction_equals_brute_force", REFERENCE]),
    "DC's keys reach one block less far back": ("train_gpt.py", [
        ("    nb, back = B * T // n, DC_BACK // n", "    nb, back = B * T // n, DC_BACK // n - 1")],
        [f"{T}::test_dc_correction_equals_brute_force"]),
    "DC on the layers without it too": ("train_gpt.py", [
        ('        dc = (coef["dc_in", i], coef["dc_out", i], masks["dc"], self.dc_window) if ("dc_in", i) in coef else None',
         '        j = max(k[1] for k in coef if k[0] == "dc_in") if any(k[0] == "dc_in" for k in coef) else None\n'
         '        dc = (coef["dc_in", j], coef["dc_out", j], masks["dc"], self.dc_window) if j is not None and '
         'self.blocks[i].attn is not None and not self.blocks[i].paired else None')],
        [REFERENCE]),
    "value embeddings fed to the wrong layers": ("train_gpt.py", [
        ("ve[self.ve_of_layer[i]] if", "ve[self.ve_of_layer[i] - 1] if")],
        [f"{T}::test_skip_backout_bigram_and_value_embeddings_follow_the_record"]),
    "long and short windows swapped": ("train_gpt.py", [
        ("masks[self.paired, self.long_window]", "masks.get((self.paired, not self.long_window), masks[self.paired, self.long_window])")],
        [f"{T}::test_each_layer_gets_its_window_and_pairing"]),
    # the head
    "soft cap without its shift": ("train_gpt.py", [
        ("SOFTCAP, SOFTCAP_SHIFT, SOFTCAP_DIV = 23.0, 5.0, 7.5", "SOFTCAP, SOFTCAP_SHIFT, SOFTCAP_DIV = 23.0, 0.0, 7.5")],
        [REFERENCE, f"{T}::test_softcap_ce_equals_its_formula"]),
    "multi-token targets not shifted": ("train_gpt.py", [
        ("    terms = [(targets[(rows + k).clamp(max=N - 1)], ", "    terms = [(targets[rows.clamp(max=N - 1)], ")],
        [f"{T}::test_softcap_ce_equals_its_formula", REFERENCE]),
    "multi-token targets reach into the next sequence": ("train_gpt.py", [
        ("((rows % S < S - k) & (rows < N - k))", "(rows < N - k)")],
        [f"{T}::test_softcap_ce_keeps_targets_in_their_sequence"]),
    "the bf16 head's later chunks read the first chunk's targets": ("train_gpt.py", [
        ("                                                  prefix, row0=a)",
         "                                                  prefix, row0=0)")],
        [f"{T}::test_bf16_head_in_row_chunks_equals_the_formula"]),
    "the bf16 head's chunks compiled (one unrolled graph)": ("train_gpt.py", [
        ("@torch.compiler.disable  # traced, the loop", "# traced, the loop")],
        [f"{T}::test_compiled_bf16_head_runs_its_chunks_eagerly"]),
    "the bf16 head's weight grad of its last chunk alone": ("train_gpt.py", [
        ("        dw += mm(dz.mT, xc).float()", "        dw = mm(dz.mT, xc).float()")],
        [f"{T}::test_bf16_head_in_row_chunks_equals_the_formula"]),
    "a missing --resume file left to the GPU check": ("train_gpt.py", [
        ("    if cfg.resume and not os.path.isfile(cfg.resume):", "    if False:")],
        ["tests/test_trust.py::test_a_missing_checkpoint_is_named_before_the_gpu"]),
    "the allocator's retries never noted": ("train_gpt.py", [
        ("    if retries:\n        lines.append(log_line(note=\"memory_at_the_limit\"",
         "    if retries > 10**9:\n        lines.append(log_line(note=\"memory_at_the_limit\"")],
        ["tests/test_trust.py::test_the_memory_line_counts_the_allocators_retries_and_notes_them"]),
    "lm_head weights' FP8 scale 100x too fine": ("train_gpt.py", [
        ("HEAD_W_SCALE = 1.6 / 448", "HEAD_W_SCALE = 0.016 / 448")],
        ["tests/test_training.py::test_full_width_fp8_head_stays_within_its_scales_while_training"]),
    # the optimizer
    "Nesterov removed from NorMuon": ("train_gpt.py", [
        ("v = polar_express(grad.lerp(momentum_buf, momentum)).float()", "v = polar_express(momentum_buf).float()")], [T]),
    "NorMuon averages along the wrong side": ("train_gpt.py", [
        ("    return -1 if shape[-2] >= shape[-1] else -2", "    return -2 if shape[-2] >= shape[-1] else -1")], [T]),
    "NorMuon without the Frobenius rescale": ("train_gpt.py", [
        ("    return u * (v.norm(dim=(-2, -1), keepdim=True) / u.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))",
         "    return u")], [T]),
    "Adam bias correction removed": ("train_gpt.py", [
        ("torch.div(exp_avg_sq, 1 - betas[1] ** step, out=grad)", "torch.div(exp_avg_sq, 1, out=grad)"),
        ("out=denom).div_(1 - betas[0] ** step)", "out=denom)")], [T]),
    "weight decay not cautious": ("train_gpt.py", [
        ("    agree = step > 0 if strict else step >= 0", "    agree = step == step")], [T]),
    "divergence check blind to -inf (max alone)": ("train_gpt.py", [
        ("torch.stack(torch.aminmax(t)).isfinite()", "torch.stack((t.max(), t.max())).isfinite()")], [T]),
    "the optimizer's divergence verdict not renewed at an update": ("train_gpt.py", [
        ("            b.finite = finite(b.flat[:b.numel])\n", "")],
        ["tests/test_trust.py::test_a_non_finite_parameter_stops_the_run_at_that_step"]),
    "the FP8 head's logits by sequence leave the last sequence out": ("train_gpt.py", [
        ("for r in range(0, T, seq_len)", "for r in range(0, T - seq_len, seq_len)")],
        ["tests/test_training.py::test_fp8_head_close_to_bf16"]),
    "the FP8 head's sequences all read the first one's targets": ("train_gpt.py", [
        ("                        targets[rows], weights, HEAD_GRAD_SCALE", "                        targets[:seq_len], weights, HEAD_GRAD_SCALE")],
        ["tests/test_training.py::test_fp8_head_close_to_bf16"]),
    "Adam every step": ("train_gpt.py", [("    return step % 2 == 1\n", "    return True\n")], [SCHEDULES]),
    "embedding not tied to lm_head": ("train_gpt.py", [
        ("        if b is self.head and self.tied:  # the embedding's grad", "        if False:  # the embedding's grad")],
        [f"{T}::test_the_embedding_is_tied_to_lm_head_until_untied"]),
    "untie leaves the embedding's Adam state at zero": ("train_gpt.py", [
        ("            full[n:2 * n] = full[:n]\n", "")], [f"{T}::test_the_embedding_is_tied_to_lm_head_until_untied"]),
    "the embedding is never untied": ("train_gpt.py", [
        ("    if step == split_step(cfg) and trainer.opt.tied:", "    if False:")],
        ["tests/test_training.py::test_the_embedding_unties_at_its_step"]),
    "MLP output matrices at the input's lr": ("train_gpt.py", [
        ('"mlp_in": 1.0, "mlp_out": 2.0}', '"mlp_in": 1.0, "mlp_out": 1.0}')],
        [f"{T}::test_defaults_are_the_records"]),
    "q and k orthogonalized as whole matrices (before 2026-04-08_PairedHeadMuon)": ("train_gpt.py", [
        ("    return 2 if num_heads % 2 == 0 else 1\n", "    return num_heads\n")],
        [f"{T}::test_normuon_takes_q_and_k_by_head_pair_v_and_o_whole"]),
    "q's and k's head-pair matrices averaged per row, not per column": ("train_gpt.py", [
        ("    return -1 if shape[-2] >= shape[-1] else -2\n", "    return -1\n")],
        [f"{T}::test_normuon_takes_q_and_k_by_head_pair_v_and_o_whole"]),
    "one GPU's NorMuon batch orthogonalizes only its first matrix": ("train_gpt.py", [
        ("mine = min(k, len(b.params) - self.comm.rank * k)", "mine = min(1, len(b.params) - self.comm.rank * k)")], [GLOO]),
    "bf16 grads' fp32 sum keeps only the last micro-step": ("train_gpt.py", [
        ("    else:\n        acc += g\n", "    else:\n        acc.copy_(g)\n")], [GLOO]),
    "one NorMuon matrix per bucket on one GPU too": ("train_gpt.py", [
        ("per_rank = len(params) if comm.world == 1 else 1", "per_rank = 1")],
        ["tests/test_training.py::test_reduce_scatter_starts_during_backward"]),
    "checkpoints drop Adam's pending grads": ("train_gpt.py", [
        (".cpu() for s in self._adam_sums()] if self.steps % 2 else None", ".cpu() for s in self._adam_sums()] if False else None")],
        ["tests/test_trust.py::test_resume_appends_to_its_log_and_continues_bitwise"]),
    "warm-up's snapshot drops Adam's pending grads": ("train_gpt.py", [
        ('copy=True) for s in self._adam_sums()] if self.steps % 2 else None',
         'copy=True) for s in self._adam_sums()] if False else None')],
        ["tests/test_trust.py::test_resume_appends_to_its_log_and_continues_bitwise"]),
    "warm-up's snapshot shares the optimizer states' storage": ("train_gpt.py", [
        ('{name: shard.to("cpu", copy=True) for name, shard in b.state.items()}',
         '{name: shard.to("cpu") for name, shard in b.state.items()}')],
        ["tests/test_training.py::test_warmup_leaves_no_trace"]),
    "warm-up leaves its grads behind": ("train_gpt.py", [
        ("    trainer.opt.zero_grads()  # before the snapshot's pending grads go back\n", "")],
        ["tests/test_training.py::test_warmup_leaves_no_trace"]),
    "warm-up leaves the optimizer as its steps left it": ("train_gpt.py", [
        ("    trainer.opt.load_local_state(saved.optimizer)\n", "")],
        ["tests/test_training.py::test_warmup_leaves_no_trace"]),
    "warm-up's snapshot shares the weights' storage": ("train_gpt.py", [
        ('    return {k: v.detach().to("cpu", copy=True) for k, v', '    return {k: v.detach() for k, v')],
        ["tests/test_training.py::test_warmup_leaves_no_trace"]),
    # schedules
    "batch size constant": ("train_gpt.py", [
        ("    return cfg.batch_seqs[part(step, len(cfg.batch_seqs), cfg)]", "    return cfg.batch_seqs[-1]")], [SCHEDULES]),
    "lr multiplier of the first stage throughout": ("train_gpt.py", [("    lr = cfg.lr_stage_scales[part(step, len(cfg.lr_stage_scales), cfg)]", "    lr = cfg.lr_stage_scales[0]")],
        [SCHEDULES]),
    "Muon momentum never cools down": ("train_gpt.py", [("    if step > cooldown_from:", "    if False:")], [SCHEDULES]),
    "multi-token weight falls 3x too slowly in the first stage": ("train_gpt.py", [("[1.0, 0.5, 0.25 * (1 - t)]", "[1.0, 0.5, 0.25 * (1 - t / 3)]")], [SCHEDULES]),
    # data
    "loader not aligned to BOS": ("train_gpt.py", [("            start = self.starts[d]\n", "            start = self.starts[d] + 1\n")],
        ["tests/test_training.py::test_loader_packs_clipped_documents_and_splits_by_rank"]),
    "documents not clipped": ("train_gpt.py", [("start + max_doc_len,", "start + 10**9,")],
        ["tests/test_training.py::test_loader_packs_clipped_documents_and_splits_by_rank"]),
    "document clip 2048 from the start": ("train_gpt.py", [
        ("    return cfg.max_doc_len[part(step, len(cfg.max_doc_len), cfg)]", "    return max(cfg.max_doc_len)")],
        ["tests/test_train_gpt.py::test_schedules_follow_the_record"]),
    "lr floor of 2026-02-03": ("train_gpt.py", [("LR_FLOOR = 0.15", "LR_FLOOR = 0.1")],
        ["tests/test_train_gpt.py::test_schedules_follow_the_record", "tests/test_train_gpt.py::test_defaults_are_the_records"]),
    # compile, kernels' settings, errors, tools
    "whole-model compile done block by block": ("train_gpt.py", [("        if whole:\n", "        if False:\n")],
        ["tests/test_training.py::test_both_compile_scopes_compute_the_eager_step"]),
    "the stage bench's sampler reads only the main thread": ("records/bench/stagebench.py", [
        ("                if thread == me:\n", "                if thread != threading.main_thread().ident:\n")],
        ["tests/test_records.py::test_stack_sampler_times_every_thread"]),
    "the stage bench echoes --inductor instead of reading the config back": ("records/bench/stagebench.py", [
        ('settings.append(f"{key}={getattr(config, last)!r}")', "settings.append(setting)")],
        ["tests/test_records.py::test_stagebench_warm_only_writes_where_the_warm_up_went"]),
    "the Flex work count leaves out the full tiles": ("records/bench/flexwork.py", [
        ("tiles = (mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()).item()",
         "tiles = mask.kv_num_blocks.sum().item()")],
        ["tests/test_records.py::test_flexwork_counts_the_tiles_and_pairs_of_a_brute_force_mask"]),
    "the Flex work count gives paired-head layers every head": ("records/bench/flexwork.py", [
        ("(cfg.num_heads // 2 if paired else cfg.num_heads)", "cfg.num_heads")],
        ["tests/test_records.py::test_flexwork_counts_the_tiles_and_pairs_of_a_brute_force_mask"]),
    "the glue's bytes per step taken as one call's": ("records/bench/gluebw.py", [
        ("gb = {n: calls[n] * alone[n][1] for n in timed}", "gb = {n: alone[n][1] for n in timed}")],
        ["tests/test_records.py::test_gluebw_reads_a_real_profile_and_bounds_the_glue"]),
    "the glue's calls per step not taken from the profile's launches": ("records/bench/gluebw.py", [
        ("calls = {n: launches.get(n) or ms / alone[n][0]", "calls = {n: ms / alone[n][0]")],
        ["tests/test_records.py::test_gluebw_reads_a_real_profile_and_bounds_the_glue"]),
    "the glue's bound not scaled to the whole category": ("records/bench/gluebw.py", [
        ('"bound_ms": at_copy * glue_ms / covered if covered else 0.0', '"bound_ms": at_copy if covered else 0.0')],
        ["tests/test_records.py::test_gluebw_reads_a_real_profile_and_bounds_the_glue"]),
    "the log's environment leaves out the host CPU": ("train_gpt.py", [
        (', f"cpu {cpu_name()}, {cores} cores"]', "]")],
        ["tests/test_training.py::test_golden_loss_curve"]),
    "pointwise kernels timed at the first step again": ("train_gpt.py", [
        ("        inductor_config.triton.autotune_pointwise = False\n", "")],
        ["tests/test_training.py::test_both_compile_scopes_compute_the_eager_step"]),
    "the kernels' rehearsal started on CPUs and without compile too": ("train_gpt.py", [
        ('rehearsal = KernelRehearsal(trainer) if trainer.device.type == "cuda" and cfg.compile else None',
         "rehearsal = KernelRehearsal(trainer)")],
        ["tests/test_training.py::test_warmup_leaves_no_trace"]),
    "a failed kernel rehearsal leaves no note": ("train_gpt.py", [
        ("        if self.error is not None:\n            self.trainer.log(", "        if False:\n            self.trainer.log(")],
        ["tests/test_training.py::test_a_failed_kernel_rehearsal_is_one_log_note"]),
    "the loader reads only the first shard it is put in": ("train_gpt.py", [
        ('        if state["shard"] != self.shard:\n', "        if self.shard is None:\n")],
        ["tests/test_training.py::test_loader_positions_in_the_shard_in_memory_do_not_read_it_again"]),
    "a batch read ahead for another step is not put back": ("train_gpt.py", [
        ("        trainer.train_loader.load_state(ahead[1])\n", "        pass\n")],
        ["tests/test_training.py::test_each_step_trains_the_next_batch_though_read_ahead"]),
    "checkpoints record the data position after the batch read ahead": ("train_gpt.py", [
        ("    return trainer.ahead[1] if trainer.ahead is not None else trainer.train_loader.state()",
         "    return trainer.train_loader.state()")],
        ["tests/test_training.py::test_each_step_trains_the_next_batch_though_read_ahead", "tests/test_trust.py"]),
    "warm-up leaves its last batch read ahead": ("train_gpt.py", [
        ("    trainer.step, trainer.ahead = saved.step, None", "    trainer.step = saved.step")],
        ["tests/test_trust.py::test_resume_appends_to_its_log_and_continues_bitwise"]),
    "the loader bench's rank 0 keeps every sequence": ("records/bench/loaderbench.py", [
        ("mine = len(range(0, num_seqs, world))", "mine = num_seqs")],
        ["tests/test_records.py::test_loaderbench_times_each_stage_on_a_shard_the_trainer_reads"]),
    "the stage bench leaves Triton's compile patched": ("records/bench/stagebench.py", [
        ("            self.jit._do_compile = self.original\n", "            pass\n")],
        ["tests/test_records.py::test_kernel_compiles_times_each_threads_first_launches"]),
    "Hopper's Flex forward tiles never chosen": ("train_gpt.py", [
        ('choice == "auto" and tuple(capability) == HOPPER', 'choice == "auto" and False')],
        ["tests/test_trust.py::test_flex_tiles_fit_the_gpus_shared_memory"]),
    "profiler counts compiled kernels that fused a masked_fill as fills": ("train_gpt.py", [
        ('r"^(?!triton_).*([Mm]emcpy|', 'r"^.*([Mm]emcpy|')],
        ["tests/test_training.py::test_profiler_sorts_kernels_by_what_they_do"]),
    "profiler counts torch's copy kernels as other kernels": ("train_gpt.py", [
        ('r"^(?!triton_).*([Mm]emcpy|[Mm]emset|copy_kernel|[Ff]ill)"', 'r"^(?!triton_).*([Mm]emcpy|[Mm]emset|[Ff]ill)"')],
        ["tests/test_training.py::test_profiler_sorts_kernels_by_what_they_do"]),
    "profiler's idle gaps counted per stream, not over the streams merged": ("train_gpt.py", [
        ("        if stop > end:\n            end, before = stop, name", "        end, before = stop, name")],
        ["tests/test_training.py::test_idle_gaps_are_the_time_no_kernel_covers"]),
    "Polar Express's GEMM path takes one stack, not NorMuon's stacks of stacks": ("train_gpt.py", [
        ("    out = torch.baddbmm(*(t.reshape(-1, *t.shape[-2:]) for t in (c, a, b)), beta=beta, alpha=alpha)\n"
         "    return out.view(*a.shape[:-2], *out.shape[-2:])",
         "    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)")],
        ["tests/test_training.py::test_mm_add_takes_the_optimizers_stacks"]),
    "Polar Express rounds a X, B X and their sum each to bf16": ("train_gpt.py", [
        ("        return (beta * c.float() + alpha * (a.float() @ b.float())).bfloat16()",
         "        return beta * c + alpha * mm(a, b)")],
        ["tests/test_training.py::test_mm_add_rounds_once"]),
    "GPU out-of-memory shown as a traceback": ("train_gpt.py", [
        ("    if isinstance(e, torch.OutOfMemoryError):", "    if False:")], ["tests/test_trust.py"]),
    "help text with a bare %": ("train_gpt.py", [('.replace("%", "%%")', '')],
        ["tests/test_trust.py::test_help_lists_every_flag"]),
    # runs you can trust
    "a resumed run forgets its validations before the pause": ("train_gpt.py", [
        ('    trainer.vals = [tuple(v) for v in ckpt.get("vals", [])]\n', "")],
        ["tests/test_trust.py::test_resume_appends_to_its_log_and_continues_bitwise"]),
    "a resumed run forgets when it reached the target": ("train_gpt.py", [
        ('    trainer.target_ms = ckpt.get("target_ms")\n', "")],
        ["tests/test_trust.py::test_stop_at_pauses_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one"]),
    "the records tool calls a paused run that reached the target stopped early": ("records/tool.py", [
        ("not self.error and not self.paused", "not self.error")],
        ["tests/test_trust.py::test_stop_at_pauses_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one"]),
    "a checkpoint's hash not checked": ("train_gpt.py", [
        ('    if content_digest(ckpt["model"], ckpt["optimizer"]) != ckpt["content_sha256"]:', "    if False:")],
        ["tests/test_trust.py::test_checkpoints_are_checked_when_read"]),
    "unhealthy checkpoints called good": ("train_gpt.py", [
        ("    if healthy:\n        trainer.last_good_checkpoint", "    if True:\n        trainer.last_good_checkpoint")],
        ["tests/test_trust.py::test_a_run_that_does_not_learn_stops_naming_a_healthy_checkpoint_that_pruning_kept",
         "tests/test_trust.py::test_a_checkpoint_is_healthy_only_if_its_weights_are"]),
    "no lock per run": ("train_gpt.py", [("        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n", "        pass\n")],
        ["tests/test_trust.py::test_a_second_launch_of_a_live_run_is_refused"]),
    "an abandoned future left in the live lineage": ("train_gpt.py", [
        ("    later = sorted(s for s in checkpoint_files(folder, run_id) if s > step)", "    later = []")],
        ["tests/test_trust.py::test_a_resume_from_an_older_checkpoint_sets_the_later_ones_aside"]),
    "a half line left by a full disk": ("train_gpt.py", [("                os.ftruncate(fd, size)\n", "                pass\n")],
        ["tests/test_trust.py::test_a_full_disk_while_appending_to_the_log_is_one_line_and_no_half_line"]),
    "a train glob may reach the val shards": ("train_gpt.py", [("    if overlap:\n", "    if False:\n")],
        ["tests/test_trust.py::test_every_shard_is_checked_before_the_log"]),
    "only the first shard checked up front": ("train_gpt.py", [
        ("        for f in self.files:  # every shard now", "        for f in self.files[:1]:  # every shard now")],
        ["tests/test_trust.py::test_every_shard_is_checked_before_the_log"]),
    "SIGTERM not caught": ("train_gpt.py", [
        ("signal.signal(signal.SIGTERM, _on_sigterm)", "signal.getsignal(signal.SIGTERM)")],
        ["tests/test_trust.py::test_interrupts_and_sigterm_are_one_line"]),
    "zero learning rates called a divergence": ("train_gpt.py", [
        ("    if cfg.muon_lr == 0 and cfg.adam_lr == 0:\n", "    if False:\n")],
        ["tests/test_trust.py::test_learning_rates_too_low_to_learn_are_not_called_a_divergence"]),
    "plot draws nothing": ("records/tool.py", [
        ("        by_time.plot([t / 1000 for t in ms], losses, **kw)\n", ""),
        ("        by_step.plot(steps, losses, **kw)\n", "")], ["tests/test_records.py"]),
    "plot colours by folder, not by run": ("records/tool.py", [
        ('kw = dict(color=f"C{i % 10}"', 'kw = dict(color=f"C{folders.index(r.path.parent) % 10}"')], ["tests/test_records.py"]),
    "samples decoded with replacement characters": ("train_gpt.py", [
        ('    return enc.decode_bytes(tokens).decode("utf-8", errors="ignore")', "    return enc.decode(tokens)")],
        ["tests/test_generate.py"]),
    "a summary of proxy runs tested against FineWeb's 3.28": ("records/tool.py", [
        ("    if target is None and not all(reads_fineweb(r) for r in runs):", "    if False:")], ["tests/test_records.py"]),
    "a log that cannot be read is skipped in a statistic": ("records/tool.py", [
        ("    if problems:\n        raise ToolError(f\"refused: ", "    if False:\n        raise ToolError(f\"refused: ")],
        ["tests/test_records.py"]),
    # issue 64's rules and fixes
    "SIGTERM while torch imports ends the process silently": ("train_gpt.py", [
        ('HELD_SIGNALS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}',
         'HELD_SIGNALS = {signal.SIGINT: "interrupted"}')],
        ["tests/test_trust.py::test_ctrl_c_or_sigterm_while_torch_imports_is_one_line"]),
    "--profile_steps on CPU ignored without a word": ("train_gpt.py", [
        ('    if cfg.profile_steps and device.type != "cuda":', '    if False:')],
        ["tests/test_trust.py::test_profile_steps_on_cpu_say_the_profile_needs_cuda"]),
    "a resume compares the shard globs, not the shards": ("train_gpt.py", [
        ('               "stop_at", "train_files", "val_files", "eval_hellaswag")',
         '               "stop_at", "eval_hellaswag")')],
        ["tests/test_trust.py::test_the_same_shards_at_another_path_resume_with_a_note"]),
    "a resume compares only the train shards": ("train_gpt.py", [
        ('\n              or data_changes("--val_files", cfg.val_files, ckpt["data"]["val"], now["val"]))', ")")],
        ["tests/test_trust.py::test_the_same_shards_at_another_path_resume_with_a_note"]),
    "a fingerprint of the shard's first MiB only": ("train_gpt.py", [
        ("        f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))\n        digest.update(f.read())\n", "")],
        ["tests/test_trust.py::test_a_shard_changed_near_either_end_is_caught_by_its_fingerprint"]),
    "learning rates too low to learn called a divergence": ("train_gpt.py", [
        ("    if blew_up(trainer.model.parameters(), trainer.init_max_abs):", "    if True:")],
        ["tests/test_trust.py::test_learning_rates_too_low_to_learn_are_not_called_a_divergence"]),
    "a blown-up run called not learning": ("train_gpt.py", [
        ("    if blew_up(trainer.model.parameters(), trainer.init_max_abs):", "    if False:")],
        ["tests/test_trust.py::test_a_run_that_does_not_learn_stops_naming_a_healthy_checkpoint_that_pruning_kept"]),
    "a removed log or a read-only disk called a full disk": ("train_gpt.py", [
        ("    return {errno.ENOSPC: ", "    return {}.get(0, 'free disk space') or {errno.ENOSPC: ")],
        ["tests/test_trust.py::test_a_failed_log_write_names_the_cause_the_system_gave"]),
    "NorMuon's second moment decays at 0.95 whatever --muon_beta2 says": ("train_gpt.py", [
        ("momentum,\n                                cfg.muon_beta2)", "momentum,\n                                0.95)")],
        ["tests/test_train_gpt.py::test_normuon_uses_the_configured_second_moment_decay"]),
    "batch_for hands out the batch read ahead whatever the step": ("train_gpt.py", [
        ("    if ahead is not None and ahead[0] == step:", "    if ahead is not None:")],
        ["tests/test_training.py::test_a_batch_read_ahead_for_one_step_is_never_trained_by_another"]),
    "records/tool.py averages a final val of nan": ("records/tool.py", [
        ('        if not math.isfinite(self.final[1]):\n            return "diverged"\n', "")],
        ["tests/test_records.py::test_a_run_whose_final_val_is_not_finite_is_never_averaged"]),
    "data/check.py passes a shard without a document start": ("data/check.py", [
        ("    tokens = load_train_shard(path)", "    tokens = __import__('train_gpt').load_shard(path)")],
        ["tests/test_data.py::test_check_reports_bad_shards"]),
    "tokenize_text's --out under a file is a traceback": ("data/tokenize_text.py", [
        ("        args.out.mkdir(parents=True, exist_ok=True)\n        if not os.access(args.out, os.W_OK):",
         "        if False:")],
        ["tests/test_data.py::test_an_out_folder_under_a_file_is_one_line"]),
    "an offline download leaves the hub library's locks in --dir": ("data/cached_fineweb10B.py", [
        ("                shutil.rmtree(cache, ignore_errors=True)", "                pass")],
        ["tests/test_data.py::test_download_offline_fails_plainly_and_leaves_nothing"]),
    "an offline download tries the hub anyway": ("data/cached_fineweb10B.py", [
        ("    why = hub_unreachable()", "    why = ''")],
        ["tests/test_data.py::test_download_offline_fails_plainly_and_leaves_nothing"]),
    "an older version's checkpoint meets the layout checks first": ("train_gpt.py", [
        ("    if saved:  # another version's checkpoint, before its settings meet this version's checks\n"
         "        version_check(cfg.resume, *saved)\n", "")],
        ["tests/test_trust.py::test_checkpoints_with_the_right_keys_and_wrong_contents"]),
    # prefix-token prediction (2026-07-13_PrefixTokenPrediction), on by default (the master of 2026-08-01)
    "the prefix-token loss off by default": ("train_gpt.py", [
        ("    prefix_weight: float = H(0.25,", "    prefix_weight: float = H(0.0,")],
        [f"{T}::test_the_prefix_weight_follows_the_record_schedule"]),
    "the prefix token is the shortest prefix in the vocabulary": ("train_gpt.py", [
        ("for n in range(len(token) - 1, 0, -1) if token[:n] in ids), -1)", "for n in range(1, len(token)) if token[:n] in ids), -1)")],
        [f"{T}::test_prefix_tokens_are_the_longest_proper_prefixes_in_the_vocabulary"]),
    "the prefix weight stays on through the second stage": ("train_gpt.py", [
        ("    return cfg.prefix_weight * (1.0, 1 - t, 0.0)[k]", "    return cfg.prefix_weight * (1.0, 1.0, 0.0)[k]")],
        [f"{T}::test_the_prefix_weight_follows_the_record_schedule"]),
    "the prefix term's grad left out": ("train_gpt.py", [
        ("    for target, w in terms:\n        dz.scatter_add_",
         "    for target, w in terms[:len(terms) - (prefix is not None)]:\n        dz.scatter_add_")],
        [f"{T}::test_softcap_ce_adds_the_prefix_token_loss"]),
    "the FP8 head's backward one grad short (the prefix input's)": ("train_gpt.py", [
        ("grad_w * grad_loss, *[None] * 8", "grad_w * grad_loss, *[None] * 7")],
        ["tests/test_training.py::test_full_width_fp8_head_stays_within_its_scales_while_training"]),
    "the model never hands the head its prefix targets": ("train_gpt.py", [
        ("        prefix = None if self.prefix_table is None else self.prefix_table[targets]", "        prefix = None")],
        [f"{T}::test_the_model_hands_the_head_each_targets_prefix_token"]),
    # issue 63's features
    "HellaSwag scores the rows one token late": ("train_gpt.py", [
        ("            rows = norm(x[b, len(tokens) - n - 1:len(tokens) - 1]).bfloat16()",
         "            rows = norm(x[b, len(tokens) - n:len(tokens)]).bfloat16()")],
        ["tests/test_generate.py::test_hellaswag_scores_as_each_ending_alone_would"]),
    "HellaSwag's acc_norm by the sum": ("train_gpt.py", [
        ("key=lambda j: total[j] / lengths[j]) == label", "key=lambda j: total[j]) == label")],
        ["tests/test_generate.py::test_hellaswag_scores_as_each_ending_alone_would"]),
    "--eval_hellaswag never scores": ("train_gpt.py", [
        ("    if cfg.eval_hellaswag:\n        eval_hellaswag(trainer)\n", "")],
        ["tests/test_generate.py::test_eval_hellaswag_after_training_logs_the_final_weights_score"]),
    "--resume alone keeps this version's defaults": ("train_gpt.py", [
        ("    if known.resume:  # the run's own settings", "    if False:  # the run's own settings")],
        ["tests/test_trust.py::test_stop_at_pauses_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one"]),
    "a paused run does not say how to go on": ("train_gpt.py", [
        ('            print(f"go on with: {launch_command(trainer.comm.world)} --resume {trainer.last_checkpoint}", '
         'flush=True)', "            pass")],
        ["tests/test_trust.py::test_stop_at_pauses_with_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one"]),
    "summary averages runs of different settings": ("records/tool.py", [
        ("    groups = settings_groups(runs)\n    if len(groups) > 1:\n        lines = [",
         "    groups = settings_groups(runs)\n    if False:\n        lines = [")],
        ["tests/test_records.py::test_runs_of_different_settings_are_never_averaged_together"]),
    "summary averages one recipe's training times over its kernels": ("records/tool.py", [
        ("    if len(groups) == 1:\n        return mean_pm(times[0]",
         "    if True:\n        return mean_pm([r.final[2] / 1000 for r in done]")],
        ["tests/test_records.py::test_runs_of_different_settings_are_never_averaged_together"]),
    "compare times an arm that mixes kernels": ("records/tool.py", [
        ("    if mixed:\n        lines.append(f\"times not compared",
         "    if False:\n        lines.append(f\"times not compared")],
        ["tests/test_records.py::test_runs_of_different_settings_are_never_averaged_together"]),
    "summary does not look into a record's arm folders": ("records/tool.py", [
        ('        out += own or ([f for f in sorted(p.glob("*/*.txt"))', '        out += own or ([f for f in sorted(p.glob("*/*.none"))')],
        ["tests/test_records.py::test_runs_of_different_settings_are_never_averaged_together"]),
    "--generate --help fails for want of a checkpoint": ("train_gpt.py", [
        ('    if "-h" in argv or "--help" in argv:\n        parser.print_help()', '    if False:\n        parser.print_help()')],
        ["tests/test_generate.py::test_each_mode_has_its_help_and_the_main_help_names_them"]),
    "auto micro_batch ignores the GPU's free memory": ("train_gpt.py", [
        ("    fits = [b for b in divides if estimated_peak(cfg, b) <= PEAK_MARGIN * free]", "    fits = divides")],
        ["tests/test_train_gpt.py::test_auto_micro_batch_fits_the_gpus_free_memory"]),
    "weights grown 1000-fold never count as blown up": ("train_gpt.py", [
        ("    return largest > HEALTHY_GROWTH * init_max_abs", "    return False")],
        ["tests/test_trust.py::test_a_checkpoint_is_healthy_only_if_its_weights_are",
         "tests/test_trust.py::test_a_run_that_does_not_learn_stops_naming_a_healthy_checkpoint_that_pruning_kept"]),
    "summary groups runs by their seeds too": ("records/tool.py", [
        ('RUN_OWN = (set(RESUME_FREE) - {"train_files", "val_files"}) | {"seed", "compile", "compile_scope"}',
         'RUN_OWN = set(RESUME_FREE) - {"train_files", "val_files"}')],
        ["tests/test_records.py::test_runs_of_different_settings_are_never_averaged_together"]),
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
    if not failed and out.returncode not in (0, 5):  # the tests did not pass: pytest itself died (a signal)
        return f"{name}: pytest ended with exit code {out.returncode} before its summary"
    return f"{name}: " + (f"{len(failed)} failed: {', '.join(failed)}" if failed else "SURVIVED")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    words = [a for a in sys.argv[1:] if not a.startswith("--")]
    chosen = [n for n in MUTANTS if not words or any(w.lower() in n.lower() for w in words)]
    print(f"{len(chosen)} of {len(MUTANTS)} mutants, each in a scratch copy against "
          f"{'the whole suite' if '--all-tests' in sys.argv else 'the tests named beside it'}: a line as each ends",
          flush=True)
    survivors = 0
    for name in chosen:
        line = run(name, "--all-tests" in sys.argv)
        survivors += line.endswith("SURVIVED")
        print(line, flush=True)
    sys.exit(1 if survivors else 0)
