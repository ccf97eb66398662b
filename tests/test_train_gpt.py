"""CPU tests of train_gpt.py's ops and model, each against an independent reference: a brute-force mask, float64
attention, torch.optim.Adam, an SVD polar factor, complex-number RoPE, the record's layout written out."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import train_gpt as tg

BOS = 50256  # GPT-2's <|endoftext|>, written out rather than taken from the code under test
BLOCK = 128


# ---- attention mask: brute force from the definition

def reference_mask(tokens: np.ndarray, window: int) -> np.ndarray:
    """Position by position: query q sees key k if k <= q, no document starts after k and at or before q
    (documents start at <|endoftext|>), and k's 128-token block is fewer than `window` blocks before q's."""
    T = len(tokens)
    doc_start, start = np.zeros(T, dtype=np.int64), 0
    for i, tok in enumerate(tokens):
        if tok == BOS:
            start = i
        doc_start[i] = start
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    return (k <= q) & (k >= doc_start[:, None]) & (q // BLOCK - k // BLOCK < window)


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


CASES = [(1024, w) for w in (1, 2, 3, 5, 8)] + [(4096, w) for w in (16, 30)]


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


@pytest.mark.parametrize("T,window", CASES)
def test_dense_and_block_masks_equal_brute_force(T, window):
    for name, tokens in token_layouts(T, window).items():
        want = torch.from_numpy(reference_mask(tokens, window))
        starts, w = tg.document_starts(torch.from_numpy(tokens)), torch.tensor(window)
        assert torch.equal(tg.dense_attention_mask(tg.first_visible(starts, w)), want), name
        bm = tg.block_attention_mask(tg.first_visible(starts, w))
        assert torch.equal(expand_block_mask(bm, T), want), name
        # what backward walks, per key block the query blocks, against torch's own transpose of the kv layout
        ref = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                       BLOCK_SIZE=BLOCK)
        for field in ["q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]:
            ours, torchs = getattr(bm, field), getattr(ref, field)
            assert ours.dtype == torchs.dtype and torch.equal(ours, torchs), (name, field)


def test_block_masks_are_built_without_sorts_or_reductions():
    """Compiled, a stable argsort becomes a Triton sort whose cold compile took the training graph from 51 to
    115 s on an H200 (pytorch issue 182060); cumsums and row sums over the 384 blocks, fused with the block
    comparisons, failed inductor's codegen on torch 2.11. The BlockMask's layouts come from a matmul and a
    scatter: pointwise kernels and one GEMM."""
    from torch.fx.experimental.proxy_tensor import make_fx
    tokens = torch.from_numpy(token_layouts(1024, 3)["random"])
    build = lambda d, w: tg.block_attention_mask(tg.first_visible(d, w)).as_tuple()[2:10]  # noqa: E731
    graph = make_fx(build)(tg.document_starts(tokens), torch.tensor(3))
    ops = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "aten.scatter.src" in ops and not [op for op in ops if "sort" in op or "cumsum" in op
                                              or op.startswith(("aten.sum", "aten.amax", "aten.any"))], ops


def reference_attention(q, k, v, mask, scale):
    """Softmax attention in float64 over (T, heads, dim) with a (T, T) bool mask."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose
@pytest.mark.parametrize("T,window", [(1024, 1), (1024, 3), (4096, 30)])
def test_flex_and_sdpa_paths_equal_reference_attention(T, window):
    """Both ways attention() runs, FlexAttention with the BlockMask (the GPU path) and SDPA with the dense mask
    (the CPU path), against float64 attention with the brute-force mask."""
    gen = torch.Generator().manual_seed(window)
    tokens = token_layouts(T, window)["random"]
    starts, w = tg.document_starts(torch.from_numpy(tokens)), torch.tensor(window)
    q, k, v = (torch.randn(1, T, 2, 16, generator=gen) for _ in range(3))
    want = reference_attention(q[0], k[0], v[0], torch.from_numpy(reference_mask(tokens, window)), 0.12)
    block_mask = tg.block_attention_mask(tg.first_visible(starts, w))
    flex = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=0.12).transpose(1, 2)
    sdpa = tg.attention(q, k, v, tg.attention_mask(starts, w), 0.12)
    torch.testing.assert_close(flex[0].double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sdpa[0].double(), want, atol=1e-5, rtol=1e-5)


# the record's 12-layer layout (Aug 2025), written out: which layers see the long window, which have no
# attention, which value-embedding table feeds which layer, and the U-Net skips
RECORD_LONG = {0, 4, 7, 11}
RECORD_NO_ATTN = {7}
RECORD_VE = {0: 0, 1: 1, 2: 2, 9: 0, 10: 1, 11: 2}
RECORD_SKIPS = {6: 5, 7: 4, 8: 3, 9: 2, 10: 1, 11: 0}  # layer -> the earlier layer whose output it adds


def record_layout_at_tiny_width(**over):
    args = ["--device", "cpu", "--seq_len", "512", "--val_seq_len", "512", "--val_tokens", "512",
            "--model_dim", "64", "--num_heads", "2", "--head_dim", "32", "--fp8_head", "0"]
    cfg = tg.parse_args(args)
    assert cfg.num_layers == 12 and set(cfg.long_window_layers) == RECORD_LONG
    assert set(cfg.no_attn_layers) == RECORD_NO_ATTN
    return tg.dataclasses.replace(cfg, **over)


def test_each_layer_gets_its_window(monkeypatch):
    """Long-window layers see the whole window, the others half of it (at least one block)."""
    cfg = record_layout_at_tiny_width()
    model = tg.GPT(cfg)
    tokens = token_layouts(512, 0)["random"]
    seen = []
    real = tg.attention
    monkeypatch.setattr(tg, "attention", lambda q, k, v, mask, scale: seen.append(mask) or real(q, k, v, mask, scale))
    for window in (1, 3, 4):
        seen.clear()
        idx = torch.from_numpy(tokens).int()
        model(idx, idx, torch.tensor(window))
        layers = [i for i in range(12) if i not in RECORD_NO_ATTN]
        assert len(seen) == len(layers)
        for layer, mask in zip(layers, seen):
            want = window if layer in RECORD_LONG else max(1, window // 2)
            assert torch.equal(mask, torch.from_numpy(reference_mask(tokens, want))), (layer, window)


def test_unet_skips_and_value_embeddings_follow_the_record():
    """Stub blocks that add i+1 to the residual make each layer's input a known constant offset from x0: the
    offsets check the skips, and value-embedding tables filled with t+1 show which table reached which layer."""
    cfg = record_layout_at_tiny_width()
    model = tg.GPT(cfg)
    model.embed.float()  # an fp32 residual stream, so the offsets below are exact
    for t, e in enumerate(model.value_embeds):
        e.weight.data.fill_(t + 1)
    model.skip_weights.data = torch.tensor([0.5, 0.25, 2.0, 3.0, 0.75, 1.5])
    calls = {}

    class Stub(nn.Module):
        def __init__(self, i, long_window):
            super().__init__()
            self.i, self.long_window = i, long_window

        def forward(self, x, x0, ve, mask, skip=None):
            if skip is not None:  # (weight, earlier output): the block adds it to its input first
                x = x + skip[0] * skip[1]
            calls[self.i] = (x.clone(), x0, None if ve is None else ve.float().mean().item())
            return x + (self.i + 1)

    model.blocks = nn.ModuleList(Stub(i, b.long_window) for i, b in enumerate(model.blocks))
    idx = torch.randint(0, 50257, (256,), dtype=torch.int32)
    model(idx, idx, torch.tensor(1))
    x0 = calls[0][1]
    outputs, a, c = {}, 1.0, 0.0  # a layer's input is a * x0 + c
    for i in range(12):
        if i in RECORD_SKIPS:
            w, (aj, cj) = model.skip_weights[RECORD_SKIPS[i]].item(), outputs[RECORD_SKIPS[i]]
            a, c = a + w * aj, c + w * cj
        torch.testing.assert_close(calls[i][0], a * x0 + c, msg=f"layer {i}")
        assert calls[i][2] == (RECORD_VE[i] + 1 if i in RECORD_VE else None), i
        c += i + 1
        outputs[i] = (a, c)


# ---- the whole forward pass against a float64 reference written from the record's description

def ref_rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def ref_rope(x: torch.Tensor) -> torch.Tensor:
    """(T, heads, d): dims j and j+d/2 as one complex number turned by -pos*f_j; f_j = (1/1024)^(j/(d/4-1)) for
    the first d/4 pairs, 0 for the other d/4."""
    T, d = x.size(0), x.size(-1)
    f = torch.cat([(1 / 1024) ** torch.linspace(0, 1, d // 4, dtype=torch.float64),
                   torch.zeros(d // 4, dtype=torch.float64)])
    turn = torch.exp(-1j * torch.arange(T, dtype=torch.float64)[:, None, None] * f)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * turn
    return torch.cat([z.real, z.imag], -1)


def ref_attention(P: dict, i: int, h: torch.Tensor, ve, visible: torch.Tensor, heads: int) -> torch.Tensor:
    """Layer i's attention on its normed input h (T, dim), brute force: per head softmax(0.12 q.k) over the
    visible keys, QK rms-normed then turned, v = l0 v (+ l1 ve), each head's output times sigmoid of a linear
    map of h's first 12 dims, then the output projection."""
    T, dim = h.shape
    W = P[f"blocks.{i}.attn.qkvo_w"]
    q, k, v = ((h @ W[j].T).view(T, heads, dim // heads) for j in range(3))
    q, k = ref_rope(ref_rms(q)), ref_rope(ref_rms(k))
    lam = P[f"blocks.{i}.attn.v_lambdas"]
    v = lam[0] * v + (lam[1] * ve.view(T, heads, -1) if ve is not None else 0)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 0.12
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    y = torch.einsum("hqk,khd->qhd", p, v)
    gate = torch.sigmoid(h[:, :12] @ P[f"blocks.{i}.attn.gate_w"].T)  # (T, heads)
    return (y * gate[..., None]).reshape(T, dim) @ W[3].T


def ref_hidden(P: dict, idx: np.ndarray, window: int, heads: int) -> torch.Tensor:
    """The record's 12 layers (RECORD_* above): x0 = rmsnorm(embedding); each layer first adds its U-Net skip
    (weight * an earlier layer's output), mixes l0 x + l1 x0, then adds attention and a ReLU^2 MLP of
    pre-normed inputs."""
    ids = torch.from_numpy(idx).long()
    x = x0 = ref_rms(P["embed.weight"][ids])
    outputs = {}
    for i in range(12):
        if i in RECORD_SKIPS:
            j = RECORD_SKIPS[i]
            x = x + P["skip_weights"][j] * outputs[j]
        lam = P[f"blocks.{i}.lambdas"]
        x = lam[0] * x + lam[1] * x0
        if i not in RECORD_NO_ATTN:
            ve = P[f"value_embeds.{RECORD_VE[i]}.weight"][ids] if i in RECORD_VE else None
            visible = torch.from_numpy(reference_mask(idx, window if i in RECORD_LONG else max(1, window // 2)))
            x = x + ref_attention(P, i, ref_rms(x), ve, visible, heads)
        h = ref_rms(x)
        x = x + torch.relu(h @ P[f"blocks.{i}.mlp.fc_w"]).square() @ P[f"blocks.{i}.mlp.proj_w"].T
        outputs[i] = x
    return x


def randomized_record_model(seed: int) -> "tg.GPT":
    """The record's layout at width 64 in fp32, every parameter random and non-zero, so that the zero-initialised
    paths (output projections, gates, lm_head) and the lambdas take part."""
    gen = torch.Generator().manual_seed(seed)
    model = tg.GPT(record_layout_at_tiny_width()).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if p.ndim < 2 or "embed" in name else 1.5 * p.size(-1) ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name.endswith("lambdas") else 0.0))
    return model


@pytest.mark.parametrize("window", [1, 3])
def test_model_equals_float64_reference(window):
    """Hidden states, the loss with the head, and the grads of every kind of parameter against ref_hidden, a float64
    forward pass written from the record's description (it shares no code with train_gpt.py but the parameter
    names). At fp32 the model is exact to rounding (1e-5); its head is a bf16 matmul, as the record's, so the
    reference rounds the head's operands and logits to bf16 too."""
    model = randomized_record_model(window)
    tokens = token_layouts(513, 0)["random"]
    idx, targets = tokens[:-1], tokens[1:]
    P = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    R = torch.randn(512, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = ref_hidden(P, idx, window, heads=2)
    got = model.hidden(torch.from_numpy(idx).int(), torch.tensor(window))[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # grads of a random projection of the hidden states: every parameter the blocks read
    (want * R).sum().backward()
    (got.double() * R).sum().backward()
    checked = [n for n, p in model.named_parameters() if n != "head_w"]
    assert len(checked) > 60
    for name in checked:
        g, ref = dict(model.named_parameters())[name].grad.double(), P[name].grad
        assert ((g - ref).norm() / ref.norm()).item() < 1e-4, name
    # the loss: the soft-capped cross-entropy of z = rmsnorm(hidden) @ head_w.T, a bf16 matmul (bf16 operands and
    # logits) as in the record
    z = (ref_rms(want.detach()).bfloat16().double() @ P["head_w"].detach().bfloat16().double().T).bfloat16().double()
    c = 30 * torch.sigmoid(z / 7.5)
    want_loss = (torch.logsumexp(c, -1) - c[torch.arange(512), torch.from_numpy(targets).long()]).sum()
    got_loss = model(torch.from_numpy(idx).int(), torch.from_numpy(targets).int(), torch.tensor(window))
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-5)


# ---- RoPE, soft-cap, loss

def test_rotary_equals_complex_rotation():
    """RoPE as the record describes it: dims j and j+d/2 form a complex number rotated by -pos*f_j, with d/4
    frequencies geometric from 1 to 1/1024 rad/token and d/4 zero ones."""
    T, d = 300, 32
    x = torch.randn(1, T, 3, d, dtype=torch.float64)
    freqs = [1024.0 ** (-j / (d // 4 - 1)) for j in range(d // 4)] + [0.0] * (d // 4)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:])
    angle = torch.arange(T, dtype=torch.float64)[:, None] * torch.tensor(freqs, dtype=torch.float64)
    rotated = z * torch.exp(-1j * angle)[None, :, None, :]
    want = torch.cat([rotated.real, rotated.imag], dim=-1)
    got = tg.Rotary(d, T)(x.float())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    # what RoPE is for: q.k depends only on the offset between positions
    q, k = torch.randn(d).expand(1, T, 1, d), torch.randn(d).expand(1, T, 1, d)
    rq, rk = tg.Rotary(d, T)(q), tg.Rotary(d, T)(k)
    assert (rq[0, 50, 0] @ rk[0, 40, 0]).item() == pytest.approx((rq[0, 250, 0] @ rk[0, 240, 0]).item(), rel=1e-4)


def test_head_loss_equals_softcapped_cross_entropy():
    """Sum over tokens of logsumexp(c) - c[target], c = 30 sigmoid(z / 7.5), z = rmsnorm(x) @ W.T: the record's
    head, from its formula in float64 (on the bf16-rounded operands the head multiplies)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen)
    w = torch.randn(500, 48, generator=gen) * 2.0  # logits up to ~+-40: the cap matters
    targets = torch.randint(0, 500, (64,), generator=gen)
    xn = (x / x.pow(2).mean(-1, keepdim=True).sqrt()).bfloat16().double()
    z = xn @ w.bfloat16().double().T
    c = 30 * torch.sigmoid(z / 7.5)
    want = (torch.logsumexp(c, -1) - c[torch.arange(64), targets]).sum()
    got = tg.head_loss(x, w, targets, fp8=False)
    assert got.item() == pytest.approx(want.item(), rel=2e-3)


def test_eval_loss_is_the_same_sum_in_chunks(monkeypatch):
    """Validation runs the bf16 head in chunks of EVAL_CHUNK tokens: the sum must not depend on the chunking."""
    cfg = record_layout_at_tiny_width(num_layers=2, long_window_layers=(0,), no_attn_layers=())
    model = tg.GPT(cfg).eval()
    model.head_w.data.normal_(0, 0.5)
    idx = torch.randint(0, 50257, (512,), dtype=torch.int32)
    with torch.no_grad():
        whole = model(idx[:-1].contiguous(), idx[1:].contiguous(), torch.tensor(2))
        monkeypatch.setattr(tg, "EVAL_CHUNK", 100)
        chunked = model(idx[:-1].contiguous(), idx[1:].contiguous(), torch.tensor(2))
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-5)


# ---- optimizer math

def test_adam_update_equals_torch_adam():
    gen = torch.Generator().manual_seed(0)
    p_ours = torch.randn(40, 30, generator=gen)
    p_ref = p_ours.clone().requires_grad_()
    ref = torch.optim.Adam([p_ref], lr=0.01, betas=(0.8, 0.95), eps=1e-10)
    m, v = torch.zeros_like(p_ours), torch.zeros_like(p_ours)
    for step in range(1, 8):
        g = torch.randn(40, 30, generator=gen) * 10 ** (step % 3)
        p_ref.grad = g.clone()
        ref.step()
        p_ours -= 0.01 * tg.adam_update(g, m, v, step, (0.8, 0.95), 1e-10)
    torch.testing.assert_close(p_ours, p_ref.detach(), atol=1e-6, rtol=1e-6)


def test_muon_feeds_nesterov_momentum_to_newton_schulz(monkeypatch):
    """Hand-written Nesterov: buf = m*buf + (1-m)*g; the matrix orthogonalized is (1-m)*g + m*buf."""
    fed = []
    monkeypatch.setattr(tg, "newton_schulz5", lambda G: fed.append(G.clone()) or G)
    gen = torch.Generator().manual_seed(0)
    buf_ours, buf_ref = torch.zeros(8, 32), torch.zeros(8, 32)
    for m in (0.85, 0.9, 0.95, 0.95):
        g = torch.randn(8, 32, generator=gen)
        tg.muon_update(g, buf_ours, m)
        buf_ref = m * buf_ref + (1 - m) * g
        torch.testing.assert_close(fed[-1], (1 - m) * g + m * buf_ref)
    # tall matrices step sqrt(rows/cols) further
    tall = tg.muon_update(torch.randn(32, 8), torch.zeros(32, 8), 0.9)
    torch.testing.assert_close(tall, fed[-1] * 2.0)


def test_cpu_bf16_matmul_is_torch_bf16_matmul():
    """mm's CPU path (fp32 matmul of the bf16 values, rounded once) against torch's own bf16 matmul, forward
    and backward: the results may differ only where fp32 sums in another order round to a neighbouring bf16."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 64, 96, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(96, 80, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(3, 64, 80, generator=gen).bfloat16()
    ours, ref = tg.mm(a, b), a @ b
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    for x, y in [(ours, ref), *zip(torch.autograd.grad(ours, (a, b), g), torch.autograd.grad(ref, (a, b), g))]:
        assert x.dtype == y.dtype
        ulp = y.float().abs() * 2**-7  # bf16 keeps 8 significant bits
        assert ((x.float() - y.float()).abs() <= ulp + 1e-6).all()
        assert (x == y).float().mean() > 0.99  # measured: all equal on an AVX2 CPU


@pytest.mark.parametrize("shape", [(768, 768), (768, 3072), (6, 12), (1024, 256)])
def test_newton_schulz_approximates_the_svd_polar_factor(shape):
    """The model's matrix shapes (and a tall one): close in direction to U V^T, and singular values in the band
    the quintic coefficients aim for, about [0.7, 1.2], except the smallest few percent of a random square
    matrix's, which start near 0 and converge slower. (A normalized but unorthogonalized G has cosine 0.85-0.97
    and most singular values far below 0.6.)"""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = tg.newton_schulz5(G).double()
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    assert ((X * polar).sum() / (X.norm() * polar.norm())).item() > 0.975
    s = torch.linalg.svdvals(X).sort().values
    assert s[int(0.05 * (len(s) - 1))] > 0.6 and 0.7 < s.median() < 1.1 and s[-1] < 1.25, s


def test_sharded_optimizer_adam_groups_equal_torch_adam():
    """The bucketed, sharded step on the fp32 Adam groups (head, scalars) equals torch.optim.Adam with the
    group's lr times the schedule factor."""
    cfg = record_layout_at_tiny_width(num_layers=2, long_window_layers=(0,), no_attn_layers=())
    model = tg.GPT(cfg)
    model.head_w.data.normal_(0, 0.1)
    muon, adam = tg.param_groups(model, cfg)
    opt = tg.ShardedOptimizer(muon, cfg.muon_lr, adam, (0.8, 0.95), 1e-10, tg.Comm(0, 1))
    fp32 = [(lr, ps) for lr, ps in adam if ps[0].dtype == torch.float32]
    refs = [(lr, [p.detach().clone().requires_grad_() for p in ps]) for lr, ps in fp32]
    ref_opts = [torch.optim.Adam(ps, lr=lr, betas=(0.8, 0.95), eps=1e-10) for lr, ps in refs]
    gen = torch.Generator().manual_seed(1)
    for step, factor in enumerate([1.0, 1.0, 0.5, 0.25]):
        for (lr, ps), (_, rps), ropt in zip(fp32, refs, ref_opts):
            for p, rp in zip(ps, rps):
                p.grad = torch.randn(p.shape, generator=gen)
                rp.grad = p.grad.clone()
            for group in ropt.param_groups:
                group["lr"] = lr * factor
            ropt.step()
        for p in muon + [p for _, ps in adam for p in ps if p.dtype != torch.float32]:
            p.grad = torch.zeros_like(p)
        opt.step(factor, 0.9)
    for (_, ps), (_, rps) in zip(fp32, refs):
        for p, rp in zip(ps, rps):
            torch.testing.assert_close(p.detach(), rp.detach(), atol=1e-6, rtol=1e-6)


# ---- schedules against their formulas

@pytest.mark.parametrize("num_steps", [1695, 125])
def test_schedules_follow_their_formulas(num_steps):
    cfg = tg.parse_args(["--num_steps", str(num_steps)])
    for s in sorted({0, 1, num_steps // 3, int(0.55 * num_steps), int(0.55 * num_steps) + 1, num_steps // 2,
                     int(0.8 * num_steps), num_steps - 1, num_steps}):
        x = s / num_steps
        lr = 1.0 if x < 0.55 else (1 - x) / 0.45 + (1 - (1 - x) / 0.45) * 0.1
        assert tg.lr_factor(s, cfg) == pytest.approx(lr), s
        assert tg.window_blocks(s, cfg) == max(1, math.ceil(13.5 * s / num_steps)), s  # 1728/128 = 13.5
        assert tg.muon_momentum(s, cfg) == pytest.approx(0.85 + 0.10 * min(s / 300, 1)), s
    assert tg.window_blocks(num_steps, cfg) * 128 == 1792 and tg.lr_factor(num_steps, cfg) == pytest.approx(0.1)


# ---- the recipe: the Aug 2025 record's constants, pinned

def test_a_saved_config_reads_back_as_the_same_hyperparameters():
    """Checkpoints and log lines keep the config as JSON (tuples become lists); a key from another version of the
    script is left out rather than refused, so --generate and records/tool.py read older and newer files."""
    saved = json.loads(json.dumps(dataclasses.asdict(tg.Hyperparameters(num_steps=100, no_attn_layers=(2, 5)))))
    assert tg.hyperparameters_from({**saved, "from_another_version": 1}) == tg.Hyperparameters(
        num_steps=100, no_attn_layers=(2, 5))


def test_defaults_are_the_aug_2025_record():
    cfg = tg.Hyperparameters()
    record = dict(num_steps=1695, seq_len=48 * 1024, batch_seqs=8, val_seq_len=262_144, val_tokens=10_485_760,
                  cooldown_frac=0.45, max_window=1792, val_every=125, target_val_loss=3.28, stop_at_target=False,
                  vocab_size=50304, num_layers=12, model_dim=768, num_heads=6, head_dim=128,
                  long_window_layers=(0, 4, 7, 11), no_attn_layers=(7,), fp8_head=True, muon_lr=0.05,
                  head_lr=0.008, embed_lr=0.6, scalar_lr=0.04, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-10,
                  momentum_warmup_steps=300)
    assert {k: getattr(cfg, k) for k in record} == record
    assert cfg.seq_len * cfg.batch_seqs == 393_216 and cfg.val_tokens % cfg.val_seq_len == 0
    assert (tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE, tg.SOFTCAP, tg.SOFTCAP_DIV) == (2**-9, 1 / 448, 30.0, 7.5)
    assert tg.NS_COEFFS == (3.4445, -4.7750, 2.0315) and tg.Attention.SCALE == 0.12
    assert tg.Attention.GATE_DIMS == 12


def test_full_size_model_has_the_record_parameters():
    with torch.device("meta"):
        model = tg.GPT(tg.Hyperparameters())
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
    f32, bf16 = torch.float32, torch.bfloat16
    assert shapes["embed.weight"] == ((50304, 768), bf16) and shapes["head_w"] == ((50304, 768), f32)
    assert [shapes[f"value_embeds.{i}.weight"] for i in range(3)] == [((50304, 768), bf16)] * 3
    assert shapes["skip_weights"] == ((6,), f32)
    for i in range(12):
        assert shapes[f"blocks.{i}.mlp.fc_w"] == ((768, 3072), f32)  # stored (768, 3072): Muon lr 0.05
        assert shapes[f"blocks.{i}.mlp.proj_w"] == ((768, 3072), f32)
        assert shapes[f"blocks.{i}.lambdas"] == ((2,), f32)
        if i == 7:
            assert f"blocks.{i}.attn.qkvo_w" not in shapes
            continue
        assert shapes[f"blocks.{i}.attn.qkvo_w"] == ((4, 768, 768), f32)
        assert shapes[f"blocks.{i}.attn.gate_w"] == ((6, 12), f32)
        assert shapes[f"blocks.{i}.attn.v_lambdas"] == (((2,) if i in RECORD_VE else (1,)), f32)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == 5 * 50304 * 768 + 11 * (4 * 768 * 768 + 6 * 12) + 12 * 2 * 768 * 3072 + 6 + 12 * 2 + 6 * 2 + 5
    muon, adam = tg.param_groups(model, tg.Hyperparameters())
    assert all(max(1, p.size(-2) / p.size(-1)) == 1 for p in muon)  # every hidden matrix at lr 0.05
    assert [lr for lr, _ in adam] == [0.008, 0.6, 0.04]
    # initial values the record starts from
    model = tg.GPT(tg.parse_args(["--model_dim", "64", "--num_heads", "2", "--head_dim", "32", "--seq_len", "128",
                                  "--val_seq_len", "128", "--val_tokens", "128"]))
    attn = model.blocks[0].attn
    assert (attn.gate_w == 0).all() and attn.v_lambdas.tolist() == [0.5, 0.5]
    assert model.blocks[3].attn.v_lambdas.tolist() == [0.5]
    assert (model.head_w == 0).all() and (attn.qkvo_w[3] == 0).all() and (model.blocks[0].mlp.proj_w == 0).all()
    bound = 3**0.5 * 0.5 / 64**0.5
    assert model.blocks[0].mlp.fc_w.abs().max() <= bound and model.blocks[0].mlp.fc_w.std() > 0.8 * bound / 3**0.5


def test_attention_gate_scales_each_head():
    """sigmoid(W x[:12]) per head multiplies that head's output before the output projection."""
    cfg = record_layout_at_tiny_width(num_layers=2, long_window_layers=(0,), no_attn_layers=())
    attn = tg.GPT(cfg).blocks[0].attn
    attn.qkvo_w.data[3] = torch.eye(64)  # identity output projection: the gated heads show through
    x = torch.randn(1, 256, 64)
    mask = tg.attention_mask(torch.zeros(256, dtype=torch.long), torch.tensor(2))
    base = attn(x, None, mask).float()
    attn.gate_w.data[1, 0] = 3.0  # head 1's gate now depends on x[..., 0]
    gated = attn(x, None, mask).float()
    torch.testing.assert_close(gated[..., :32], base[..., :32])  # head 0 unchanged
    want = base[..., 32:] / 0.5 * torch.sigmoid(3.0 * x[..., :1])
    torch.testing.assert_close(gated[..., 32:], want, atol=1e-5, rtol=1e-5)


def test_fp8_head_only_where_the_gpu_has_fp8_tensor_cores():
    """build() turns the FP8 head off (with a log line) on GPUs below compute capability 8.9."""
    assert [tg.has_fp8_tensor_cores(c) for c in [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]] == \
        [False, False, False, True, True, True]
