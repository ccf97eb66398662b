"""CPU tests of train_gpt.py's ops, model and optimizer math, each against an independent reference: a brute-force
mask, float64 attention, complex-number RoPE, YaRN and NorMuon written from their descriptions, an SVD polar
factor, torch.optim.Adam, a float64 forward pass of the whole model, and the default record's constants."""
import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import train_gpt as tg

REPO_ROOT = tg.Path(tg.__file__).resolve().parent
BOS = 50256  # GPT-2's <|endoftext|>, written out rather than taken from the code under test
BLOCK = 128


# ---- attention mask: brute force from the definition

def reference_mask(tokens: np.ndarray, window: int, paired: bool = False) -> np.ndarray:
    """Position by position: query q sees key k if k <= q, both lie in one document (documents start at
    <|endoftext|>) and q - k <= window (the record's FlashAttention window). Paired heads attend over a sequence
    twice as long, positions 2t and 2t + 1 belonging to token t."""
    doc = np.cumsum(tokens == BOS)
    if paired:
        doc = np.repeat(doc, 2)
    q, k = np.arange(len(doc))[:, None], np.arange(len(doc))[None, :]
    return (k <= q) & (doc[k] == doc[q]) & (q - k <= window)


def token_layouts(T: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 50000, T)
    layouts = {}
    t = base.copy()
    t[rng.random(T) < 0.01] = BOS
    t[T // 4:3 * T // 4] = 7  # one long document, so some blocks lie wholly inside one
    t[0] = BOS
    layouts["random"] = t
    t = base.copy()
    t[[0, BLOCK, 2 * BLOCK - 1, 3 * BLOCK - 1, 3 * BLOCK, T - BLOCK, T - 1]] = BOS  # on block edges, last in a block
    if T >= 6 * BLOCK:  # one token into a block: the next block sees all of that block but its first token
        t[4 * BLOCK + 1] = BOS
    layouts["block_edges"] = t
    t = base.copy()
    t[[BLOCK + 5]] = BOS  # starts inside a document, as a val sequence can
    layouts["starts_mid_document"] = t
    return layouts


def first_of(tokens: np.ndarray, window: int, paired: bool = False):
    starts = tg.document_starts(torch.from_numpy(tokens))
    return tg.first_visible(tg.interleaved_starts(starts) if paired else starts, torch.tensor(window))


def expand_block_mask(bm, T: int) -> torch.Tensor:
    """The token-level mask a BlockMask stands for: full blocks all visible, partial ones decided by mask_mod."""
    out = torch.zeros(T, T, dtype=torch.bool)
    for qb in range(T // BLOCK):
        for counts, idx, full in [(bm.full_kv_num_blocks, bm.full_kv_indices, True),
                                  (bm.kv_num_blocks, bm.kv_indices, False)]:
            for kb in idx[0, 0, qb, :counts[0, 0, qb]].tolist():
                rows, cols = slice(qb * BLOCK, (qb + 1) * BLOCK), slice(kb * BLOCK, (kb + 1) * BLOCK)
                assert not out[rows, cols].any(), "a block listed twice"
                q = torch.arange(qb * BLOCK, (qb + 1) * BLOCK)[:, None]
                k = torch.arange(kb * BLOCK, (kb + 1) * BLOCK)[None]
                out[rows, cols] = True if full else bm.mask_mod(0, 0, q, k)
    return out


CASES = [(1024, w, False) for w in (0, 127, 128, 300, 640)] + [(4096, w, False) for w in (1792, 2560)] + \
        [(512, w, True) for w in (0, 256, 641)] + [(1024, 1408, True)]


@pytest.mark.parametrize("T,window,paired", CASES)
def test_dense_and_block_masks_equal_brute_force(T, window, paired):
    for name, tokens in token_layouts(T, window).items():
        want = torch.from_numpy(reference_mask(tokens, window, paired))
        first = first_of(tokens, window, paired)
        assert torch.equal(tg.dense_attention_mask(first), want), name
        bm = tg.block_attention_mask(first)
        assert torch.equal(expand_block_mask(bm, len(want)), want), name
        # what backward walks, per key block the query blocks, against torch's own transpose of the kv layout
        ref = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                       BLOCK_SIZE=BLOCK)
        for counts, indices in [("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")]:
            ours_n, torch_n = getattr(bm, counts), getattr(ref, counts)
            assert ours_n.dtype == torch_n.dtype == torch.int32 and torch.equal(ours_n, torch_n), (name, counts)
            ours_i, torch_i = getattr(bm, indices), getattr(ref, indices)
            assert ours_i.dtype == torch.int32 and ours_i.shape == torch_i.shape
            for kb, n in enumerate(ours_n[0, 0].tolist()):  # the listed blocks; the rest is never read
                assert torch.equal(ours_i[0, 0, kb, :n], torch_i[0, 0, kb, :n]), (name, indices, kb)


def test_block_masks_are_built_without_sorts_reductions_or_matmuls():
    """Compiled, a sort becomes a Triton sort whose cold compile took the training graph from 51 to 115 s on an
    H200 (pytorch issue 182060); reductions over the blocks, fused with the block comparisons, failed inductor's
    codegen on torch 2.11; a matmul over the blocks is cubic in the 4096 blocks of a paired val sequence. The
    BlockMask's layouts come from elementwise ops and searchsorted."""
    from torch.fx.experimental.proxy_tensor import make_fx
    tokens = torch.from_numpy(token_layouts(1024, 3)["random"])
    build = lambda d, w: tg.block_attention_mask(tg.first_visible(d, w)).as_tuple()[2:10]  # noqa: E731
    graph = make_fx(build)(tg.document_starts(tokens), torch.tensor(300))
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "aten.searchsorted.Tensor" in ops
    banned = [op for op in ops if "sort" in op.replace("searchsorted", "") or "cumsum" in op or "mm" in op
              or op.startswith(("aten.sum", "aten.amax", "aten.any", "aten.matmul"))]
    assert not banned, banned


def reference_attention(q, k, v, mask):
    """Softmax attention in float64 over (T, heads, dim) with a (T, T) bool mask, at unit scale."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double())
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
@pytest.mark.parametrize("T,window", [(1024, 0), (1024, 300), (4096, 1792)])
def test_flex_and_sdpa_paths_equal_reference_attention(T, window):
    """Both ways attention() runs, FlexAttention with the BlockMask (the GPU path) and SDPA with the dense mask
    (the CPU path), against float64 attention with the brute-force mask."""
    gen = torch.Generator().manual_seed(window)
    tokens = token_layouts(T, window)["random"]
    first = first_of(tokens, window)
    q, k, v = (torch.randn(1, T, 2, 16, generator=gen) * 0.3 for _ in range(3))
    want = reference_attention(q[0], k[0], v[0], torch.from_numpy(reference_mask(tokens, window)))
    block_mask = tg.block_attention_mask(first)
    flex = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=1.0).transpose(1, 2)
    sdpa = tg.attention(q, k, v, tg.attention_mask(first))
    torch.testing.assert_close(flex[0].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa[0].double(), want, atol=1e-5, rtol=1e-5)


def test_window_mask_hands_window_attention_each_token_and_head(monkeypatch):
    """attention() with a WindowMask (the GPU path of --attn_kernel) gives window_attention the B sequences laid
    end to end, (B T, heads, head_dim), first as int32 and the launch, and reads its output back in q's shape,
    for plain and paired-head (interleaved) layouts: with the kernel played by brute-force attention over
    first[n] <= key <= n, it equals the dense path's SDPA; and on CPU attention_mask stays dense whatever the
    tiles. (The kernels themselves: tests/interpreted.py and the CUDA tests.)"""
    def brute_force(q, k, v, first, tiles):
        assert q.dim() == 3 and first.dtype == torch.int32 and first.numel() == q.size(0)
        assert tiles == list(tg.KernelSettings(attn_tiles=tg.ATTN_HOPPER_TILES).attn_launch())
        n = torch.arange(q.size(0))
        allowed = (n[None, :] <= n[:, None]) & (n[None, :] >= first.long()[:, None])
        return reference_attention(q, k, v, allowed).float(), None
    monkeypatch.setattr(tg, "window_attention", brute_force)
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 1024, 2, 16
    tokens = np.concatenate([token_layouts(T, 1)["random"], token_layouts(T, 2)["block_edges"]])
    for paired in (False, True):
        first = first_of(tokens.reshape(B, T), 100, paired)
        shape = (B, 2 * T, H // 2, D) if paired else (B, T, H, D)
        q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
        mask = tg.WindowMask(first.int(), tg.KernelSettings(attn_tiles=tg.ATTN_HOPPER_TILES).attn_launch())
        assert torch.equal(tg.attention_mask(first, mask.tiles), tg.dense_attention_mask(first))  # CPU: dense
        got = tg.attention(q, k, v, mask)
        assert got.shape == q.shape
        torch.testing.assert_close(got, tg.attention(q, k, v, tg.attention_mask(first)), atol=1e-5, rtol=1e-5)


# ---- the record's 11-layer layout (2026-01-19, value embeddings as of 2026-01-26), written out

RECORD_LONG = {3, 10}
RECORD_NO_ATTN = {6}
RECORD_PAIRED = {0, 2, 5, 9}
RECORD_VE = {1: 0, 2: 1, 8: 2, 9: 3, 10: 4}  # layer -> value-embedding table (2026-01-26: one each; 02-03: 1, 2)
RECORD_SKIP = (3, 6)                          # layer 3's output joins layer 6's input
RECORD_BACKOUT = 7
RECORD_DC_WINDOW = 112                        # 2026-05-27-MuddGatedAndDC v3: DC on layer 10 over 112 tokens
L = 11
STATIC = dict(mudd_gate=False, dc_layers=(), xsa_layers=(1, 3, 4, 7, 8, 10))  # the layout before 2026-05-27 v3


def record_layout_at_tiny_width(**over):
    args = ["--device", "cpu", "--seq_len", "512", "--val_seq_len", "512", "--val_tokens", "512",
            "--model_dim", "64", "--num_heads", "2", "--head_dim", "32", "--fp8_head", "0", "--fp8_mlp", "0",
            "--bigram_vocab", "3001"]
    cfg = tg.parse_args(args)
    assert cfg.num_layers == L and set(cfg.long_window_layers) == RECORD_LONG
    assert set(cfg.no_attn_layers) == RECORD_NO_ATTN and set(cfg.paired_head_layers) == RECORD_PAIRED
    assert {i: t for i, t in enumerate(cfg.value_embeds) if t >= 0} == RECORD_VE
    assert tuple(cfg.skip) == RECORD_SKIP and cfg.backout_layer == RECORD_BACKOUT
    return dataclasses.replace(cfg, **over)


def test_each_layer_gets_its_window_and_pairing(monkeypatch):
    """Long-window layers see the long window, the others the short one; paired layers attend over the
    interleaved sequence of twice the length, with its own document starts."""
    model = tg.GPT(record_layout_at_tiny_width())
    tokens = token_layouts(512, 0)["random"]
    seen = []
    real = tg.attention
    monkeypatch.setattr(tg, "attention", lambda q, k, v, mask, *a: seen.append(mask) or real(q, k, v, mask, *a))
    for short, long in [(0, 128), (192, 384), (640, 1408)]:
        seen.clear()
        idx = torch.from_numpy(tokens).int()
        model(idx, idx, torch.tensor([short, long]), torch.tensor([1.0, 0.5, 0.25, 0.25]))
        layers = [i for i in range(L) if i not in RECORD_NO_ATTN]
        assert len(seen) == len(layers)
        for layer, mask in zip(layers, seen):
            want = reference_mask(tokens, long if layer in RECORD_LONG else short, layer in RECORD_PAIRED)
            assert torch.equal(mask, torch.from_numpy(want)), (layer, short, long)


def test_skip_backout_bigram_and_value_embeddings_follow_the_record():
    """Stub blocks that add i+1 to the residual and record what they are handed: x0 weight 2 and bigram weight
    3 (the bigram table, 16 wide, filled with 0.25, no sign table), layer 0's input is x0, the normed embedding
    plus 0.75 on its first 16 dims (2026-05-20: the bigram joins the first quarter, and x0 with it), and each
    layer's injection 2 x0, plus 0.75 on the first 16 dims from layer 1 on (2026-03-06_SimplifyHC); layer 6
    gets layer 3's output through the skip; the layers after 7 attend to layer 7's output; tables filled with
    t+1 show which value embedding reached which layer; the output is the last layer's minus backout x layer
    7's (--mudd 0: MUDD's routing is the float64 reference's; without the MUDD gate, whose shares are too)."""
    cfg = record_layout_at_tiny_width(mudd=False, bigram_signs=0, bigram_dim=16, **STATIC)
    model = tg.GPT(cfg).float()  # an fp32 residual stream, so the offsets below are exact
    for t, e in enumerate(model.value_embeds):
        e.weight.data.fill_(t + 1)
    model.bigram_embed.weight.data.fill_(0.25)
    with torch.no_grad():
        model.x0_lambdas.fill_(2.0)
        model.bigram_lambdas.fill_(3.0)
        model.scalars[2 * L + 1] = 0.5   # backout
        model.scalars[2 * L + 2] = 0.0   # skip weight: 2 sigmoid(0) = 1, times the zero-init gate's 0.5
    calls = {}

    class Stub(nn.Module):
        def __init__(self, i, block):
            super().__init__()
            self.i, self.long_window, self.paired, self.attn = i, block.long_window, block.paired, block.attn

        def forward(self, x, x0, bigram, attn_in, mix, ve, masks, rot, sa, flex_options=None, skip=None, mudd=None,
                    gates=None):
            if skip is not None:
                x = x + skip[0] * skip[1]
            inject = mix[4] * x0 + (0 if bigram is None else torch.nn.functional.pad(mix[5] * bigram, (0, 48)))
            calls[self.i] = (x.clone(), attn_in, inject, None if ve is None else ve.float().mean().item())
            return x + (self.i + 1)

    model.blocks = nn.ModuleList(Stub(i, b) for i, b in enumerate(model.blocks))
    idx = torch.randint(0, 50257, (256,), dtype=torch.int32)
    out = model.hidden(idx, torch.tensor([128, 256]))
    first16 = (torch.arange(64) < 16).float()
    x0 = calls[0][0]  # layer 0's input
    assert ((x0 - 0.75 * first16).pow(2).mean(-1) - 1).abs().max() < 0.02  # less the bigram's share: rms-normed
    a, c, outputs = 1.0, 0.0, {}  # a layer's input is a * x0 + c
    for i in range(L):
        if i == RECORD_SKIP[1]:
            aj, cj = outputs[RECORD_SKIP[0]]
            a, c = a + 0.5 * aj, c + 0.5 * cj
        torch.testing.assert_close(calls[i][0], a * x0 + c, msg=f"layer {i}")
        torch.testing.assert_close(calls[i][2], 2 * x0 + (0.75 * first16 if i > 0 else 0.0), msg=f"layer {i}")
        if i > RECORD_BACKOUT:
            a7, c7 = outputs[RECORD_BACKOUT]
            torch.testing.assert_close(calls[i][1], a7 * x0 + c7, msg=f"layer {i}")
        else:
            assert calls[i][1] is None, i
        assert calls[i][3] == (RECORD_VE[i] + 1 if i in RECORD_VE else None), i
        c += i + 1
        outputs[i] = (a, c)
    a7, c7 = outputs[RECORD_BACKOUT]
    torch.testing.assert_close(out, (a - 0.5 * a7) * x0 + (c - 0.5 * c7))


# ---- the whole forward pass against a float64 reference written from the record's description

def ref_rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def ref_yarn(d: int, stages: list) -> tuple:
    """RoPE frequencies f_j = (1/1024)^(j/(d/4-1)) for j < d/4 and 0 for the other d/4 pairs; at each window
    growth old -> new (in 128-token blocks) each f_j is scaled by s + w (1 - s), s = old/new, w = the number of
    turns f_j makes over the old window, less 1, over 31, clamped to [0, 1]; the attention scale starts at 0.1
    and grows by 1 + 0.2 ln(new/old)."""
    f = torch.tensor([(1 / 1024) ** (j / (d // 4 - 1)) for j in range(d // 4)] + [0.0] * (d // 4),
                     dtype=torch.float64)
    scale = 0.1
    for old, new in zip(stages, stages[1:]):
        w = ((128 * old * f / (2 * math.pi) - 1) / 31).clamp(0, 1)
        f = f * (old / new + w * (1 - old / new))
        scale *= 1 + 0.2 * math.log(new / old)
    return f, scale


def ref_rope(x: torch.Tensor, f: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(T, heads, d): dims j and j+d/2 as one complex number turned by -pos * f_j; pos is (T, heads)."""
    d = x.size(-1)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * torch.exp(-1j * pos[..., None].double() * f)
    return torch.cat([z.real, z.imag], -1)


def ref_signs(ids: np.ndarray, rows: int) -> list:
    """Python ints: the sign table's row of each position, 0 at position 0, else (previous token xor token) mod
    rows (2026-05-20_BigramsSignTrick)."""
    return [0] + [(int(ids[i - 1]) ^ int(ids[i])) % rows for i in range(1, len(ids))]


def ref_params(model) -> dict:
    """The model's parameters in float64, leaves for autograd, and its bigram sign table (random data, no grad)."""
    P = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    P["bigram_sign_table"] = model.bigram_sign_table.double()
    return P


def ref_bigram(ids: np.ndarray, rows: int) -> list:
    """Python ints: position 0 gets row rows-1; position i ((36313 * token) xor (27191 * previous)) mod (rows-1)."""
    return [rows - 1] + [((36313 * int(ids[i])) ^ (27191 * int(ids[i - 1]))) % (rows - 1) for i in range(1, len(ids))]


def ref_dc(q, k, v, a, b, tokens, window):
    """Lightweight DC, brute force (record 2026-05-27-MuddGatedAndDC's post-only correction): per query t the keys
    of its document within window positions, itself included; per head h, P_h = softmax of q_h . k_h over them;
    A = sum_h (a_h / rms over heads of a) P_h; head h's correction b_h sum_j A_j v_h[j]. q carries the scale;
    (T, heads, dim) and (T, heads)."""
    visible = torch.from_numpy(reference_mask(tokens, window - 1))
    scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~visible, float("-inf"))
    a = a / a.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    A = torch.einsum("qh,hqk->qk", a, scores.softmax(-1))
    return b[..., None] * torch.einsum("qk,khd->qhd", A, v)


def test_dc_correction_equals_brute_force():
    """dc_correction's blocked product against ref_dc in float64, on two sequences side by side with documents
    on block edges and inside blocks, at DC's window (112), a short one and the longest (128); the grads of q,
    k, v and both mixes too."""
    gen = torch.Generator().manual_seed(3)
    layouts = token_layouts(512, 4)
    tokens = np.stack([layouts["block_edges"], layouts["random"]])
    H, D = 3, 16
    leaves = [torch.randn(2, 512, H, D, generator=gen, dtype=torch.float64) * s for s in (0.4, 0.4, 1.0)]
    leaves += [torch.randn(2, 512, H, generator=gen, dtype=torch.float64) for _ in range(2)]
    for window in (112, 5, 128):
        ins = [t.clone().requires_grad_() for t in leaves]
        first = tg.first_visible(tg.document_starts(torch.from_numpy(tokens)), window - 1)
        got = tg.dc_correction(*ins, first)
        ref_ins = [t.clone().requires_grad_() for t in leaves]
        want = torch.stack([ref_dc(*(t[b] for t in ref_ins), tokens[b], window) for b in range(2)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        R = torch.randn(want.shape, generator=gen, dtype=torch.float64)
        (got * R).sum().backward()
        (want * R).sum().backward()
        for x, y in zip(ins, ref_ins):
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)


def ref_attention(P, i, h, ve, tokens, window, heads, f, scale, v_add=None, ve_gate=None, gated=None):
    """Layer i's attention on its normed input h (T, dim), brute force: QK rms-normed then turned (paired heads:
    head j of token t at position 2t + j mod 2), q times the scale; keys of long-window layers take their
    predecessor's values in the dims RoPE leaves still; v times the layer's first attention scalar, plus the
    value embedding times 2 sigmoid of its gate, which reads the first 6 dims of h and of the value embedding
    (2026-02-03; on paired-head layers too, as 2026-05-27 v3's code); paired heads attend over heads 0..H/2-1 of
    token t at position 2t and the rest at 2t+1; each head's output times sigmoid of its gate, then the output projection times the
    layer's second attention scalar. gated: the MUDD gate's coefficients for this layer (2026-05-27 v3), where
    they replace XSA's constant shares and the sigmoid gates (layers without one are not scaled), and DC's
    correction joins the attention's output before XSA."""
    T, dim = h.shape
    D, paired = dim // heads, i in RECORD_PAIRED
    W = [*P[f"blocks.{i}.attn.qk_w"].reshape(2, dim, dim), *P[f"blocks.{i}.attn.vo_w"]]  # q, k, v, o
    sa = P["scalars"][2 * i:2 * i + 2]
    q, k, v = ((h @ W[j].T).view(T, heads, D) for j in range(3))
    pos = torch.arange(T)[:, None] * (2 if paired else 1) + (torch.arange(heads) % 2 if paired else 0)
    q, k = ref_rope(ref_rms(q), f, pos) * scale, ref_rope(ref_rms(k), f, pos)
    if i in RECORD_LONG and not paired:
        still = torch.tensor([f[j % (D // 2)] == 0 for j in range(D)])
        k = torch.where(still, torch.cat([k[:1], k[:-1]]), k)
    v = sa[0] * v
    if v_add is not None:  # MUDD's, on the last layer (2026-04-22)
        v = v + v_add
    if ve is not None and ve_gate is not None:  # MUDD's gate on the last layer
        v = v + ve_gate[..., None] * ve.view(T, heads, D)
    elif ve is not None:
        gate_in = torch.cat([h[:, :6], ve[:, :6]], dim=-1)
        v = v + 2 * torch.sigmoid(gate_in @ P[f"blocks.{i}.attn.ve_gate_w"].T)[..., None] * ve.view(T, heads, D)
    if paired:
        q, k, v = (t.reshape(2 * T, heads // 2, D) for t in (q, k, v))
    visible = torch.from_numpy(reference_mask(tokens, window, paired))
    scores = torch.einsum("qhd,khd->hqk", q, k).masked_fill(~visible, float("-inf"))
    y = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, heads, D)
    if gated is not None and "dc" in gated:
        y = y + ref_dc(q, k, v, *gated["dc"], tokens, RECORD_DC_WINDOW)
    xsa = torch.tanh(P[f"blocks.{i}.attn.xsa_w"]) if f"blocks.{i}.attn.xsa_w" in P else \
        torch.tanh(gated["xsa"]) if gated is not None and "xsa" in gated else None
    if xsa is not None:  # gated XSA (2026-05-07), the master's form: y - tanh(a) (y . v) / max(v . v, 1e-8) v
        dot, vv = torch.einsum("thd,thd->th", y, v), torch.einsum("thd,thd->th", v, v)
        y = y - (xsa * dot / vv.clamp_min(1e-8))[..., None] * v
    if gated is None:
        y = y * torch.sigmoid(h[:, :12] @ P[f"blocks.{i}.attn.gate_w"].T)[..., None]
    elif "out" in gated:
        y = y * gated["out"][..., None]
    return sa[1] * (y.reshape(T, dim) @ W[3].T)


def ref_gate(P: dict, x: torch.Tensor, j: int, heads: int) -> dict:
    """The MUDD gate's MLP j on x (T, dim), (gelu(x W1_j^T) W2_j^T + b_j) times the learned scale, unpacked as
    record 2026-05-27-MuddGatedAndDC v3's unpack_pre_mudd_gate / unpack_post_mudd_gate do at 6 heads, with H
    heads in place of 6: {layer: {kind: (T, H) or (T,)}}; "skip" under layer 6."""
    c = (ref_gelu(x @ P["gate.w_in"][j].T) @ P["gate.w_out"][j].T + P["gate.bias"][j]) * P["gate.scale"]
    H, out = heads, {}
    xsa_layers, out_layer, inject = ((1, 3), 3, (0, 1, 2, 3)) if j == 0 else ((4, 7), 10, (4, 5, 7, 8, 9))
    for n, layer in enumerate(xsa_layers):
        out.setdefault(layer, {})["xsa"] = c[:, n * H:(n + 1) * H]
    out.setdefault(out_layer, {})["out"] = c[:, 2 * H:3 * H]
    for n, layer in enumerate(inject):
        out.setdefault(layer, {}).update(x0=c[:, 3 * H + 2 * n], bigram=c[:, 3 * H + 2 * n + 1])
    if j == 1:
        out[6] = {"skip": c[:, 3 * H + 10]}
        out[10]["dc"] = (c[:, 3 * H + 11:4 * H + 11], c[:, 4 * H + 11:5 * H + 11])
    return out


def ref_hidden(P: dict, tokens: np.ndarray, short: int, long: int, stages: list, heads: int) -> torch.Tensor:
    """The record's 11 layers (2026-03-06_SimplifyHC's GPT.forward): x = embedding, each token plus smear x
    sigmoid(gate) x its predecessor's; x = x0 = rmsnorm(x) + bigram_0 B, B the bigram hash embedding times its
    sign row, on the first dims (2026-05-20_BigramsSignTrick);
    at each layer with attention x = ra_i x + pa_i attn(rmsnorm(input)) + x0w_i x0 (+ bigram_i B from layer 1
    on), where the input is x, or layer 7's output for the layers after it; layer 6 (no attention) instead
    adds 2 sigmoid(skip) sigmoid(gate of x0) x layer 3's output; then x = rm_i x + pm_i mlp(rmsnorm(x)), a
    ReLU^2 MLP; the output is the last layer's less backout x layer 7's. With MUDD (2026-04-22_MuddFormer v3's
    forward, when P has its weights): see ref_mudd_weights; no backout scalar. With the MUDD gate (2026-05-27
    v3, when P has its weights): ref_gate on x0 before layer 0 and on the stream entering layer 4 gives x0's
    and the bigram's shares per token, the skip's weight (times sigmoid(skip), no gate of x0) and the heads'
    coefficients (ref_attention's gated); x0 is the stream before the bigram joins it, MUDD's x0 after."""
    ids = torch.from_numpy(tokens).long()
    s = P["scalars"]
    mudd, gated = "mudd.w_in" in P, "gate.w_in" in P
    smear, backout, skip = s[2 * L], None if mudd else s[2 * L + 1], s[-1]
    resid, post = P["resid_lambdas"], P["post_lambdas"]
    if not gated:
        x0w, bigram_w = P["x0_lambdas"], P["bigram_lambdas"]
    x = P["embed.weight"][ids]
    x = torch.cat([x[:1], x[1:] + smear * torch.sigmoid(x[1:, :12] @ P["smear_gate_w"].T) * x[:-1]])
    x = ref_rms(x)
    table = P["bigram_sign_table"]
    bigram = P["bigram_embed.weight"][ref_bigram(tokens, P["bigram_embed.weight"].size(0))] * \
        table[ref_signs(tokens, table.size(0))]
    bigram = torch.cat([bigram, bigram.new_zeros(len(ids), x.size(1) - bigram.size(1))], dim=1)  # first dims only
    if gated:  # the shares as per-token columns
        g = ref_gate(P, x, 0, heads)
        x0w = {i: c["x0"][:, None] for i, c in g.items() if "x0" in c}
        bigram_w = {i: c["bigram"][:, None] for i, c in g.items() if "bigram" in c}
        x0, xm = x, x + bigram_w[0] * bigram  # 2026-05-27 v3: x = x0.clone(), then the bigram joins x alone
        x = xm
    else:
        g = {}
        x = x0 = xm = x + bigram_w[0] * bigram  # the record's in-place add: its x0 (and MUDD's) is this stream
    f, scale = ref_yarn(x.size(-1) // heads, stages)
    outputs, last = {}, None  # last: what MUDD after layer 9 makes for layer 10
    for i in range(L):
        if gated and i == 4:
            g.update(ref_gate(P, x, 1, heads))
            for j in (4, 5, 7, 8, 9):
                x0w[j], bigram_w[j] = g[j]["x0"][:, None], g[j]["bigram"][:, None]
        if i == RECORD_SKIP[1]:
            gate = torch.sigmoid(skip) * g[6]["skip"][:, None] if gated else \
                2 * torch.sigmoid(skip) * torch.sigmoid(x0[:, :12] @ P["skip_gate_w"].T)
            x = x + gate * outputs[RECORD_SKIP[0]]
        if i not in RECORD_NO_ATTN:
            ve = P[f"value_embeds.{RECORD_VE[i]}.weight"][ids] if i in RECORD_VE else None
            window = long if i in RECORD_LONG else short
            h = ref_rms(outputs[RECORD_BACKOUT] if i > RECORD_BACKOUT else x)
            coefs = {k: v for k, v in g.get(i, {}).items() if k in ("xsa", "out", "dc")} if gated else None
            if last is None:
                y = ref_attention(P, i, h, ve, tokens, window, heads, f, scale, gated=coefs)
                x = resid[i, 0] * x + post[i, 0] * y + x0w[i] * x0 + (bigram_w[i] * bigram if i > 0 else 0)
            else:
                y = ref_attention(P, i, h, ve, tokens, window, heads, f, scale, last["v"], last["ve_gate"], coefs)
                x = last["ra"] * x + last["pa"] * y + (last["x0"] * xm + last["big"] * bigram)
        y = torch.relu(ref_rms(x) @ P[f"blocks.{i}.mlp.fc_w"].T).square() @ P[f"blocks.{i}.mlp.proj_w"]
        x = (resid[i, 1] * x + post[i, 1] * y) if last is None else (last["rm"] * x + last["pm"] * y)
        outputs[i] = x
        if mudd and i == L - 2:  # layer 9: sources x0, h7 and its own output
            m = ref_mudd_weights(P, x, 0)  # (T, channel, column)
            last = dict(v=(m[:, 0, 0:1] * xm + m[:, 0, 1:2] * outputs[7] + m[:, 0, 2:3] * x).view(
                len(ids), heads, -1), ve_gate=m[:, :, 3].repeat_interleave(heads // 2, dim=1),
                ra=m[:, 0, 4:5], pa=m[:, 0, 5:6], rm=m[:, 1, 4:5], pm=m[:, 1, 5:6], x0=m[:, 0, 6:7], big=m[:, 0, 7:8])
            x = (1 + m[:, 1, 2:3]) * x + m[:, 1, 0:1] * xm + m[:, 1, 1:2] * outputs[7]
    if not mudd:
        return x - backout * outputs[RECORD_BACKOUT]
    m = ref_mudd_weights(P, x, 1)[:, 1, :5]  # after layer 10: x0, h7, h9, layer 1's value embedding, h3
    sources = [xm, outputs[7], outputs[9], P["value_embeds.0.weight"][ids], outputs[3]]
    return x + sum(m[:, k:k + 1] * src for k, src in enumerate(sources))


def ref_mudd_weights(P: dict, x: torch.Tensor, j: int) -> torch.Tensor:
    """MUDD's per-token weights from MLP j on x (T, dim): (gelu(x W1_j^T) W2_j + b_j) 0.1 (2026-05-27 v3's
    _mudd_scale), (T, 2, 8)."""
    h = ref_gelu(x @ P["mudd.w_in"][j].T)
    return (torch.einsum("td,dcl->tcl", h, P["mudd.w_out"][j]) + P["mudd.bias"][j]) * 0.1


def ref_gelu(u: torch.Tensor) -> torch.Tensor:
    """gelu(u) = u Phi(u), the normal CDF Phi by erf."""
    return u * 0.5 * (1 + torch.erf(u / 2 ** 0.5))


def randomized_record_model(seed: int, **over) -> "tg.GPT":
    """The record's layout at width 64 in fp32, every parameter random and non-zero, so that the zero-initialised
    paths (output projections, gates, value and bigram embeddings, MUDD's output weights) and every scalar take
    part."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the bigram sign table, a buffer drawn at init
    model = tg.GPT(record_layout_at_tiny_width(**over)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "embed" in name or "head" in name or p.dim() == 0 else 1.5 * p.size(-1) ** -0.5
            if name in ("scalars", "x0_lambdas", "resid_lambdas", "post_lambdas", "bigram_lambdas", "gate.scale"):
                p.copy_(torch.rand(p.shape, generator=gen) * 0.6 + 0.4)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


@pytest.mark.parametrize("short,long,stages,heads,over", [(0, 300, [1], 2, {}), (192, 384, [3, 7, 11], 4, {}),
                                                         (192, 384, [3, 7], 2, dict(STATIC, mudd=False)),
                                                         (128, 256, [2, 3], 2, STATIC)])
def test_model_equals_float64_reference(short, long, stages, heads, over):
    """Hidden states, the multi-token loss with the head, and the grads of every parameter against ref_hidden, a
    float64 forward pass written from the record's description (it shares no code with train_gpt.py but the
    parameter names). At fp32 the model is exact to rounding (1e-5); its head is a bf16 matmul, as the record's,
    so the reference rounds the head's operands and logits to bf16 too."""
    model = randomized_record_model(len(stages), num_heads=heads, head_dim=64 // heads, **over)
    model.rotary.set_stages(stages)
    tokens = token_layouts(513, 0)["random"]
    idx, targets = tokens[:-1], tokens[1:]
    P = ref_params(model)
    R = torch.randn(512, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    windows = torch.tensor([short, long])
    want = ref_hidden(P, idx, short, long, stages, heads=heads)
    got = model.hidden(torch.from_numpy(idx).int(), windows)[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    (want * R).sum().backward()
    (got.double() * R).sum().backward()
    checked = [n for n, p in model.named_parameters() if n != "head_w"]
    assert len(checked) > 50
    largest = max(P[name].grad.norm() for name in checked)
    for name in checked:  # q and k of a layer that sees only itself (short window 0) take no grad
        g, ref = dict(model.named_parameters())[name].grad.double(), P[name].grad
        # XSA's shares (and the gate's scale, whose grad sums theirs): where a head sees only its own token, y = v
        # and their grads are sums of terms that cancel, 5e-4 apart in fp32 (the model in float64: 1e-5, the
        # same function); the rest within 2.5e-4 (the last layer's MLP 1.7e-4 at most, in float64 5e-6)
        tol = 1e-3 if name.endswith("xsa_w") or name == "gate.scale" else 2.5e-4
        assert (g - ref).norm() < (tol * ref.norm() if ref.norm() > 0 else 1e-6 * largest), name
    w = [1.0, 0.5, 0.25, 0.25]  # the next 3 tokens' and the prefix token's
    want_loss, want_next = ref_head_losses(P, want, targets, w, model.prefix_table)
    loss, next_token = model(torch.from_numpy(idx).int(), torch.from_numpy(targets).int(), windows,
                             torch.tensor(w))
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert next_token.item() == pytest.approx(want_next.item(), rel=1e-5)


def ref_head_losses(P: dict, hidden: torch.Tensor, targets: np.ndarray, w: list, prefix_table=None):
    """The head on one sequence: z = rmsnorm(hidden) @ head_w.T in bf16, c = 23 sigmoid((z + 5) / 7.5); the
    next 3 tokens' losses weighted by w (those past the sequence's end left out), with prefix_table (each id's
    prefix token or -1) w[3] times the next token's prefix token's where it has one; and the next token's."""
    z = (ref_rms(hidden.detach()).bfloat16().double() @ P["head_w"].detach().bfloat16().double().T).bfloat16().double()
    c = 23 * torch.sigmoid((z + 5) / 7.5)
    lse, t, T = torch.logsumexp(c, -1), torch.from_numpy(targets).long(), len(targets)
    loss = sum(w[k] * (lse[:T - k] - c[torch.arange(T - k), t[k:]]).sum() for k in range(3))
    if prefix_table is not None:
        rows = torch.nonzero(prefix_table[t] >= 0).flatten()
        assert len(rows) > T // 3
        loss = loss + w[3] * (lse[rows] - c[rows, prefix_table[t[rows]]]).sum()
    return loss, (lse - c[torch.arange(T), t]).sum()


def test_sequences_side_by_side_equal_each_alone():
    """One forward pass over 2 sequences (--micro_batch 2) against ref_hidden of each alone. The second starts
    inside a document, so its first tokens would see the first sequence's last document, and its first token
    would smear, hash and shift the first's last one, were the sequences not kept apart; the multi-token loss
    of the first's last tokens must not take the second's first tokens as targets. The grads are those of the
    sum over both."""
    model = randomized_record_model(5)
    model.rotary.set_stages([3, 7])
    seqs = [token_layouts(385, 0)["random"], token_layouts(385, 1)["starts_mid_document"]]
    idx, targets = np.stack([s[:-1] for s in seqs]), np.stack([s[1:] for s in seqs])
    P = ref_params(model)
    R = torch.randn(2, 384, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    windows = torch.tensor([192, 384])
    want = [ref_hidden(P, idx[b], 192, 384, [3, 7], heads=2) for b in range(2)]
    got = model.hidden(torch.from_numpy(idx).int(), windows)
    assert got.shape == (2, 384, 64)
    for b in range(2):
        torch.testing.assert_close(got[b].double(), want[b], rtol=1e-5, atol=1e-5 * want[b].abs().max().item())
    sum((want[b] * R[b]).sum() for b in range(2)).backward()
    (got.double() * R).sum().backward()
    for name, p in model.named_parameters():  # fp32 rounding, as in test_model_equals_float64_reference (2.6e-4)
        if name != "head_w":
            assert ((p.grad.double() - P[name].grad).norm() / P[name].grad.norm()).item() < 4e-4, name
    w = [1.0, 0.5, 0.25, 0.25]
    wants = [ref_head_losses(P, want[b], targets[b], w, model.prefix_table) for b in range(2)]
    loss, next_token = model(torch.from_numpy(idx).int(), torch.from_numpy(targets).int(), windows, torch.tensor(w))
    assert loss.item() == pytest.approx(sum(x[0].item() for x in wants), rel=1e-5)
    assert next_token.item() == pytest.approx(sum(x[1].item() for x in wants), rel=1e-5)


# ---- RoPE, YaRN, the bigram hash, the key offset

def test_yarn_follows_its_formula():
    for stages in ([1], [3, 7, 11, 13], [2, 5]):
        f, scale = tg.yarn(128, stages)
        want_f, want_scale = ref_yarn(128, stages)
        torch.testing.assert_close(f.double(), want_f, rtol=1e-6, atol=0)
        assert scale == pytest.approx(want_scale, rel=1e-12)
    # the record's stages keep the fastest frequency, slow the slowest by 3/13 in all, and raise the scale 32%
    f, scale = tg.yarn(128, [3, 7, 11, 13])
    base, _ = tg.yarn(128, [3])
    assert f[0] == base[0] and f[31] / base[31] == pytest.approx(3 / 13, rel=1e-6) and f[32:].eq(0).all()
    assert scale == pytest.approx(0.13178, abs=1e-5)


@pytest.mark.parametrize("paired", [False, True])
def test_rotary_equals_complex_rotation(paired):
    """RoPE as the record describes it: dims j and j+d/2 form a complex number rotated by -pos*f_j (f from
    YaRN), the position of paired heads 2t + head mod 2; q also times the attention scale."""
    T, H, d = 300, 4, 32
    x = torch.randn(1, T, H, d, dtype=torch.float64)
    rot = tg.Rotary(d, 2 * T)
    rot.set_stages([3, 7])
    f, scale = ref_yarn(d, [3, 7])
    pos = torch.arange(T)[:, None] * (2 if paired else 1) + (torch.arange(H) % 2 if paired else 0) * torch.ones(1, H)
    want = ref_rope(x[0], f, pos)
    got = tg.rotary(x.float(), rot.cos, rot.sin, paired)
    torch.testing.assert_close(got[0].double(), want, atol=1e-4, rtol=1e-4)
    q, k = tg.norm_rotary_qk(torch.cat([x, x], dim=2).float(), rot, paired)
    torch.testing.assert_close(q[0].double(), ref_rope(ref_rms(x[0]), f, pos) * scale, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k[0].double(), ref_rope(ref_rms(x[0]), f, pos), atol=1e-4, rtol=1e-4)


def test_bigram_hash_equals_python_integers():
    ids = np.concatenate([np.random.default_rng(0).integers(0, 50304, 1000), [50303, 50303, 0, 50256]])
    for rows in (5 * 50304, 3001):
        got = tg.bigram_hash(torch.from_numpy(ids).int(), rows)
        assert got.dtype == torch.int32 and got.tolist() == ref_bigram(ids, rows)
    for rows in (8192, 1000):  # the sign table's rows, by sequence: each one's position 0 takes row 0
        got = tg.bigram_sign_rows(torch.from_numpy(np.stack([ids, ids[::-1]])).int(), rows)
        assert got.tolist() == [ref_signs(ids, rows), ref_signs(ids[::-1], rows)]


def test_stationary_keys_take_their_predecessors_values():
    k = torch.randn(1, 50, 3, 32)
    got = tg.shift_stationary_keys(k)
    f, _ = ref_yarn(32, [1])
    for d in range(32):
        want = torch.cat([k[:, :1, :, d], k[:, :-1, :, d]], 1) if f[d % 16] == 0 else k[..., d]
        assert torch.equal(got[..., d], want), d


# ---- the head: soft cap, multi-token loss

def ref_head(z: torch.Tensor, targets: torch.Tensor, w: list, prefix: torch.Tensor = None, wp: float = 0.0):
    """float64 autograd of the multi-token loss of c = 23 sigmoid((z + 5) / 7.5) and the next-token loss; with
    prefix (each row's next token's prefix token, -1 for none), plus wp times the cross-entropy against it
    (record 2026-07-13_PrefixTokenPrediction)."""
    zz = z.double().requires_grad_()
    c = 23 * torch.sigmoid((zz + 5) / 7.5)
    lse, T = torch.logsumexp(c, -1), len(targets)
    rows = [lse[:T - k] - c[torch.arange(T - k), targets[k:]] for k in range(len(w))]
    loss = sum(w[k] * torch.nn.functional.pad(rows[k], (0, k)) for k in range(len(w)))
    if prefix is not None:
        loss = loss + torch.where(prefix >= 0, wp * (lse - c[torch.arange(T), prefix.clamp(min=0)]), 0.0)
    loss.sum().backward()
    return loss.detach(), rows[0].detach(), zz.grad


@pytest.mark.parametrize("w", [[1.0, 0.5, 0.25], [1.0, 0.2, 0.0], [1.0, 0.0, 0.0]])
def test_softcap_ce_equals_its_formula(w):
    """Per-row losses and dloss/dz against float64 autograd; the FP8 path's grad is e5m2 in units of
    HEAD_GRAD_SCALE (2 mantissa bits: about 5% rms rounding), transposed copy included; the rule the bf16
    path runs (softcap_ce_parts) returns the exact grad."""
    gen = torch.Generator().manual_seed(0)
    z = (torch.randn(192, 384, generator=gen) * 20).bfloat16()
    targets = torch.randint(0, 384, (192,), generator=gen)
    weights = torch.tensor(w)
    want_loss, want_ntp, want_grad = ref_head(z, targets, w)
    loss, ntp, g = tg.softcap_ce_rows(z, targets, weights, tg.HEAD_GRAD_SCALE)
    g_t = tg.transposed(g)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ntp.double(), want_ntp, atol=1e-5, rtol=1e-5)
    exact = want_grad / tg.HEAD_GRAD_SCALE
    assert ((g.double() - exact).norm() / exact.norm()).item() < 0.06
    assert g.dtype == torch.float8_e5m2 and torch.equal(g_t.float(), g.float().T) and g_t.is_contiguous()
    loss, ntp, dz = tg.softcap_ce_parts(z, targets, weights)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ntp.double(), want_ntp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dz.double(), want_grad, atol=1e-6, rtol=1e-5)


def test_softcap_ce_adds_the_prefix_token_loss():
    """With prefix targets (a third of the rows without one) and a 4th weight, the per-row losses and grads
    against ref_head's float64 autograd, on both the rows function (the FP8 path) and the rule (the bf16 path)."""
    gen = torch.Generator().manual_seed(1)
    z = (torch.randn(192, 384, generator=gen) * 20).bfloat16()
    targets = torch.randint(0, 384, (192,), generator=gen)
    prefix = torch.where(torch.rand(192, generator=gen) < 1 / 3, -1, torch.randint(0, 384, (192,), generator=gen))
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25])
    want_loss, want_ntp, want_grad = ref_head(z, targets, [1.0, 0.5, 0.25], prefix, 0.25)
    loss, ntp, g = tg.softcap_ce_rows(z, targets, weights, tg.HEAD_GRAD_SCALE, prefix=prefix)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ntp.double(), want_ntp, atol=1e-5, rtol=1e-5)
    exact = want_grad / tg.HEAD_GRAD_SCALE
    assert ((g.double() - exact).norm() / exact.norm()).item() < 0.06
    loss, _, dz = tg.softcap_ce_parts(z, targets, weights, 0, prefix)
    torch.testing.assert_close(loss.double(), want_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dz.double(), want_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [40, 64, 192])
def test_bf16_head_in_row_chunks_equals_the_formula(chunk, monkeypatch):
    """SoftcapHead (the head where FP8 is off) against float64 autograd of ref_head on each of 3 sequences of
    64 rows, multi-token and prefix terms on: the summed losses, and the grads wrt the rows and the weight
    (the chain rule through z = x w^T, in float64). Chunks of 40 rows split sequences and end part-way; none
    of the rule's calls sees more rows than a chunk."""
    gen = torch.Generator().manual_seed(4)
    S, V, dim, w = 64, 384, 48, [1.0, 0.5, 0.25]
    x = torch.randn(3 * S, dim, generator=gen).bfloat16()
    head_w = (torch.randn(V, dim, generator=gen) * 3).bfloat16()  # logits up to ~+-60: the cap matters
    targets = torch.randint(0, V, (3 * S,), generator=gen)
    prefix = torch.where(torch.rand(3 * S, generator=gen) < 1 / 3, -1, torch.randint(0, V, (3 * S,), generator=gen))
    x64, w64 = x.double(), head_w.double()
    want_loss, want_ntp, gx, gw = 0.0, 0.0, torch.zeros_like(x64), torch.zeros_like(w64)
    for b in range(3):
        rows = slice(b * S, (b + 1) * S)
        loss, ntp, gz = ref_head(x64[rows] @ w64.T, targets[rows], w, prefix[rows], 0.25)
        want_loss, want_ntp = want_loss + loss.sum().item(), want_ntp + ntp.sum().item()
        gx[rows], gw = gz @ w64, gw + gz.T @ x64[rows]
    seen = []
    rule = tg.softcap_ce_parts
    monkeypatch.setattr(tg, "softcap_ce_parts", lambda z, *a, **k: seen.append(z.size(0)) or rule(z, *a, **k))
    xg, wg = x.clone().requires_grad_(), head_w.clone().requires_grad_()
    total, next_token = tg.SoftcapHead.apply(xg, wg, targets, torch.tensor(w + [0.25]), S, prefix, chunk)
    total.backward()
    assert seen == [min(chunk, 3 * S - a) for a in range(0, 3 * S, chunk)]
    assert total.item() == pytest.approx(want_loss, rel=1e-3) and next_token.item() == pytest.approx(want_ntp, rel=1e-3)
    assert not next_token.requires_grad and xg.grad.dtype == wg.grad.dtype == torch.bfloat16
    for got, want in ((xg.grad, gx), (wg.grad, gw)):
        assert ((got.double() - want).norm() / want.norm()).item() < 0.01


def test_compiled_bf16_head_runs_its_chunks_eagerly(monkeypatch):
    """head_loss with FP8 off under torch.compile, as the model runs it, over 4 chunks of rows and twice: the
    chunk loop stays out of the compiled graphs (traced, it unrolls into a graph per chunk count, slow to
    compile, whose fused rounding is not the rule's), nothing compiles twice, and the loss and grads are the
    eager ones bit for bit."""
    monkeypatch.setattr(tg, "HEAD_CHUNK_ROWS", 50)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 96, 64, generator=gen).requires_grad_()
    w = (torch.randn(300, 64, generator=gen) * 0.5).bfloat16().requires_grad_()
    targets, weights = torch.randint(0, 300, (2, 96), generator=gen), torch.tensor([1.0, 0.5, 0.25])
    want = tg.head_loss(x, w, targets, weights, False)[0]
    want_grads = torch.autograd.grad(want, (x, w))
    graphs = []

    def capture(gm, example_inputs):  # a graph's code with its subgraphs' (an autograd.Function's forward)
        graphs.append("".join(m.code for _, m in gm.named_modules() if hasattr(m, "code")))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(tg.head_loss, dynamic=False, backend=capture)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            got = compiled(x, w, targets, weights, False)[0]
            grads = torch.autograd.grad(got, (x, w))
    torch._dynamo.reset()
    assert graphs and "rms_norm" in "".join(graphs)  # the norm before the head is compiled
    assert not any("scatter_add" in code or "logsumexp" in code for code in graphs)
    assert got.item() == want.item() and all(torch.equal(g, h) for g, h in zip(grads, want_grads))


def test_prefix_tokens_are_the_longest_proper_prefixes_in_the_vocabulary():
    """prefix_tokens against GPT-2's byte strings read here from the shipped ranks, by another algorithm: in
    sorted order a token follows every prefix of it, so the tokens that prefix the current one are a stack.
    Every token of more than one byte that extends another has its longest such one; the 256 bytes,
    <|endoftext|> and the padding ids have none (-1)."""
    import base64
    ranks = {}
    for line in (REPO_ROOT / "data" / "gpt2.tiktoken").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    want, stack = [-1] * 50304, []
    for token in sorted(ranks):
        while stack and not token.startswith(stack[-1]):
            stack.pop()
        if stack:
            want[ranks[token]] = ranks[stack[-1]]
        stack.append(token)
    got = tg.prefix_tokens(50304)
    assert list(got) == want
    assert sum(t >= 0 for t in got) == 50257 - 257 and got[tg.BOS_ID] == -1
    by_id = {i: b for b, i in ranks.items()}
    assert by_id[got[ranks[b" the"]]] == b" th" and by_id[got[ranks[b"ing"]]] == b"in"


def test_the_model_hands_the_head_each_targets_prefix_token():
    """With --prefix_weight the training forward's loss is head_loss with the prefix tokens of the targets
    (prefix_tokens), the 4th weight theirs; not the loss of a 4th next token."""
    model = randomized_record_model(2, prefix_weight=0.25)
    idx = torch.from_numpy(token_layouts(513, 2)["random"]).int()
    windows, w = torch.tensor([128, 256]), torch.tensor([1.0, 0.5, 0.25, 0.25])
    loss, _ = model(idx[:-1], idx[1:], windows, w)
    x, targets = model.hidden(idx[:-1], windows), idx[1:].long()
    prefix = torch.tensor(tg.prefix_tokens(50304))[targets]
    want, _ = tg.head_loss(x, model.head_w, targets, w, False, prefix=prefix)
    shifted, _ = tg.head_loss(x, model.head_w, targets, w, False)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6) and shifted.item() != pytest.approx(want.item())
    fp8, _ = tg.head_loss(x, model.head_w, targets, w, True, prefix=prefix)  # the FP8 head's op takes them too
    assert fp8.item() == pytest.approx(want.item(), rel=0.02) and fp8.item() != pytest.approx(shifted.item(), rel=0.002)


def test_the_prefix_weight_follows_the_record_schedule():
    """2026-07-13_PrefixTokenPrediction's TrainingStage table: 0.25 through the first stage, 0.25 -> 0 across the
    second (linear in its fraction), 0 in the third and the extension (the default's: the master of 2026-08-01
    at 1270 + 15 steps); the head's weights carry it last, and only when on."""
    cfg = tg.parse_args([])
    ref = RecordSchedule(1270, 1285, floor=0.15, cooldown=0.60)
    for s in range(1286):
        stage, t = ref.lookup(s)
        want = [0.25, 0.25 * (1 - t), 0.0, 0.0][stage]
        assert tg.prefix_weight_at(s, cfg) == pytest.approx(want), s
        assert tg.loss_weights_at(s, cfg) == pytest.approx(ref.mtp(s) + [want]), s
    off = tg.parse_args(["--prefix_weight", "0"])
    assert tg.loss_weights_at(5, off) == tg.mtp_weights_at(5, off)


@pytest.mark.parametrize("fp8_grad", [False, True])
def test_softcap_ce_keeps_targets_in_their_sequence(fp8_grad):
    """Rows of 3 sequences laid end to end (a micro-batch of --micro_batch 3): each sequence's losses and grad
    are ref_head's on that sequence alone; the next tokens of its last rows do not reach into the next one."""
    gen = torch.Generator().manual_seed(3)
    S, weights = 64, [1.0, 0.5, 0.25]
    z = (torch.randn(3 * S, 384, generator=gen) * 20).bfloat16()
    targets = torch.randint(0, 384, (3 * S,), generator=gen)
    if fp8_grad:
        loss, ntp, g = tg.softcap_ce_rows(z, targets, torch.tensor(weights), tg.HEAD_GRAD_SCALE, seq_len=S)
        dz = g.double() * tg.HEAD_GRAD_SCALE
    else:
        loss, ntp, dz = tg.softcap_ce_parts(z, targets, torch.tensor(weights), S)
    for b in range(3):
        rows = slice(b * S, (b + 1) * S)
        want_loss, want_ntp, want_grad = ref_head(z[rows], targets[rows], weights)
        torch.testing.assert_close(loss[rows].double(), want_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ntp[rows].double(), want_ntp, atol=1e-5, rtol=1e-5)
        err = ((dz[rows].double() - want_grad).norm() / want_grad.norm()).item()
        assert err < (0.06 if fp8_grad else 1e-5), (b, err)


def test_head_loss_equals_the_formula_on_bf16_operands():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen)
    w = torch.randn(500, 48, generator=gen) * 2.0  # logits up to ~+-40: the cap matters
    targets = torch.randint(0, 500, (64,), generator=gen)
    z = (ref_rms(x.double()).bfloat16().double() @ w.bfloat16().double().T)
    want, want_ntp, _ = ref_head(z, targets, [1.0, 0.5, 0.25])
    got, ntp = tg.head_loss(x, w, targets, torch.tensor([1.0, 0.5, 0.25]), fp8=False)
    assert got.item() == pytest.approx(want.sum().item(), rel=2e-3)
    assert ntp.item() == pytest.approx(want_ntp.sum().item(), rel=2e-3)


def test_validation_uses_the_bf16_head_when_training_uses_fp8():
    """The record validates through the bf16 head whatever the training head is: in eval mode a model with the
    FP8 head gives the next-token loss of the bf16 logits (the formula in float64 on bf16 operands), nearer it
    than the FP8 head's loss by far."""
    model = randomized_record_model(7)
    model.fp8_head = True
    with torch.no_grad():
        model.head_w.mul_(0.02)  # within the FP8 head's scale (1.6 / 448 per unit)
    tokens = token_layouts(513, 3)["random"]
    idx, targets = torch.from_numpy(tokens[:-1]).int(), torch.from_numpy(tokens[1:]).long()
    windows = torch.tensor([192, 384])
    model.eval()
    with torch.no_grad():
        got = model(idx, targets.int(), windows)[0].item()
        hidden = model.hidden(idx, windows)[0]
    z = (ref_rms(hidden.double()).bfloat16().double() @ model.head_w.detach().bfloat16().double().T).bfloat16().double()
    c = 23 * torch.sigmoid((z + 5) / 7.5)
    bf16 = (torch.logsumexp(c, -1) - c[torch.arange(512), targets]).sum().item()
    _, fp8 = tg.head_loss(hidden, model.head_w.detach(), targets, torch.tensor([1.0, 0.0, 0.0]), fp8=True)
    assert abs(got - bf16) < 1e-4 * abs(bf16) and abs(got - bf16) < 0.1 * abs(fp8.item() - bf16), (got, bf16, fp8)


def test_eval_loss_is_the_next_token_sum_in_chunks():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 300, 48, generator=gen), torch.randn(500, 48, generator=gen)
    targets = torch.randint(0, 500, (300,), generator=gen)
    whole = tg.eval_loss(x, w, targets)
    _, ntp = tg.head_loss(x, w, targets, torch.tensor([1.0, 0.0, 0.0]), fp8=False)
    assert tg.eval_loss(x, w, targets, chunk=70).item() == pytest.approx(whole.item(), rel=1e-5)
    assert whole.item() == pytest.approx(ntp.item(), rel=1e-5)


# ---- optimizer math

@pytest.mark.parametrize("scale", [1e-13, 1e-9, 1.0, 1e6])
def test_adam_update_equals_torch_adam(scale):
    """At grads far below eps (where eps sets the step: 1e-13 / 1e-10), near it, at 1 and far above."""
    gen = torch.Generator().manual_seed(0)
    p_ours = torch.randn(40, 30, generator=gen, dtype=torch.float64)
    p_ref = p_ours.clone().requires_grad_()
    ref = torch.optim.Adam([p_ref], lr=0.01, betas=(0.8, 0.95), eps=1e-10)
    m, v = torch.zeros_like(p_ours), torch.zeros_like(p_ours)
    for step in range(1, 8):
        g = torch.randn(40, 30, generator=gen, dtype=torch.float64) * scale * 10 ** (step % 3)
        p_ref.grad = g.clone()
        ref.step()
        p_ours -= 0.01 * tg.adam_update(g, m, v, step, (0.8, 0.95), 1e-10)
    torch.testing.assert_close(p_ours, p_ref.detach(), atol=1e-12, rtol=1e-10)


def svd_polar(G: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


@pytest.mark.parametrize("shape", [(768, 768), (3072, 768), (6, 12), (1024, 256)])
def test_polar_express_approximates_the_svd_polar_factor(shape):
    """The model's matrix shapes (and a wide one): close in direction to U V^T with singular values near 1,
    except the smallest few of a random square matrix's, which start near 0. (A normalized but
    unorthogonalized G has cosine 0.85-0.97 and most singular values far below 0.6.)"""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = tg.polar_express(G).double()
    polar = svd_polar(G)
    assert ((X * polar).sum() / (X.norm() * polar.norm())).item() > 0.99
    s = torch.linalg.svdvals(X).sort().values
    assert s[int(0.05 * (len(s) - 1))] > 0.7 and 0.85 < s.median() < 1.15 and s[-1] < 1.25, s


def test_normuon_normalizes_neurons_of_the_orthogonalized_momentum(monkeypatch):
    """NorMuon written out in float64 from its description, with an exact polar factor for both: Nesterov
    momentum m = b m + (1-b) g, O = polar((1-b) g + b m); per neuron (row if rows >= cols, else column) the
    running mean of mean(O^2) with decay beta2; O divided by its root, then rescaled to O's Frobenius norm."""
    monkeypatch.setattr(tg, "polar_express", lambda G: svd_polar(G).float())
    gen = torch.Generator().manual_seed(0)
    for shape in [(2, 48, 16), (3, 16, 40)]:
        buf, second = torch.zeros(shape), torch.zeros(tg.second_moment_shape(shape))
        m_ref, v_ref = torch.zeros(shape, dtype=torch.float64), 0
        for b in (0.85, 0.9, 0.95):
            g = torch.randn(shape, generator=gen)
            got = tg.normuon_update(g, buf, second, b, 0.95)
            m_ref = b * m_ref + (1 - b) * g.double()
            O = torch.stack([svd_polar(M) for M in ((1 - b) * g.double() + b * m_ref)])
            axis = 2 if shape[1] >= shape[2] else 1
            v_ref = 0.95 * v_ref + 0.05 * O.square().mean(axis, keepdim=True)
            U = O / v_ref.sqrt()
            want = U * (O.norm(dim=(1, 2), keepdim=True) / U.norm(dim=(1, 2), keepdim=True))
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_finite_agrees_with_isfinite_all():
    """finite (the optimizer's divergence check) against isfinite().all(): NaN, +inf or -inf at the first, a
    middle or the last place, one of each together, none, and an empty tensor."""
    gen = torch.Generator().manual_seed(0)
    for bad in ([], [float("nan")], [float("inf")], [-float("inf")], [float("nan"), float("inf"), -float("inf")]):
        for where in (0, 500, 999):
            t = torch.randn(1000, generator=gen) * 1e30
            for k, value in enumerate(bad):
                t[(where + 7 * k) % t.numel()] = value
            assert bool(tg.finite(t)) == bool(t.isfinite().all()), (bad, where)
    assert bool(tg.finite(torch.empty(0)))


def test_cautious_step_decays_only_where_update_and_weight_agree():
    p = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, 0.0])
    u = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0, 1.0])
    for strict in (True, False):
        q = p.clone()
        tg.cautious_step(q, u, 0.1, 0.01, strict)
        agree = [pi * ui > 0 or (not strict and pi * ui == 0) for pi, ui in zip(p.tolist(), u.tolist())]
        want = [pi - 0.1 * ui - (0.01 * pi if a else 0.0) for pi, ui, a in zip(p.tolist(), u.tolist(), agree)]
        assert q.tolist() == pytest.approx(want), strict


def tiny_optimizer(**over):
    cfg = tg.parse_args(["--device", "cpu", "--num_layers", "3", "--model_dim", "64", "--num_heads", "2",
                         "--head_dim", "32", "--long_window_layers", "0", "--no_attn_layers", "", "--paired_head_layers",
                         "", "--value_embeds", "0,-1,-1", "--skip", "0,1", "--backout_layer", "0", "--seq_len", "128",
                         "--val_seq_len", "128", "--val_tokens", "128", "--bigram_vocab", "1000", "--xsa_layers", "1",
                         "--mudd_gate_layer", "1", "--attn_gate_layers", "0,2", "--dc_layers", "2"])
    tg.check_config(cfg)
    cfg = dataclasses.replace(cfg, **over)
    model = tg.GPT(cfg)
    with torch.no_grad():
        model.head_w.normal_(0, 0.1)
    return cfg, model, tg.ShardedOptimizer(*tg.param_groups(model), cfg, tg.Comm(0, 1))


def test_sharded_adam_equals_torch_adam_with_cautious_decay():
    """The bucketed, sharded Adam step on the fp32 groups (scalars, residual and injection lambdas) equals
    torch.optim.Adam at the
    group's lr times the schedule factor, followed by the decay lr^2 * wd where update and weight agree."""
    cfg, model, opt = tiny_optimizer(adam_wd=0.5, mudd_gate=False, dc_layers=())
    groups = {"scalars": [model.scalars], "resid": [model.resid_lambdas],
              "inject": [model.post_lambdas, model.x0_lambdas, model.bigram_lambdas]}
    refs = {g: [p.detach().clone().requires_grad_() for p in ps] for g, ps in groups.items()}
    ref_opts = {g: torch.optim.Adam(refs[g], lr=1.0, betas=tg.ADAM_GROUPS[g].betas, eps=1e-10) for g in groups}
    gen = torch.Generator().manual_seed(1)
    for factor in [1.0, 1.0, 0.5, 0.25]:
        for g, ps in groups.items():
            lr = cfg.adam_lr * tg.ADAM_GROUPS[g].lr_mul * factor
            for p, rp in zip(ps, refs[g]):
                p.grad = torch.randn(p.shape, generator=gen)
                rp.grad = p.grad.clone()
            before = [rp.detach().clone() for rp in refs[g]]
            ref_opts[g].param_groups[0]["lr"] = lr
            ref_opts[g].step()  # once for the group's params together
            with torch.no_grad():  # cautious decay: where the update (before - after) and the weight agree
                for b, rp in zip(before, refs[g]):
                    agree = (b - rp) * b > 0
                    rp -= agree * b * lr * lr * cfg.adam_wd * tg.ADAM_GROUPS[g].wd_mul
        for p in opt.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.adam_now = True
        opt.step(factor, 0.9)
    for g, ps in groups.items():
        for p, rp in zip(ps, refs[g]):
            torch.testing.assert_close(p.detach(), rp.detach(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("factor", [1.0, 0.37])
def test_normuon_step_and_its_decay_follow_the_lr_schedule(factor):
    """The record's NorMuon step at schedule factor f, written out: base = muon_lr f, lr = base x the group's
    multiplier x sqrt(max(1, rows/cols)); p -= lr u + muon_wd base lr p where u p >= 0 (cautious, zero counting
    as agreeing), u NorMuon's direction of the grad (normuon_update, checked on its own above). The decay goes
    with f^2, the step with f: a decay that missed the schedule (f once, or not at all) fails at f = 0.37."""
    cfg, model, opt = tiny_optimizer(muon_wd=30.0)
    gen = torch.Generator().manual_seed(4)
    muon = {id(p): g for b in opt.buckets if b.kind == "muon" for p in b.params for g in [b.group]}
    grads = {p: torch.randn(p.shape, generator=gen) if id(p) in muon else torch.zeros(p.shape)
             for p in model.parameters()}
    before = {id(p): p.detach().clone() for p in model.parameters()}
    opt.adam_now = False
    feed(opt, grads)
    opt.step(factor, 0.9)
    base = cfg.muon_lr * factor
    for p in model.parameters():
        if id(p) not in muon:
            continue
        shape = p.shape[-2:]
        g = grads[p].reshape(-1, *shape)
        u = tg.normuon_update(g.clone(), torch.zeros_like(g), torch.zeros(tg.second_moment_shape(g.shape)), 0.9,
                              cfg.muon_beta2).reshape(p.shape)
        lr = base * tg.MUON_GROUPS[muon[id(p)]] * max(1.0, shape[0] / shape[1]) ** 0.5
        w = before[id(p)]
        want = w - lr * u - cfg.muon_wd * base * lr * (u * w >= 0) * w
        assert ((p.detach() - want).norm() / (w - want).norm()).item() < 1e-3, muon[id(p)]


def test_normuon_uses_the_configured_second_moment_decay():
    """NorMuon's second moment starts at 0 and decays by --muon_beta2: after one step it is (1 - beta2) times
    the orthogonalized momentum's mean square, the same at any beta2 (the first step's direction does not
    depend on it). Two optimizers at 0.5 and 0.8 fed the same grads hold states in the ratio 0.5 / 0.2 = 2.5;
    one that used a fixed decay (0.95 before 2026-03-22) would hold equal states. (The step's direction itself
    cannot tell: the rescaling to the orthogonalized norm cancels the decay in the first step.)"""
    states = []
    for beta2 in (0.5, 0.8):
        cfg, model, opt = tiny_optimizer(muon_beta2=beta2)
        gen = torch.Generator().manual_seed(5)
        opt.adam_now = False
        feed(opt, {p: torch.randn(p.shape, generator=gen) for p in model.parameters()})
        opt.step(1.0, 0.9)
        states.append([b.state["second"] for b in opt.buckets if b.kind == "muon"])
    for a, b in zip(*states):
        assert b.abs().min() > 0
        torch.testing.assert_close(a / b, torch.full_like(a, 2.5), rtol=1e-5, atol=0)


def test_normuon_takes_q_and_k_by_head_pair_v_and_o_whole(monkeypatch):
    """2026-04-08_PairedHeadMuon, written out from its README and its NorMuon: the rows of q's weights that
    feed one pair of heads (2 x head_dim of them) are one NorMuon matrix, and so for k; v's and o's weights are
    a matrix each. Per matrix: Nesterov momentum, exact polar factor O, each neuron's mean square (per column
    where the matrix is wider than tall, per row otherwise), O divided by its root and rescaled to O's norm;
    then p -= muon_lr u. First step from zero state, no decay, 4 heads of 16 dims (two pairs)."""
    monkeypatch.setattr(tg, "polar_express", lambda G: svd_polar(G).float())
    cfg, model, opt = tiny_optimizer(muon_wd=0.0, num_heads=4, head_dim=16)
    attn, b = model.blocks[0].attn, 0.9
    gen = torch.Generator().manual_seed(5)
    grads = {p: torch.randn(p.shape, generator=gen) for b_ in opt.buckets if b_.kind == "muon" for p in b_.params}
    q, k = attn.qk_w.detach().reshape(2, 64, 64).double()
    v, o = attn.vo_w.detach().double()
    gq, gk = grads[attn.qk_w].reshape(2, 64, 64).double()
    gv, go = grads[attn.vo_w].double()
    opt.adam_now = False
    feed(opt, grads)
    opt.step(1.0, b)

    def normuon(g):
        O = svd_polar((1 - b) * g + b * ((1 - b) * g))
        U = O / O.square().mean(1 if O.size(0) >= O.size(1) else 0, keepdim=True).sqrt()
        return U * O.norm() / U.norm()

    def by_pairs(g):
        return torch.cat([normuon(rows) for rows in g.split(32)])

    lr = cfg.muon_lr
    got_q, got_k = attn.qk_w.detach().reshape(2, 64, 64).double()
    got_v, got_o = attn.vo_w.detach().double()
    for got, w, u in [(got_q, q, by_pairs(gq)), (got_k, k, by_pairs(gk)), (got_v, v, normuon(gv)),
                      (got_o, o, normuon(go))]:
        torch.testing.assert_close(got, w - lr * u, atol=1e-6, rtol=1e-5)
    # the whole-matrix rule moves q elsewhere: the comparison above tells the two apart
    assert (normuon(gq) - by_pairs(gq)).norm() > 0.2 * by_pairs(gq).norm()


def feed(opt, grads: dict):
    """What backward does with grads {param: grad}: autograd adds to an fp32 parameter's .grad; the hook folds a
    bf16 parameter's into its bucket's fp32 sum."""
    for b in opt.buckets:
        offset = 0
        for p in b.params:
            if p in grads:
                g = grads[p].to(p.dtype)
                p.grad = g.clone() if p.grad is None else p.grad + g
                opt._grad_ready(b, offset, p)
            offset += p.numel()


def test_adam_steps_every_second_step_on_the_sum_of_both_steps_grads():
    """An even step leaves Adam's parameters alone and keeps their grads; the odd step updates them from the
    sum of both steps' grads, as one Adam step; Muon's parameters move every step."""
    cfg, model, opt = tiny_optimizer()
    _, twin, twin_opt = tiny_optimizer()
    twin.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(2)
    # small multiples of 2^-10: each grad and their sum are exact in bf16, so the order of rounding cannot matter
    grads = [[torch.randint(-8, 9, p.shape, generator=gen) * 2.0**-10 for p in model.parameters()] for _ in range(2)]
    adam = {id(p) for b in opt.buckets if b.kind == "adam" for p in b.params}
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        opt.adam_now = tg.is_adam_step(step)
        feed(opt, dict(zip(model.parameters(), grads[step])))
        opt.step(1.0, 0.9)
        if step == 0:
            for p, b in zip(model.parameters(), before):
                assert torch.equal(p, b) == (id(p) in adam)
    # the twin: Muon's grads per step; Adam's none on step 0 and their sum on step 1
    for step in range(2):
        twin_opt.adam_now = step == 1
        feed(twin_opt, {p: (grads[0][i] + grads[1][i] if step else None) if id(q) in adam else grads[step][i]
                        for i, (p, q) in enumerate(zip(twin.parameters(), model.parameters()))
                        if not (id(q) in adam and step == 0)})
        twin_opt.step(1.0, 0.9)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_the_embedding_is_tied_to_lm_head_until_untied():
    """While tied, the embedding's grad adds to lm_head's and the embedding becomes lm_head's copy; untie() gives
    the embedding lm_head's Adam state, after which each follows its own grads."""
    cfg, model, opt = tiny_optimizer()
    _, twin, twin_opt = tiny_optimizer()
    twin.load_state_dict(model.state_dict())
    head, embed = model.head_w, model.embed.weight
    gen = torch.Generator().manual_seed(3)
    g1, g2 = (torch.randn(head.shape, generator=gen) * 1e-3 for _ in range(2))
    opt.adam_now = twin_opt.adam_now = True
    zero = {p: torch.zeros(p.shape) for p in model.parameters() if p is not head and p is not embed}
    feed(opt, {**zero, head: g1, embed: g2})
    opt.step(1.0, 0.9)
    assert torch.equal(head, embed)
    # lm_head moved as if its grad were the sum (of the bf16 grads, in fp32) and the embedding had none
    twin_opt.tied = False
    feed(twin_opt, {**{p: torch.zeros(p.shape) for p in twin.parameters() if p is not twin.head_w},
                    twin.head_w: g1.bfloat16().float() + g2.bfloat16().float()})
    twin_opt.step(1.0, 0.9)
    assert torch.equal(head, twin.head_w)
    opt.untie()
    n = head.numel()
    for name, s in opt.head.state.items():
        assert torch.equal(s[n:2 * n], s[:n]), name
    feed(opt, {**zero, head: g1, embed: -g1})
    opt.step(1.0, 0.9)
    assert not torch.equal(head, embed)


# ---- schedules against their formulas

class RecordSchedule:
    """The record's TrainingSchedule (2026-01-30 on), from its formulas: stages end at round(S/3), round(2S/3)
    (the durations summed as floats), S, then the extension; a step's stage is the first whose end lies past
    it, with t its fraction through that stage; the lr is the stage's multiplier blended from step
    int(S (1 - cooldown)) towards the floor; MTP weights interpolate linearly within each stage."""

    def __init__(self, S: int, total: int, floor: float, cooldown: float):
        c1 = 1 / 3
        self.ends = [round(c1 * S), round((c1 + c1) * S), S, total]
        self.S, self.floor, self.cooldown = S, floor, cooldown

    def lookup(self, step):
        start = 0
        for i, end in enumerate(self.ends):
            if step < end:
                return i, (step - start) / (end - start)
            start = end
        return 3, 1.0

    def lr(self, step):
        stage, _ = self.lookup(step)
        lr = [1.0, 1.52, 1.73, 1.0][stage]
        cd = int(self.S * (1 - self.cooldown))
        if step >= cd:
            t = 1.0 if self.S <= cd else min(1.0, (step - cd) / (self.S - cd))  # 2026-02-10's guard
            lr = lr * (1 - t) + self.floor * t
        return lr

    def mtp(self, step):
        stage, t = self.lookup(step)
        start, end = [([1, 0.5, 0.25], [1, 0.5, 0]), ([1, 0.5], [1, 0]), ([1], [1]), ([1], [1])][stage]
        w = [a + (b - a) * t for a, b in zip(start, end)]
        return w + [0.0] * (3 - len(w))


@pytest.mark.parametrize("num_steps,extension", [(1385, 10), (1415, 10), (118, 3), (1001, 40), (100, 7)])
def test_schedules_follow_the_record(num_steps, extension):
    """Every step, at the default's count (1375 scheduled steps: round(S/3) = 458, round(2S/3) = 917) and
    others that do not divide by 3, against the record's TrainingSchedule (RecordSchedule) and its window,
    document length (2026-02-10_ShortWindow: 896 tokens in the first stage), momentum and Adam rules."""
    cfg = tg.parse_args(["--num_steps", str(num_steps), "--extension_steps", str(extension)])
    S = num_steps - extension
    ref = RecordSchedule(S, num_steps, floor=0.15, cooldown=0.60)  # the record's (2026-03-06_SimplifyHC)
    for s in range(num_steps + 1):
        stage, _ = ref.lookup(s)
        assert tg.batch_seqs_at(s, cfg) == (8, 16, 24, 24)[stage], s
        assert tg.max_doc_len_at(s, cfg) == (896, 2048, 2048, 2048)[stage], s
        assert tg.lr_factor(s, cfg) == pytest.approx(ref.lr(s)), s
        assert tg.windows_at(s, cfg) == [(1, 3), (3, 7), (5, 11), (6, 13)][stage], s
        mom = (0.85 + 0.1 * s / 300 if s < 300 else 0.95 - 0.1 * (s - (num_steps - 50)) / 50
               if s > num_steps - 50 else 0.95)
        assert tg.muon_momentum(s, cfg) == pytest.approx(mom), s
        assert tg.mtp_weights_at(s, cfg) == pytest.approx(ref.mtp(s)), s
        assert tg.is_adam_step(s) == (s % 2 == 1)
    assert tg.windows_at(num_steps, cfg, final_val=True) == (6, 20)
    assert tg.split_step(cfg) == ref.ends[1] | 1  # the third stage's first step, made odd
    # the windows YaRN has adapted to by each step: every change of the long window, in order
    seen = []
    for s in range(num_steps + 1):
        long = tg.windows_at(s, cfg)[1]
        if not seen or seen[-1] != long:
            seen.append(long)
        assert tg.long_window_stages(s, cfg) == seen, s


# ---- the recipe: the default record's constants, pinned

def test_a_saved_config_reads_back_as_the_same_hyperparameters():
    """Checkpoints and log lines keep the config as JSON (tuples become lists); a key from another version of the
    script is left out rather than refused, so --generate and records/tool.py read older and newer files."""
    saved = json.loads(json.dumps(dataclasses.asdict(tg.Hyperparameters(num_steps=100, no_attn_layers=(2, 5)))))
    assert tg.hyperparameters_from({**saved, "from_another_version": 1}) == tg.Hyperparameters(
        num_steps=100, no_attn_layers=(2, 5))
    # an older version's one --max_doc_len (before 2026-02-10_ShortWindow's per-stage values) reads as one value
    assert tg.hyperparameters_from({**saved, "max_doc_len": 2048}).max_doc_len == (2048,)
    assert tg.config_diff({"max_doc_len": 2048}, {"max_doc_len": (2048,)}) == {}
    assert tg.config_diff({"max_doc_len": 2048}, {"max_doc_len": (896, 2048)}) == {"max_doc_len": ([2048], [896, 2048])}


def test_defaults_are_the_records():
    """The constants of the default's records (2026-04-22_MuddFormer v3, 2026-05-07_XSAGatedLayers,
    2026-05-19_FP8MLPUpProj, 2026-05-20_BigramsSignTrick, 2026-05-27-MuddGatedAndDC v3,
    2026-07-13_PrefixTokenPrediction, the master of 2026-08-01), as their logs' scripts set them."""
    cfg = tg.Hyperparameters()
    assert tg.bigram_width(cfg) == 768 and cfg.bigram_signs == 8192 and cfg.fp8_mlp
    # 2026-05-27 v3: XSA on 1, 3, 4, 7; gates on 3 and 10; DC on 10 over 112 tokens; the post gate at layer 4
    assert (cfg.xsa_layers, cfg.attn_gate_layers, cfg.dc_layers, cfg.dc_window) == ((1, 3, 4, 7), (3, 10), (10,), 112)
    assert cfg.mudd_gate and cfg.mudd_gate_layer == 4
    assert (tg.GATE_HIDDEN, tg.GATE_SCALE_INIT, tg.DC_BACK) == (64, 0.1, 128)
    assert tg.GATE_START == {"xsa": 0.0, "out": 0.25, "x0": 0.0, "bigram": 0.05, "skip": 0.5, "dc_in": 1.0,
                             "dc_out": 0.0}
    record = dict(num_steps=1285, extension_steps=15, prefix_weight=0.25, mudd=True, xsa=True, cooldown_frac=0.60, lr_stage_scales=(1.0, 1.52, 1.73),
                  batch_seqs=(8, 16, 24), seq_len=16384, max_doc_len=(896, 2048, 2048), windows=(3, 7, 11), final_window=13,
                  val_window=20, split_embed_frac=2 / 3, mtp=True, val_seq_len=262_144, val_tokens=10_485_760,
                  val_every=250, target_val_loss=3.28, vocab_size=50304, num_layers=11, model_dim=768, num_heads=6,
                  head_dim=128, long_window_layers=(3, 10), no_attn_layers=(6,), paired_head_layers=(0, 2, 5, 9),
                  value_embeds=(-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4), skip=(3, 6), backout_layer=7,
                  bigram_vocab=377_280, fp8_head=True, muon_lr=0.023, muon_wd=1.2, muon_beta2=0.9, adam_lr=0.008,
                  adam_wd=0.005, adam_eps=1e-10, momentum_warmup_steps=300, momentum_cooldown_steps=50)
    assert {k: getattr(cfg, k) for k in record} == record
    assert [n * cfg.seq_len for n in cfg.batch_seqs] == [131_072, 262_144, 393_216]
    assert (tg.HEAD_X_SCALE, tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE) == (100 / 448, 1.6 / 448, 0.75 / 448)
    assert (tg.SOFTCAP, tg.SOFTCAP_SHIFT, tg.SOFTCAP_DIV, tg.ATTN_SCALE, tg.GATE_DIMS) == (23.0, 5.0, 7.5, 0.1, 12)
    assert tg.BIGRAM_MULS == (36313, 27191) and (tg.YARN_ALPHA, tg.YARN_BETA) == (1, 32)
    assert tg.POLAR_EXPRESS_COEFFS[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    assert len(tg.POLAR_EXPRESS_COEFFS) == 5
    lr_mul = {g: a.lr_mul for g, a in tg.ADAM_GROUPS.items()}
    assert lr_mul == {"head": 1.0, "embeds": 75.0, "scalars": 5.0, "resid": 5.0, "inject": 1.0, "gates": 1.0,
                      "smear": 0.01, "skip": 0.05, "xsa": 1.0, "mudd": 0.25, "mudd_bias": 0.25, "mudd_gate": 0.1,
                      "mudd_gate_bias": 0.1}
    assert {g: a.wd_mul for g, a in tg.ADAM_GROUPS.items()} == {"head": 150.0, "embeds": 5.0, "scalars": 0.0,
                                                                 "resid": 0.0, "inject": 0.0, "gates": 1.0,
                                                                 "smear": 0.0, "skip": 0.0, "xsa": 0.0,
                                                                 "mudd": 1.0, "mudd_bias": 0.0, "mudd_gate": 1.0,
                                                                 "mudd_gate_bias": 0.0}
    assert {g: a.betas for g, a in tg.ADAM_GROUPS.items()} == {
        "head": (0.5, 0.95), "embeds": (0.75, 0.95), "scalars": (0.9, 0.99), "resid": (0.9, 0.95),
        "inject": (0.9, 0.95), "gates": (0.9, 0.99), "smear": (0.9, 0.99), "skip": (0.9, 0.99),
        "xsa": (0.9, 0.95), "mudd": (0.9, 0.99), "mudd_bias": (0.9, 0.99), "mudd_gate": (0.9, 0.99),
        "mudd_gate_bias": (0.9, 0.99)}
    assert tg.MUON_GROUPS == {"attn_qk": 1.0, "attn_vo": 1.0, "mlp_in": 1.0, "mlp_out": 2.0}
    assert tg.split_step(cfg) == 847  # round(2/3 x 1270) | 1
    assert (tg.MUDD_HIDDEN, tg.MUDD_COLS, tg.MUDD_SCALE, tg.MUDD_BACKOUT_BIAS) == (64, 8, 0.1, -5.0)
    assert tg.LR_FLOOR == 0.15
    assert (tg.ATTN_INIT_STD, tg.VE_GATE_X, tg.VE_INIT_STD) == (0.5, 6, 0.01)
    assert (tg.RESID_INIT, tg.BIGRAM_INIT) == (1.1 ** 0.5, 0.05)


def test_full_size_model_has_the_record_parameters():
    with torch.device("meta"):
        model = tg.GPT(tg.Hyperparameters())
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    f32, bf16, V = torch.float32, torch.bfloat16, 50304
    assert shapes["embed.weight"] == ((V, 768), bf16) and shapes["head_w"] == ((V, 768), bf16)
    assert [shapes[f"value_embeds.{i}.weight"] for i in range(5)] == [((V, 768), bf16)] * 5
    assert shapes["bigram_embed.weight"] == ((15 * V // 2, 768), bf16)  # 2026-05-27 v3
    assert (model.bigram_sign_table.shape, model.bigram_sign_table.dtype) == ((8192, 768), bf16)
    assert shapes["scalars"] == ((2 * L + 2,), f32)  # no backout scalar with MUDD
    assert shapes["resid_lambdas"] == shapes["post_lambdas"] == ((L, 2), f32)
    assert shapes["smear_gate_w"] == ((1, 12), bf16)
    # the MUDD gate makes x0's and the bigram's shares, the skip's weight, XSA's shares and the output gates
    for gone in ["x0_lambdas", "bigram_lambdas", "skip_gate_w"]:
        assert gone not in shapes
    assert shapes["gate.w_in"] == ((2, 64, 768), bf16) and shapes["gate.w_out"] == ((2, 41, 64), bf16)
    assert shapes["gate.bias"] == ((2, 41), bf16) and shapes["gate.scale"] == ((), f32)
    for i in range(L):
        assert shapes[f"blocks.{i}.mlp.fc_w"] == shapes[f"blocks.{i}.mlp.proj_w"] == ((3072, 768), f32)
        if i in RECORD_NO_ATTN:
            assert f"blocks.{i}.attn.qk_w" not in shapes and f"blocks.{i}.attn.vo_w" not in shapes
            continue
        # q's and k's rows in head pairs, one NorMuon matrix each (2026-04-08_PairedHeadMuon); v and o whole
        assert shapes[f"blocks.{i}.attn.qk_w"] == ((6, 256, 768), f32)
        assert shapes[f"blocks.{i}.attn.vo_w"] == ((2, 768, 768), f32)
        assert f"blocks.{i}.attn.gate_w" not in shapes and f"blocks.{i}.attn.xsa_w" not in shapes
        assert (f"blocks.{i}.attn.ve_gate_w" in shapes) == (i in RECORD_VE and i != 10)  # layer 10's: MUDD's
    assert shapes["mudd.w_in"] == ((2, 64, 768), bf16) and shapes["mudd.w_out"] == ((2, 64, 2, 8), bf16)
    assert shapes["mudd.bias"] == ((2, 2, 8), bf16)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == (7 * V * 768 + 15 * V // 2 * 768 + 10 * 4 * 768**2 + 11 * 2 * 3072 * 768 + 4 * 6 * 12 + 12
                       + 6 * L + 2 + 2 * 64 * 768 + 2 * 64 * 16 + 2 * 16 + 2 * 64 * 768 + 2 * 41 * 64 + 2 * 41 + 1)
    muon, adam = tg.param_groups(model)
    assert [tg.muon_shape_factor(p.shape) for p in muon["mlp_in"] + muon["mlp_out"]] == [2.0] * 22
    assert all(tg.muon_shape_factor(p.shape) == 1.0 for p in muon["attn_qk"] + muon["attn_vo"])
    # initial values the record starts from
    model = tg.GPT(tg.parse_args(["--model_dim", "64", "--num_heads", "2", "--head_dim", "32", "--seq_len", "128",
                                  "--val_seq_len", "128", "--val_tokens", "128", "--bigram_vocab", "1000"]))
    sa, smear, backout, skip = model.lambdas()
    assert sa.tolist() == [[0.5, 1.0]] * L and (smear.item(), backout, skip.item()) == (0.0, None, -1.5)
    # MUDD (2026-05-27 v3's bs_init): output weights zero, input weights torch's Linear init, the biases of the
    # last layer's weights at their old init, of its value gates at 2 and of the backout layer's source at -0.5,
    # over the scale 0.1
    mudd, scale = model.mudd, 0.1
    assert mudd.w_out.eq(0).all() and 0.9 * 64**-0.5 < mudd.w_in.float().abs().max() <= 64**-0.5
    want = torch.zeros(2, 2, 8)
    want[0, 0, 3] = want[0, 1, 3] = 2 / scale
    want[0, 0, 4] = want[0, 1, 4] = 1.1 ** 0.5 / scale
    want[0, 0, 5] = want[0, 1, 5] = 1 / scale
    want[0, 0, 7], want[1, 1, 1] = 0.05 / scale, -0.5 / scale
    assert torch.equal(mudd.bias, want.bfloat16())
    # 2026-03-06_SimplifyHC: residual weights sqrt(1.1) per sublayer, output weights 1, x0's 0, the bigram's 0.05
    assert model.resid_lambdas.sub(1.1 ** 0.5).abs().max() < 1e-7 and model.post_lambdas.eq(1).all()
    # the MUDD gate (2026-05-27 v3): output weights zero, so each coefficient starts at its bias times the scale
    # 0.1: XSA's shares and x0's 0, the output gates 0.25, the bigram's 0.05, the skip's 0.5, DC's mix in 1 and
    # out 0 (the record's bs_init, at 2 heads: the pre gate's 2 + 2 + 2 + 8, the post gate's 2 + 2 + 2 + 10 + 1 + 4)
    gate = model.gate
    assert gate.w_out.eq(0).all() and 0.9 * 64**-0.5 < gate.w_in.float().abs().max() <= 64**-0.5
    assert gate.scale.item() == pytest.approx(0.1)
    pre = [0, 0, 0, 0, 0.25, 0.25] + [0, 0.05] * 4
    post = [0, 0, 0, 0, 0.25, 0.25] + [0, 0.05] * 5 + [0.5, 1, 1, 0, 0]
    want = torch.tensor([pre + [0] * (len(post) - len(pre)), post]) / 0.1
    assert torch.equal(gate.bias, want.bfloat16())
    assert 0.004 < model.head_w.float().std() < 0.006 and torch.equal(model.embed.weight, model.head_w)
    for zero in [model.bigram_embed.weight, model.smear_gate_w, model.blocks[0].mlp.proj_w]:
        assert zero.eq(0).all()
    for e in model.value_embeds:  # 0.01 randn (2026-02-03)
        assert e.weight.dtype == torch.bfloat16 and 0.0095 < e.weight.float().std() < 0.0105
    # q, k, v and o uniform at the MLP input's scale, o included (2026-01-30)
    attn = model.blocks[0].attn
    for w, std in [*[(w, 0.5 * 64**-0.5) for w in (*attn.qk_w.reshape(2, 64, 64), *attn.vo_w)],
                   (model.blocks[0].mlp.fc_w, 0.5 * 64**-0.5)]:
        assert w.abs().max() <= 3**0.5 * std and w.std() > 0.9 * std


@pytest.mark.parametrize("flags,says", [
    (["--xsa_layers", "0,1"], "--xsa_layers names layers [0], which have no attention without paired heads"),
    (["--dc_layers", "9"], "--dc_layers names layers [9], which have no attention without paired heads"),
    (["--attn_gate_layers", "6"], "--attn_gate_layers names layers [6], which have no attention"),
    (["--dc_layers", "3"], "--dc_layers [3] come before --mudd_gate_layer 4"),
    (["--mudd_gate", "0"], "--dc_layers needs --mudd_gate"),
    (["--mudd_gate_layer", "11"], "--mudd_gate_layer 11 must be within 1..10"),
    (["--dc_window", "129"], "--dc_window 129 must be within 1..128"),
])
def test_gate_and_dc_layouts_are_checked(flags, says):
    """XSA and DC need attention without paired heads, the output gates attention; DC's mixes come from the
    MUDD gate's second MLP, so DC needs the gate and a layer at or after it; DC's window fits its kernel."""
    with pytest.raises(tg.UserError, match=re.escape(says)):
        tg.check_config(tg.parse_args(flags))
    tg.check_config(tg.parse_args(["--mudd_gate", "0", "--dc_layers="]))  # the layout before 2026-05-27


def test_attention_and_value_gates_scale_each_head():
    """sigmoid(W x[:12]) per head multiplies that head's output before the output projection; 2 sigmoid(W' x[:12])
    per head multiplies the value embedding added to its values."""
    cfg = record_layout_at_tiny_width(mudd=False, **STATIC)  # with MUDD the last layer's value gate is MUDD's
    attn = tg.GPT(cfg).blocks[10].attn
    rot = tg.Rotary(32, 512)
    attn.vo_w.data[1] = torch.eye(64)  # identity output projection: the gated heads show through
    x = torch.randn(1, 256, 64)
    mask = tg.attention_mask(tg.first_visible(torch.zeros(256, dtype=torch.long), torch.tensor(256)))
    sa = torch.tensor([0.5, 1.0])
    base = attn(x, None, mask, rot, sa, None).float()
    attn.gate_w.data[1, 0] = 3.0  # head 1's gate now depends on x[..., 0]
    gated = attn(x, None, mask, rot, sa, None).float()
    torch.testing.assert_close(gated[..., :32], base[..., :32])  # head 0 unchanged
    torch.testing.assert_close(gated[..., 32:], base[..., 32:] / 0.5 * torch.sigmoid(3.0 * x[..., :1]),
                               atol=1e-5, rtol=1e-5)
    # with v zero and each token seeing only itself, the output is its own gated value embedding; the value
    # embedding's gate reads x[:6] and the value embedding's own first 6 dims (2026-02-03)
    attn.vo_w.data[0] = 0
    ve = torch.randn(1, 256, 64)
    attn.ve_gate_w.data[0, 1] = 2.0   # head 0's gate: x[..., 1]
    attn.ve_gate_w.data[0, 7] = -1.0  # and the value embedding's dim 1
    itself = tg.attention_mask(tg.first_visible(torch.zeros(256, dtype=torch.long), torch.tensor(0)))
    out = attn(x, ve, itself, rot, sa, None).float()
    want = 2 * torch.sigmoid(2.0 * x[..., 1:2] - ve[..., 1:2]) * 0.5 * ve[..., :32]
    torch.testing.assert_close(out[..., :32], want, atol=1e-4, rtol=1e-3)


def test_fp8_head_only_where_the_gpu_has_fp8_tensor_cores():
    """build() turns the FP8 head off (with a log line) on GPUs below compute capability 8.9."""
    assert [tg.has_fp8_tensor_cores(c) for c in [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]] == \
        [False, False, False, True, True, True]


def test_every_symbol_of_the_recipe_map_exists():
    """The map at the top of train_gpt.py sends a reader from each trick to its code: every name after a line's
    dotted leader must be an attribute of the module, or of a class in it."""
    import re
    block = open(tg.__file__).read().split("# Recipe map")[1].split("# Where ours is laid out")[0]
    names = []
    for line in block.splitlines():
        if m := re.search(r"\.{2,} (.*)$", line):
            names += [n for n in re.split(r"[,\s]+", re.sub(r"\(.*", "", m.group(1))) if n]
    assert len(names) > 20, names
    for name in names:
        obj = tg
        for part in name.split("."):
            assert hasattr(obj, part), name
            obj = getattr(obj, part)


def test_auto_micro_batch_fits_the_gpus_free_memory():
    """--micro_batch 0 on a GPU: the largest of 4, 2, 1 that divides the stages' sequences and whose estimated peak
    fits 90% of the free memory, said in a note. The estimate at the default is the measured one: 34,031 MiB at
    four sequences a pass on an H100 (records/2026-12-07_muddgate-dc-h100); at two, the 6,267 MiB a sequence that
    the 2026-05-20 recipe's peaks at four and two (32,070 and 19,537 MiB under a 24 GiB cap,
    records/2026-12-07_cap24-h100) differ by, less."""
    cfg = tg.Hyperparameters()
    assert abs(tg.estimated_peak(cfg, 4) / 2**20 - 34031) < 32
    assert abs(tg.estimated_peak(cfg, 2) / 2**20 - (34031 - (32070 - 19537))) < 20
    chosen = {gib: tg.micro_batch_choice(cfg, 1, gib * 2**30) for gib in (79, 40, 23.6, 16, 10)}
    assert {gib: c[0] for gib, c in chosen.items()} == {79: 4, 40: 4, 23.6: 2, 16: 1, 10: 1}
    assert chosen[23.6][1] == ("note:micro_batch_auto chose:2 why:peak_near_21.0GiB_(an_estimate)_of_23.6GiB_free;"
                               "_4_a_pass_would_peak_near_33.2GiB")
    assert "even_1_a_pass_may_not_fit" in chosen[10][1]
    assert tg.micro_batch_choice(cfg, 1) == (4, "")  # on CPU: divisibility alone, no note
    assert tg.micro_batch_choice(dataclasses.replace(cfg, micro_batch=2), 1, 10 * 2**30) == (2, "")  # as asked
    odd = dataclasses.replace(cfg, batch_seqs=(3, 6, 9))
    assert tg.micro_batch_choice(odd, 1, 79 * 2**30)[0] == 1  # neither 4 nor 2 divides 3
    # a twice as wide model costs more a sequence and besides: at 60 GiB it no longer fits four a pass (the default does)
    wide = dataclasses.replace(cfg, model_dim=1536, num_heads=12)
    assert tg.micro_batch_choice(wide, 1, 60 * 2**30)[0] == 2 and tg.micro_batch_choice(cfg, 1, 60 * 2**30)[0] == 4
