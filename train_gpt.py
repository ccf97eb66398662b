"""
train_gpt.py: train a GPT-2-small-class model on FineWeb .bin shards to val loss <= 3.28, as fast as possible.

    torchrun --standalone --nproc_per_node=8 train_gpt.py      # the record setup; 1, 2, 4 or 8 GPUs run the
                                                               # same training (fewer GPUs accumulate)
    python train_gpt.py --help                                 # every hyperparameter; any one can be overridden
    python train_gpt.py --preset smoke                         # a tiny model on CPU, on the shipped books
    python train_gpt.py --generate CKPT --prompt "Once"        # sample from a checkpoint (--generate --help)
    python train_gpt.py --hellaswag CKPT                       # score one on HellaSwag (--hellaswag --help)

The recipe is the NanoGPT speedrun's master of 2026-08-01 (2026-07-17's FP8 MLP down projection, 2026-05-27's MUDD
gate and DC, 2026-07-13's prefix-token loss, on 2026-05-20's sign trick, 2026-05-07's XSA and 2026-04-22's
MUDD: 1285 steps, batches growing from 131,072 to 393,216 tokens); the recipe map at the top of this file names
where each of its tricks lives.
Each run writes logs/<run_id>.txt, which starts with this file's source and the environment, so a log is enough
to re-run and diff it; a resumed run appends to it. Sections, in order: config and schedules, model, optimizer,
data, training, checkpoints, sampling, main, and last the hand-written GPU kernels ("GPU fast paths"), each with
the plain-torch function it computes (what runs on CPU and what the tests check it against).
"""

# ----------------------------------------------------------------------------------------------------------
# Recipe map: each trick of the default's record -> the symbol that implements it (the record folder, under
# records/track_1_short/ of the speedrun's repository, that introduced it). The default follows the records in
# order up to the last one named here; each port is a commit named after its record.
#
#   data     documents clipped to 2048 tokens, BOS-aligned micro-batches ..... TrainLoader (2025-09-03_FA3)
#            documents clipped to 896 tokens in the first third .............. max_doc_len_at (2026-02-10_ShortWindow)
#            batch size 131K -> 262K -> 393K tokens by thirds ................ batch_seqs_at (2025-11-29)
#            stages end at round(S/3), round(2S/3); lr, batch, windows and MTP  stage_at, lr_factor
#              by stage; cooldown from step int(0.4 S) ...................... (2026-01-30_VeFused: TrainingSchedule)
#   model    11 layers, every MLP kept, layer 6's attention dropped ............ Hyperparameters.no_attn_layers
#                                                                               (2026-01-19_BigramHashEmbedding)
#            token-exact windows, long on layers 3 and 10, grown in stages ... first_visible, windows_at
#            YaRN: RoPE frequencies and attention scale at each window stage ... yarn (2025-09-10_Yarn)
#            smear: each token embedding mixes in its predecessor's, gated ..... GPT.embed_tokens (2025-09-18_Smear)
#            backout: the output less a learned multiple of layer 7's output . GPT.run_blocks (2025-10-04_Backout;
#                                                                               MUDD's bias from 2026-04-22)
#            one gated U-Net skip, layer 3's output into layer 6 .............. GPT.run_blocks (2025-11-18)
#            partial key offset: stationary key dims shifted one token ....... shift_stationary_keys (2025-12-14)
#            embedding tied to lm_head until 2/3 of training ................. ShardedOptimizer.untie (2025-12-19)
#            FP8 lm_head, scales 100/448, 1.6/448, 0.75/448 .................. HEAD_W_SCALE (2025-12-19_RetieLMHead)
#            multi-token prediction: [1, .5, .25->0] -> [1, .5->0] -> [1] ... mtp_weights_at (2025-12-22)
#            soft cap 23 sigmoid((z + 5) / 7.5) ............................... softcap (2025-12-26_LogitRescale)
#            value-embedding gates and the skip gate .......................... Attention.forward, GPT.run_blocks
#                                                                               (2025-12-29_VeSkipGates)
#            paired-head attention on layers 0, 2, 5, 9 ...................... Attention, paired_positions
#                                                                               (2026-01-07_PairedHeadAttention)
#            bigram hash embedding added to every layer ...................... bigram_hash (2026-01-19)
#              each row times a fixed random +-1 row picked by (previous      bigram_sign_rows, GPT.core,
#              token xor token) mod 8192 ..................................... add_to_first_dims (2026-05-20_
#                                                                               BigramsSignTrick; it made the table
#                                                                               192 wide, 15 x 50,304 rows)
#              768 wide, 7.5 x 50,304 rows ................................... bigram_width (2026-05-27 v3)
#            one value-embedding table per layer that has one ................ Hyperparameters.value_embeds
#                                                                               (2026-01-26-UntieValueEmbeddings)
#            q, k, v and o all start uniform at std 0.5/sqrt(768), o not zero . ATTN_INIT_STD
#                                                                               (2026-01-30_MimeticValueOutput; its
#                                                                               runs tried a mimetic V-O init, the
#                                                                               later records' scripts keep this)
#            value embeddings on layers 1, 2 and 8-10, from 0.01 randn; their  VE_GATE_X, VE_INIT_STD
#              gates read the first 6 dims of x and of the value embedding ... (2026-02-03_VeTuned; paired-head
#                                                                               layers' too since the master of
#                                                                               2026-05-27 v3)
#            each sublayer x = resid x + post out, x0 and the bigram embedding  Block.forward, RESID_INIT,
#              added with the attention's output (bigram from 0.05); the      BIGRAM_INIT, GPT.run_blocks
#              layers after layer 7 attend to its output, not to x ........... (2026-03-06_SimplifyHC)
#            MUDD: after layers 9 and 10, per-token weights from a small MLP  MUDD, GPT.run_blocks, Attention.forward
#              mix x0 and layers 7, 9, 3 and the first value embedding into   (2026-04-22_MuddFormer, its v3;
#              the stream; layer 9's also give layer 10 an addition to v, its  1405 + 10 steps)
#              value-embedding gate and its stream weights, per token; scale
#              0.1, v's sources unscaled, the value gate's 2 in its bias ..... MUDD_SCALE (the master's, in
#                                                                               2026-05-27 v3's code)
#            gated XSA: each head's output less tanh(a) x its part along its  Attention.forward, has_xsa
#              own value, (y.v) v / |v|^2 (PR 317's form) .................... (2026-05-07_XSAGatedLayers, the
#                                                                               change of 2026-04-29's logs too;
#                                                                               1375 + 10)
#            the MUDD gate: two small MLPs, on x0 and on the stream entering  MuddGate, gate_layout, HeadGates,
#              layer 4, make per token XSA's shares (layers 1, 3, 4, 7 now),  GPT.run_blocks
#              the output gates (layers 3 and 10 only, no sigmoid), x0's and  (2026-05-27-MuddGatedAndDC, its
#              the bigram's shares and the skip's weight; x0 no longer holds   v3; 1275 + 15 steps)
#              layer 0's bigram share
#            lightweight DC on layer 10: each head adds b_h (A @ v_h), A the  dc_correction, Hyperparameters.dc_*
#              heads' softmaxes over the last 112 tokens mixed by a_h; a and  (2026-05-27-MuddGatedAndDC v3)
#              b from the MUDD gate
#            prefix-token prediction: a loss on the next token's longest
#              proper prefix that is a GPT-2 token, 0.25 -> 0 by the end of
#              the second third ............................................. prefix_tokens, prefix_weight_at
#                                                                               (2026-07-13_PrefixTokenPrediction,
#                                                                               its logs on 2026-05-20's recipe)
#            1270 + 15 steps ................................................. Hyperparameters.num_steps (the
#                                                                               speedrun's master of 2026-08-01)
#            attention output gates, ReLU^2, QK-norm, RoPE on half the dims .. Attention, MLP, norm_rotary_qk
#              ReLU^2 in its matmul's epilogue on H100/H200 ................... relu_square_mlp
#                                                                               (2026-01-10_FusedLinearReLUSquare)
#              its first matmul's forward in FP8 while training: e4m3 input   fp8_input, fp8_weight, WeightCopies,
#              and weights, each scaled by its largest value (the weights'   relu_square_mm
#              after every optimizer step); backward in bf16 ................ (2026-05-19_FP8MLPUpProj; 1380 + 10)
#              its second matmul's forward in FP8 too: the kernel writes      fp8_post, fp8_down_weight,
#              ReLU^2's e4m3 copy and largest value; delayed scales, 1.8 x   fp8_down_*_scales, FP8_DOWN_*,
#              the step before's largest activation, 1.12 x the weights'     GPT.step_fp8_down
#              before the last update (exact for 16 steps); bf16 backward ... (2026-07-17_FP8DownProjection)
#   optim    NorMuon: Polar Express orthogonalization, per-neuron 2nd moment . polar_express, normuon_update
#                                                                               (2025-09-29_PolarExpress, 2025-10-24)
#              its decay 0.9 (2026-03-22_VarlenMaxDocs; 0.95 before) ......... Hyperparameters.muon_beta2
#            q's and k's weights orthogonalized per head pair, v's and o's whole  Attention.qk_w, qk_group_heads
#                                                                               (2026-04-08_PairedHeadMuon)
#            cautious weight decay on Muon and Adam ........................... cautious_step (2025-11-10_CautiousWD,
#                                                                               2025-12-18_CautiousWDAdam)
#            Adam every second step on the sum of two steps' grads ........... is_adam_step (2025-09-30_CustomBatching)
#            per-group Adam rates, betas and decay ............................ ADAM_GROUPS, MUON_GROUPS
#            lr 1 -> 1.52 -> 1.73 with the batch stages, cooldown over 60% ... lr_factor
#              (2026-02-12_ParallelResiduals; 55% before)
#              to 0.15 (2026-02-10_ShortWindow; 0.1 before) ................. LR_FLOOR
#            Muon momentum 0.85 -> 0.95 over 300 steps, back over the last 50 . muon_momentum
#   skipped, the same math: 2026-01-30_VeFused's tables in one parameter, 2026-01-24_ImprovedLMHead (of
#            2026-01-31: CE kernels and FP8 casts fused; its head computes the same function),
#            2026-01-31-BigramHashH2D, 2026-02-02_KernelTuning (kernels and host work), 2026-02-06_SparseBigramGradient
#            (the bigram table's gradient sent sparsely between GPUs: ours sums touched rows, RowSink),
#            2026-02-23_CrossEntropyKernel, 2026-02-28_TransposeCopyBackward, 2026-04-04_FuseCEFwdAndBwd (the
#            head's kernels), 2026-03-22_VarlenMaxDocs' document-count buffers (FlashAttention-3's varlen input;
#            its Muon beta2 is ported)
#   skipped: 2026-05-27-MuddGatedAndDC's v1 and v2 (its v3 is the one submitted, and ported)
#   left out: 2026-02-10_ShortWindow's short windows of 2 blocks in the third stage: the records after it
#            (2026-02-12 on) keep 5, as here
#   skipped, the same math or not in the master: PR 317's XSA rewrite (only its form is taken, above);
#            2026-06-11_RecursiveFromBest (branched from 2026-05-20: its FP8 attention projections, noise and
#            cautious Adam are not in the master; its ReLU^2 kernel's storage, post alone, is relu_square_mlp's)
#   skipped, superseded: 2026-02-12_ParallelResiduals' two residual lanes and 2026-02-16_FlattenForward's
#            one-lane layers without post-attention weights (its other changes are kernels and code layout):
#            2026-03-06_SimplifyHC replaced both with one lane, every sublayer weighted, and the backout layer's
#            output as the late attentions' input. Kept from 2026-02-12: the 60% cooldown and the Adam
#            settings of the per-sublayer weights; the step counts are 2026-03-06's
#
# Where ours is laid out differently from the record (the same function):
#   - FlexAttention with a BlockMask, where the record calls FlashAttention-3's varlen kernel: one mask rule
#     (mask_rule) gives documents, causality and the token window; paired heads attend over the interleaved
#     sequence through the same rule. --attn_kernel runs our own kernels of the same rule instead
#     (window_attention), which find each tile's keys from the first visible key alone.
#   - A step is 8, 16 or 24 sequences of 16,384 tokens, run in passes of a few (micro_batch: one compiled
#     shape; 4 per pass on one GPU), where the record's 8 GPUs take one sequence of 16K, 32K or 48K tokens
#     each: the same documents, cut into 16K pieces.
#   - RoPE turns dims j and j + d/2 together (the record turns neighbours 2j, 2j+1): a fixed permutation of
#     head dims, the same model. The attention scale multiplies q inside the QK-norm + rotary op.
#   - q and k come from one matmul and v from another; the output projection and MLP weights are fp32 (the
#     record keeps bf16 weights plus a 16-bit mantissa: the same precision); training multiplies by their bf16
#     copies, made once a step, whose grads sum into fp32 (WeightCopies); losses are summed, not averaged
#     (both optimizers ignore the loss's scale); the head runs in bf16 for validation, as the record's does.
#   - Position 0 of every sequence hashes to the bigram table's last row. The record's in-place `x[0] = mod`
#     also moves its position 1 (one token in 16K); ours keeps the rule as the record describes it. Position 0
#     of every sequence takes the sign table's row 0, as the record's first token of each GPU's sequence does.
#   - The bigram sign table is drawn after every other weight (the record draws it beside the bigram table):
#     another random table of the same rule, and the other weights start as they did before it.
#   - --fp8_down's activation scale follows the largest ReLU^2 output of the whole step before (its passes and
#     GPUs), where the record's follows each GPU's last forward pass: the same scale at any GPU count.
#   - DC's correction is its own pass after Flex (dc_correction; on the GPU the dc_mix op's kernels of ours), where
#     the record's kernel adds it to FlashAttention-3's output: the same function, checked against a brute force
#     in float64 (the torch rule) and against the rule (the kernels).

# ----------------------------------------------------------------------------------------------------------
# Imports

import argparse
import base64
import contextlib
import dataclasses
import errno
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import pickle
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple, Optional


HELD_SIGNALS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}


def _hold_signals() -> tuple:
    """Importing torch takes seconds, and a KeyboardInterrupt raised inside its C++ code aborts the process
    with a core dump, where a SIGTERM would end it silently: either, while this module loads, is noted instead,
    and acted on once it has loaded (release_held_signals, at its end)."""
    if threading.current_thread() is not threading.main_thread():
        return [], {}
    noted = []
    return noted, {s: signal.signal(s, lambda signum, _: noted.append(signum)) for s in HELD_SIGNALS}


def release_held_signals(held: tuple):
    """Put back the handlers _hold_signals replaced; a signal that came meanwhile ends the process in one line."""
    noted, handlers = held
    for s, handler in handlers.items():
        signal.signal(s, handler)
    if noted:
        raise SystemExit(f"error: {HELD_SIGNALS[noted[0]]} while starting (importing torch): nothing was trained "
                         f"or written")


_held_signals = _hold_signals()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: E402


class UserError(Exception):
    """Something the user can fix (a flag, a file, the launch). main() prints the message as one line, without
    a traceback, and exits non-zero."""


# ----------------------------------------------------------------------------------------------------------
# Config: hyperparameters, kernel settings, schedules

BOS_ID = 50256       # <|endoftext|> in GPT-2's BPE; FineWeb shards put it before every document
GPT2_VOCAB = 50257   # token ids 0..50256; a shard holding anything larger is not GPT-2 BPE
MASK_BLOCK = 128     # FlexAttention's tile; windows are set in whole blocks of it (the record's block_size)


def H(default, help: str):
    return field(default=default, metadata={"help": help})


# sequences per forward pass: the first of these that divides each stage's sequences per process (2:
# records/2026-12-05_speed7-h200; 4: records/2026-12-06_mb4-h100; peak 32.1 GiB on one GPU:
# records/2026-12-06_peak-h100)
AUTO_MICRO_BATCHES = (4, 2)


@dataclass
class Hyperparameters:
    # data
    train_files: str = H("data/fineweb10B/fineweb_train_*.bin", "glob of training shards")
    val_files: str = H("data/fineweb10B/fineweb_val_*.bin", "glob of validation shards")
    val_tokens: int = H(10_485_760, "the first this many val tokens are scored, a whole number of --val_seq_len "
                                    "sequences (record: 10,485,760 = 40 x 262,144)")
    val_seq_len: int = H(4 * 64 * 1024, "tokens per val sequence, a multiple of 128 (record: 262,144)")
    seq_len: int = H(16 * 1024, "tokens per micro-batch, a multiple of 128 (record: 16,384 per GPU in the first "
                                "stage)")
    max_doc_len: tuple = H((896, 2048, 2048), "training documents are clipped to this many tokens, one value per "
                                              "equal part of the scheduled steps (record 2026-02-10_ShortWindow: "
                                              "896 in the first third)")
    batch_seqs: tuple = H((8, 16, 24), "micro-batches per step, one value per equal part of the scheduled steps: "
                                       "8, 16, 24 x 16,384 = 131K, 262K, 393K tokens (record)")
    micro_batch: int = H(0, "sequences per forward pass, dividing each stage's sequences per process: the same "
                            "training (only rounding moves), fewer passes for more memory. 0 = auto: the first of "
                            f"{AUTO_MICRO_BATCHES} and 1 that divides them and, on a GPU, fits its free memory by an "
                            "estimate (a note says which)")
    # schedule
    num_steps: int = H(1285, "optimizer steps: 1270 scheduled + 15 extension (the speedrun's master of 2026-08-01; "
                             "1290 at 2026-05-27-MuddGatedAndDC v3, 1390 before it)")
    extension_steps: int = H(15, "the last steps, trained at the final lr, window and batch (record 2026-05-27 v3 "
                                 "and the master; 10 from 2026-04-22, 40 before)")
    cooldown_frac: float = H(0.60, "last fraction of the scheduled steps over which lr falls linearly to 0.15x")
    lr_stage_scales: tuple = H((1.0, 1.52, 1.73), "lr multiplier in each part of the schedule, as batch_seqs "
                                                 "grows (record: (16/8)^0.6 and (24/8)^0.5, rounded)")
    windows: tuple = H((3, 7, 11), "long sliding window in 128-token blocks in each part of the schedule; "
                                   "short-window layers get half (record)")
    final_window: int = H(13, "long window in the extension steps (record)")
    val_window: int = H(20, "long window of the final validation, after YaRN (record)")
    split_embed_frac: float = H(2 / 3, "fraction of the scheduled steps after which the token embedding is "
                                       "untied from lm_head (record)")
    mtp: bool = H(True, "multi-token prediction: also predict the 2nd and 3rd next tokens early on (record)")
    prefix_weight: float = H(0.25, "prefix-token prediction: also predict the next token's longest proper prefix that "
                                   "is a GPT-2 token, weighted this in the first third and falling to 0 across the "
                                   "second (record 2026-07-13_PrefixTokenPrediction). 0 = off")
    val_every: int = H(250, "steps between validations; 0 = only at the end")
    target_val_loss: float = H(3.28, "the speedrun's target (GPT-2 small's FineWeb loss in llm.c); the log notes "
                                     "the first val at or below it")
    stop_at_target: bool = H(False, "stop at the first val <= target_val_loss. Off by default: logs that stop "
                                    "there sit below the target by construction and bias a record's mean")
    # model (shrink these for smoke runs)
    vocab_size: int = H(50304, "GPT-2's 50257 tokens padded to a multiple of 128 for fast matmuls")
    num_layers: int = H(11, "transformer blocks (record)")
    model_dim: int = H(768, "residual width")
    num_heads: int = H(6, "attention heads; num_heads * head_dim must equal model_dim")
    head_dim: int = H(128, "dims per head")
    long_window_layers: tuple = H((3, 10), "layers with the long window (and the partial key offset); the others "
                                           "get half of it (record)")
    no_attn_layers: tuple = H((6,), "layers without attention, MLP only (record: layer 6)")
    paired_head_layers: tuple = H((0, 2, 5, 9), "layers whose heads attend in pairs over an interleaved sequence "
                                                "(record)")
    value_embeds: tuple = H((-1, 0, 1, -1, -1, -1, -1, -1, 2, 3, 4), "per layer, the value-embedding table added "
                                                                    "to its values, -1 for none (records "
                                                                    "2026-01-26 and 02-03: a table each for layers "
                                                                    "1, 2, 8-10); a list that starts with -1 "
                                                                    "needs the = form: --value_embeds=-1,0")
    skip: tuple = H((3, 6), "U-Net skip FROM,TO: layer FROM's output, gated, joins layer TO's input (record)")
    backout_layer: int = H(7, "the layers after this one attend to its output (record 2026-03-06); with --mudd 0 the "
                              "output also subtracts a learned multiple of it (record 2025-10-04)")
    mudd: bool = H(True, "MUDD connections: the last layers mix earlier layers' outputs with per-token weights "
                         "(record 2026-04-22_MuddFormer)")
    xsa: bool = H(True, "gated XSA: the --xsa_layers take out a learned share of each head's output along its own "
                        "value (record 2026-05-07_XSAGatedLayers)")
    xsa_layers: tuple = H((1, 3, 4, 7), "layers with XSA, none with paired heads (record 2026-05-27 v3; 1, 3, 4, 7, "
                                        "8, 10 before)")
    mudd_gate: bool = H(True, "the MUDD gate: two small MLPs, one on x0 and one on the stream entering "
                              "--mudd_gate_layer, make per token the XSA shares, the --attn_gate_layers' output "
                              "gates, x0's and the bigram's shares, the skip's weight and DC's head mixes (record "
                              "2026-05-27-MuddGatedAndDC v3); 0: learned constants, an output gate on every layer")
    mudd_gate_layer: int = H(4, "the second gate reads the stream entering this layer and serves it and the layers "
                                "after it; the first serves the layers before it (record: 4)")
    attn_gate_layers: tuple = H((3, 10), "with --mudd_gate, the layers whose heads' outputs are scaled by a gate "
                                         "(record 2026-05-27 v3: 3 and 10; every layer before)")
    dc_layers: tuple = H((10,), "layers whose heads mix their attention weights over a short window, per token "
                                "(lightweight DC, record 2026-05-27 v3); needs --mudd_gate, which makes the mixes; "
                                "--dc_layers= for none")
    dc_window: int = H(112, "DC's window in tokens, the query included, at most 128 (record: 112)")
    bigram_vocab: int = H(50304 * 15 // 2, "rows of the bigram hash embedding; 0 = none (record 2026-05-27 v3: "
                                           "377,280 = 7.5 x 50,304; 15 x from 2026-05-20, 5 x before)")
    bigram_dim: int = H(0, "width of the bigram embedding, added to the stream's first this many dims; 0 = "
                           "model_dim (record 2026-05-27 v3: 768; 2026-05-20: 192, which logs before this port "
                           "wrote as 0)")
    bigram_signs: int = H(8192, "rows of a fixed random +-1 table that multiplies each position's bigram embedding, "
                                "picked by (previous token xor token) mod rows, so that bigrams sharing a hash row "
                                "can pull it different ways; 0 = none (record 2026-05-20_BigramsSignTrick)")
    fp8_head: bool = H(True, "lm_head matmuls in FP8 while training (e4m3 forward, e5m2 grads); bf16 in eval")
    fp8_mlp: bool = H(True, "the MLP's first matmul in FP8 while training: its input and weights in e4m3, each scaled "
                            "by its largest value, the grads in bf16; bf16 in eval (record 2026-05-19_FP8MLPUpProj)")
    fp8_down: bool = H(True, "with --fp8_mlp, the MLP's second matmul in FP8 while training too: ReLU^2's output in "
                             "e4m3 scaled by 1.8 x its largest value in the step before, the weights by 1.12 x "
                             "theirs before the last optimizer step; grads in bf16 (record "
                             "2026-07-17_FP8DownProjection)")
    mlp_kernel: bool = H(True, "on H100/H200 the MLP's first matmul squares its ReLU in its epilogue, one Triton "
                                "kernel each way (the same function); 0: cuBLAS and a compiled ReLU^2")
    flex_tiles: str = H("auto", "FlexAttention's Triton tiles: default, small (fits GPUs with 99 KiB shared memory "
                                "per block, e.g. RTX 3090/4090), or auto: small below 160 KiB, a faster forward "
                                "tile on H100/H200")
    attn_kernel: bool = H(True, "on H100/H200, attention in our own Triton kernels (window_attention), each tile's "
                                "keys found from the mask's first visible key, which only rises; 0: FlexAttention "
                                "(the same function; other GPUs always)")
    # optimizer (record)
    muon_lr: float = H(0.023, "NorMuon lr for hidden matrices, times MUON_GROUPS' multiplier")
    muon_wd: float = H(1.2, "NorMuon's cautious weight decay, times the lr twice (the record's form)")
    muon_beta2: float = H(0.9, "NorMuon's second-moment decay (record 2026-03-22_VarlenMaxDocs; 0.95 before)")
    adam_lr: float = H(0.008, "Adam's base lr, times ADAM_GROUPS' multiplier per group")
    adam_wd: float = H(0.005, "Adam's base cautious weight decay, times ADAM_GROUPS' multiplier and lr^2")
    adam_eps: float = H(1e-10, "Adam epsilon; tiny so the update does not depend on the loss scale")
    momentum_warmup_steps: int = H(300, "Muon momentum rises linearly from 0.85 to 0.95 over these steps")
    momentum_cooldown_steps: int = H(50, "and falls back to 0.85 over the last this many steps")
    # run
    seed: int = H(0, "seed for the parameter init")
    device: str = H("cuda", "cuda, or cpu for tests and tiny smoke runs")
    compile: bool = H(True, "torch.compile the model and the head (CUDA only)")
    compile_scope: str = H("auto", "what one compiled graph holds: model (masks and all blocks; one GPU), blocks "
                                   "(one graph per block, so grads reduce during backward; several GPUs), or "
                                   "auto: model on one GPU, blocks on more")
    warmup_steps: int = H(10, "untimed steps run first to compile, then undone (state restored)")
    log_dir: str = H("logs", "where <run_id>.txt and checkpoints go")
    run_id: str = H("", "log file name; default: a fresh uuid")
    save_every: int = H(0, "save a checkpoint every this many steps and at the end; 0 = never")
    keep_last: int = H(2, "after each save, delete this run's older checkpoints but the newest this many; 0 = keep all")
    resume: str = H("", "checkpoint to continue from, with identical data order, schedule and optimizer state; "
                        "its run's settings are the defaults, and flags beside it may change only those a resume "
                        "may (README: Resume)")
    stop_at: int = H(0, "end this launch after this step, with a validation and a checkpoint there, to go on "
                        "later with --resume (a machine held for a limited time); the schedule stays --num_steps'. "
                        "0 = train to the end")
    eval_hellaswag: str = H("", "after training, score the final weights on this HellaSwag .jsonl (python "
                                "data/hellaswag.py downloads the validation split) and log acc and acc_norm")
    profile_steps: tuple = H((), "A,B: profile train steps A..B (CUDA) into <log_dir>/<run_id>_profile.txt: GPU "
                                 "time per kernel category and the top kernels")

    def __post_init__(self):
        self.fp8_down = self.fp8_down and self.fp8_mlp  # the down projection's FP8 goes with the up projection's


# NorMuon groups: lr multiplier on top of the shape factor sqrt(max(1, rows/cols)), which is 2 for the MLP's
# (3072, 768) matrices (record: the MLP's output matrices step twice as far as its input ones)
MUON_GROUPS = {"attn_qk": 1.0, "attn_vo": 1.0, "mlp_in": 1.0, "mlp_out": 2.0}


@dataclass(frozen=True)
class AdamGroup:
    lr_mul: float   # lr = adam_lr * lr_mul
    wd_mul: float   # weight decay = adam_wd * wd_mul (applied as lr^2 * it, cautiously)
    betas: tuple


# the record's Adam param_table, by group
ADAM_GROUPS = {
    "head": AdamGroup(1.0, 150.0, (0.5, 0.95)),       # lm_head, and the token embedding (tied to it until 2/3)
    "embeds": AdamGroup(75.0, 5.0, (0.75, 0.95)),     # value embeddings and the bigram embedding
    "scalars": AdamGroup(5.0, 0.0, (0.9, 0.99)),      # attention (value, output), smear, backout, skip lambdas
    "resid": AdamGroup(5.0, 0.0, (0.9, 0.95)),        # residual lambdas (2026-03-06_SimplifyHC)
    "inject": AdamGroup(1.0, 0.0, (0.9, 0.95)),       # output, x0 and bigram lambdas (2026-03-06_SimplifyHC)
    "gates": AdamGroup(1.0, 1.0, (0.9, 0.99)),        # attention output and value-embedding gates
    "smear": AdamGroup(0.01, 0.0, (0.9, 0.99)),       # smear gate
    "skip": AdamGroup(0.05, 0.0, (0.9, 0.99)),        # skip gate
    "xsa": AdamGroup(1.0, 0.0, (0.9, 0.95)),          # XSA's per-head shares (2026-05-07_XSAGatedLayers)
    "mudd": AdamGroup(0.25, 1.0, (0.9, 0.99)),        # MUDD's MLPs (2026-04-22_MuddFormer)
    "mudd_bias": AdamGroup(0.25, 0.0, (0.9, 0.99)),   # and their biases
    "mudd_gate": AdamGroup(0.1, 1.0, (0.9, 0.99)),    # the MUDD gate's MLPs (2026-05-27-MuddGatedAndDC v3)
    "mudd_gate_bias": AdamGroup(0.1, 0.0, (0.9, 0.99)),  # their biases and the gate's scale
}


@dataclass
class KernelSettings:
    """How the GPU kernels are launched (never what they compute). build() makes one per run and logs it;
    benches and tests set its fields instead of patching the module."""
    flex_options: dict = None            # FlexAttention kernel_options (from --flex_tiles), None = Flex's own
    attn_tiles: tuple = None             # window_attention's launches (--attn_kernel): ATTN_TILE each for its
                                         # forward, dq and dk/dv kernels; None: FlexAttention
    ce_tiles: tuple = (8, 512, 8)        # softcapped CE: rows, vocab columns per tile, warps
    ce_tanh_approx: bool = True          # the cap's tanh as one tanh.approx op (records/2026-12-03_speed2-h200)
    transpose_tile: tuple = (64, 128)    # fp8 transpose tile (records/2026-12-03_speed-h200)
    mlp_tiles: tuple = None              # the MLP's fused ReLU^2 matmul (relu_square_mlp): its forward's tile,
                                         # its backward's, its FP8 forward's and that for --fp8_down (MLP_TILE
                                         # each); None: cuBLAS
                                         # and a compiled ReLU^2

    def attn_launch(self):
        """window_attention's tiles end to end (forward, dq, dk/dv), or None for FlexAttention."""
        return None if self.attn_tiles is None else tuple(x for tile in self.attn_tiles for x in tile)

    def head_launch(self) -> tuple:
        """The FP8 head's launch (head_loss, fp8_head_loss): the CE kernel's tiles, then the transposes'."""
        return (*self.ce_tiles, *self.transpose_tile)

    def mlp_launch(self, fp8: bool = False, down: bool = False) -> list:
        """relu_square_mlp's tiles: its forward's (FP8, FP8 with post's e4m3 copy for the down projection, or
        bf16), then its backward's."""
        return [*self.mlp_tiles[3 if down else 2 if fp8 else 0], *self.mlp_tiles[1]]


# settings that may differ between a checkpoint and the run resuming it: none of them changes the training (the
# shard globs may name other paths of the same shards: restore compares the shards themselves)
RESUME_FREE = ("log_dir", "run_id", "val_every", "save_every", "keep_last", "warmup_steps", "resume",
               "target_val_loss", "stop_at_target", "profile_steps", "flex_tiles", "attn_kernel", "mlp_kernel",
               "micro_batch", "stop_at", "train_files", "val_files", "eval_hellaswag")
# and these may change on resume too, logged: lower rates are how a diverged run continues from a checkpoint
RESUME_ADJUSTABLE = ("muon_lr", "adam_lr", "lr_stage_scales")
RUN_ID_CHARS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a plain file name; 200 leaves room for _step...


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):  # no abbreviations: --lr must not quietly mean --lr_stage_scales
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):  # one line, not the usage of 50 flags
        self.exit(2, f"error: {message} (`python train_gpt.py --help` lists every flag)\n")


def parse_bool(s: str) -> bool:
    value = {"1": True, "true": True, "0": False, "false": False}.get(s.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected 1, 0, true or false, not {s!r}")
    return value


def parse_ints(s: str) -> tuple:
    try:
        return tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {s!r}") from None


def parse_floats(s: str) -> tuple:
    try:
        return tuple(float(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, not {s!r}") from None


def help_text(f) -> str:
    """A flag's help with its default. argparse formats help with %, so a literal % is doubled here: help
    strings are plain text ('2% faster' once crashed --help)."""
    default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
    return f"{f.metadata['help']} (default: {default})".replace("%", "%%")


# The record's layout at a width that trains on 2 CPU cores, on the shipped books (data/tokenize_text.py makes
# data/sample_shards/): 4 layers, layer 1 without attention, layer 2's heads paired, layers 0 and 3 long-windowed,
# a value-embedding table of its own for layers 2 and 3 (the record's: for layers 1, 2 and the last three), the
# layers after layer 1 attending to its output (MUDD's last two)
SAMPLE_SHARDS = Path(__file__).resolve().parent / "data" / "sample_shards"  # the presets' data, wherever one runs from
_CPU = dict(device="cpu", train_files=str(SAMPLE_SHARDS / "sample_train_*.bin"),
            val_files=str(SAMPLE_SHARDS / "sample_val_*.bin"), num_layers=4, num_heads=2, head_dim=32, model_dim=64,
            long_window_layers=(0, 3), no_attn_layers=(1,), paired_head_layers=(2,), value_embeds=(-1, -1, 0, 1),
            skip=(0, 2), backout_layer=1, xsa_layers=(0,), mudd_gate_layer=2, attn_gate_layers=(0, 3), dc_layers=(3,),
            windows=(2, 4), final_window=4, val_window=6, bigram_vocab=15 * 4096, fp8_head=False, fp8_mlp=False,
            warmup_steps=0, val_seq_len=1024, val_tokens=8192)
# named starting points for runs other than the record's; flags given beside --preset override it
PRESETS = {
    "smoke": {**_CPU, "seq_len": 128, "batch_seqs": (1, 2), "num_steps": 20, "extension_steps": 1, "val_every": 10,
              "val_tokens": 2048, "momentum_warmup_steps": 5, "momentum_cooldown_steps": 2},
    # higher rates than the record's, to learn the 122K tokens of the shipped books in 120 steps
    "books": {**_CPU, "model_dim": 128, "num_heads": 4, "seq_len": 256, "batch_seqs": (2, 4, 6), "num_steps": 120,
              "extension_steps": 4, "val_every": 30, "momentum_warmup_steps": 20, "momentum_cooldown_steps": 8,
              "adam_lr": 0.02, "muon_lr": 0.04},
}


MODES_HELP = """other modes, each with flags of its own (MODE --help lists them):
  --generate CKPT --prompt TEXT   continue a prompt with a checkpoint's model [--max_new_tokens --temperature
                                  --top_k --seed --device]
  --hellaswag CKPT                score a checkpoint on HellaSwag [--hellaswag_file --limit --device]"""


def mode_help(parser: argparse.ArgumentParser, argv: list):
    """A mode's --help, which argparse would take for the value its CKPT flag is missing."""
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        raise SystemExit(0)


def parse_args(argv=None) -> Hyperparameters:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=MODES_HELP)
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="start from a named setting: smoke (CPU, under a minute: does it run), books (CPU, a "
                             "few minutes: a model that writes English words); other flags override it")
    for f in dataclasses.fields(Hyperparameters):
        if isinstance(f.default, tuple):
            kind = parse_floats if f.name == "lr_stage_scales" else parse_ints
        else:
            kind = {bool: parse_bool}.get(type(f.default), type(f.default))
        parser.add_argument(f"--{f.name}", type=kind, default=f.default, help=help_text(f))
    known = parser.parse_known_args(argv)[0]
    if known.preset:
        parser.set_defaults(**PRESETS[known.preset])
    if known.resume:  # the run's own settings, which flags given beside --resume may change only as a resume may
        parser.set_defaults(**checkpoint_settings(known.resume))
    args = vars(parser.parse_args(argv))
    args.pop("preset")
    return Hyperparameters(**args)


def checkpoint_settings(path: str) -> dict:
    """The settings of the run a checkpoint belongs to, as parse_args' defaults: {} if the file is not a readable
    checkpoint (read_checkpoint then says why). Memory-mapped: the config is read, not the tensors. The log
    folder is the one the checkpoint is in now (its run's log beside it, wherever it was moved); stop_at is left
    to the new launch (the run's own pause is behind it)."""
    config = (saved_config(path) or ({}, ""))[0]
    if not config:
        return {}
    try:
        settings = dataclasses.asdict(hyperparameters_from(config))
    except Exception:  # a foreign config: build()'s read of the checkpoint names the problem
        return {}
    return {**{k: v for k, v in settings.items() if k in config and k not in ("resume", "stop_at")},
            "log_dir": str(Path(path).parent)}


def saved_config(path: str):
    """(config, its source's sha256) of a checkpoint, read memory-mapped (not its tensors); None if the file
    does not load as one (a missing, foreign or broken file: read_checkpoint names the problem)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return (ckpt["config"], str(ckpt.get("source_sha256", ""))) if isinstance(ckpt["config"], dict) else None
    except Exception:
        return None


def per_part_lists(saved: dict) -> dict:
    """A config saved as JSON with an older version's one number where this version takes one value per part
    of the schedule (--max_doc_len before the 2026-02-10_ShortWindow port) as a list of that one value."""
    per_part = {f.name for f in dataclasses.fields(Hyperparameters) if isinstance(f.default, tuple)}
    return {k: [v] if k in per_part and isinstance(v, int) else v for k, v in saved.items()}


def hyperparameters_from(saved: dict) -> Hyperparameters:
    """The Hyperparameters of a config saved as JSON (a checkpoint's, a log's config line): lists back to
    tuples, keys this version does not know left out."""
    known = {f.name for f in dataclasses.fields(Hyperparameters)}
    return Hyperparameters(**{k: tuple(v) if isinstance(v, list) else v for k, v in per_part_lists(saved).items()
                              if k in known})


def check_config(cfg: Hyperparameters):
    """Refuse settings that cannot train, before anything is built."""
    for name in ["num_steps", "seq_len", "val_seq_len", "val_tokens", "momentum_warmup_steps",
                 "num_layers", "model_dim", "num_heads", "head_dim", "final_window", "val_window"]:
        if getattr(cfg, name) <= 0:
            raise UserError(f"--{name} must be positive (it is {getattr(cfg, name)})")
    for name in ["val_every", "save_every", "keep_last", "warmup_steps", "extension_steps", "bigram_vocab",
                 "bigram_dim", "bigram_signs", "momentum_cooldown_steps", "micro_batch", "stop_at"]:
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name} must be 0 or more (it is {getattr(cfg, name)})")
    if not 0 < bigram_width(cfg) <= cfg.model_dim:
        raise UserError(f"--bigram_dim {cfg.bigram_dim} must be at most --model_dim {cfg.model_dim} (0: all of it)")
    if cfg.stop_at >= cfg.num_steps:
        raise UserError(f"--stop_at {cfg.stop_at} is not before the last step (--num_steps {cfg.num_steps}): "
                        f"leave it out to train to the end")
    if cfg.extension_steps >= cfg.num_steps:
        raise UserError(f"--extension_steps {cfg.extension_steps} leaves no scheduled steps of --num_steps "
                        f"{cfg.num_steps}")
    for name in ["seq_len", "val_seq_len"]:
        if getattr(cfg, name) % MASK_BLOCK:
            raise UserError(f"--{name} {getattr(cfg, name)} must be a multiple of {MASK_BLOCK}")
    if cfg.val_tokens % cfg.val_seq_len:
        raise UserError(f"--val_tokens {cfg.val_tokens} is not a whole number of --val_seq_len {cfg.val_seq_len} "
                        f"sequences: make it {max(1, cfg.val_tokens // cfg.val_seq_len) * cfg.val_seq_len}")
    for name in ["batch_seqs", "lr_stage_scales", "windows", "max_doc_len"]:
        values = getattr(cfg, name)
        if not values or not all(0 < v < math.inf for v in values):
            raise UserError(f"--{name} takes positive numbers, one per part of the schedule (it is {values})")
    if cfg.num_heads * cfg.head_dim != cfg.model_dim:
        raise UserError(f"--num_heads {cfg.num_heads} x --head_dim {cfg.head_dim} = {cfg.num_heads * cfg.head_dim}, "
                        f"but --model_dim is {cfg.model_dim}: they must be equal")
    if cfg.head_dim % 4 or cfg.model_dim < GATE_DIMS:
        raise UserError(f"--head_dim must be a multiple of 4 and --model_dim at least {GATE_DIMS}")
    if cfg.vocab_size < GPT2_VOCAB:
        raise UserError(f"--vocab_size {cfg.vocab_size} is smaller than GPT-2's {GPT2_VOCAB} tokens")
    check_layout(cfg)
    if cfg.profile_steps and not (len(cfg.profile_steps) == 2 and 0 <= cfg.profile_steps[0] <= cfg.profile_steps[1]):
        raise UserError(f"--profile_steps takes two steps A,B with A <= B (it is {cfg.profile_steps})")
    if not 0 < cfg.target_val_loss < math.inf:
        raise UserError(f"--target_val_loss must be a finite number above 0 (it is {cfg.target_val_loss})")
    for name in ["muon_lr", "adam_lr", "muon_wd", "adam_wd", "prefix_weight"]:
        if not 0 <= getattr(cfg, name) < math.inf:
            raise UserError(f"--{name} must be a finite number, 0 or more (it is {getattr(cfg, name)})")
    if not 0 <= cfg.muon_beta2 < 1:
        raise UserError(f"--muon_beta2 must be at least 0 and below 1 (it is {cfg.muon_beta2})")
    if not 0 < cfg.adam_eps < math.inf:
        raise UserError(f"--adam_eps must be a finite number above 0 (it is {cfg.adam_eps})")
    if not 0 <= cfg.seed < 2**63:
        raise UserError(f"--seed must be at least 0 and below 2^63 (it is {cfg.seed})")
    if cfg.device not in ("cuda", "cpu"):
        raise UserError(f"--device must be cuda or cpu (it is {cfg.device!r})")
    if not cfg.log_dir.strip():
        raise UserError("--log_dir is empty: name a folder for the log and checkpoints (default: logs)")
    if cfg.run_id and not RUN_ID_CHARS.fullmatch(cfg.run_id):
        raise UserError(f"--run_id {cfg.run_id[:60]!r}{'...' if len(cfg.run_id) > 60 else ''} is not a plain file "
                        f"name: use letters, digits, '.', '_' and '-', at most 200 (it names the log and checkpoints)")
    if cfg.compile_scope not in ("auto", "model", "blocks"):
        raise UserError(f"--compile_scope must be auto, model or blocks (it is {cfg.compile_scope!r})")
    if cfg.flex_tiles not in ("auto", "default", "small"):
        raise UserError(f"--flex_tiles must be auto, default or small (it is {cfg.flex_tiles!r})")
    for name in ["cooldown_frac", "split_embed_frac"]:
        if not 0 <= getattr(cfg, name) <= 1:
            raise UserError(f"--{name} must be within 0..1 (it is {getattr(cfg, name)})")
    if cfg.resume and not os.path.isfile(cfg.resume):  # before the GPU check: its settings (--device too) are unread
        folder = os.path.isdir(cfg.resume)
        found = sorted(Path(cfg.resume).glob("*_step*.pt") if folder else [], reverse=True,
                       key=lambda p: (p.stat().st_mtime, p.name))[:3]
        raise UserError(f"cannot read checkpoint {cfg.resume}: " + (
            f"a folder; its newest checkpoints: {', '.join(p.name for p in found)}" if found else
            "a folder, with no checkpoint in it" if folder else "no such file") +
            ". A run writes its checkpoints beside its log, as <run_id>_stepNNNNNN.pt (with --save_every or --stop_at)")


def check_layout(cfg: Hyperparameters):
    """The layer flags must name layers that exist and fit together."""
    L = cfg.num_layers
    named = {"--long_window_layers": cfg.long_window_layers, "--no_attn_layers": cfg.no_attn_layers,
             "--paired_head_layers": cfg.paired_head_layers, "--skip": cfg.skip}
    for flag, layers in named.items():
        bad = [i for i in layers if not 0 <= i < L]
        if bad:
            raise UserError(f"{flag} names layers {bad}, which do not exist (0..{L - 1})")
    if not 0 <= cfg.backout_layer < L:
        raise UserError(f"--backout_layer {cfg.backout_layer} does not exist (0..{L - 1})")
    if len(cfg.skip) != 2 or cfg.skip[0] >= cfg.skip[1]:
        raise UserError(f"--skip takes two layers FROM,TO with FROM before TO (it is {cfg.skip})")
    if len(cfg.value_embeds) != L or not all(v >= -1 for v in cfg.value_embeds):
        raise UserError(f"--value_embeds takes one table number (or -1) per layer, {L} in all (it is "
                        f"{cfg.value_embeds})")
    with_ve_no_attn = [i for i in cfg.no_attn_layers if cfg.value_embeds[i] >= 0]
    paired_no_attn = sorted(set(cfg.paired_head_layers) & set(cfg.no_attn_layers))
    if with_ve_no_attn or paired_no_attn:
        raise UserError(f"layers {with_ve_no_attn or paired_no_attn} have no attention (--no_attn_layers) but "
                        f"{'value embeddings' if with_ve_no_attn else 'paired heads'}")
    if cfg.paired_head_layers and cfg.num_heads % 2:
        raise UserError(f"--paired_head_layers needs an even --num_heads (it is {cfg.num_heads})")
    if cfg.mudd:
        unmet = [(L < 3, "at least 3 layers"), (L - 1 in cfg.no_attn_layers, f"attention on the last layer ({L - 1})"),
                 (cfg.backout_layer >= L - 2, f"--backout_layer before layer {L - 2}"),
                 (max(cfg.value_embeds) < 0, "a value embedding (--value_embeds)"),
                 (cfg.num_heads % 2, "an even --num_heads")]
        why = next((need for broken, need in unmet if broken), None)
        if why:
            raise UserError(f"--mudd needs {why}; or pass --mudd 0")
    check_gate_layout(cfg)


def check_gate_layout(cfg: Hyperparameters):
    """XSA, the output gates and DC need attention layers (XSA and DC without paired heads: their values
    interleave); DC's mixes come from the MUDD gate's second MLP."""
    L, attn = cfg.num_layers, [i for i in range(cfg.num_layers) if i not in cfg.no_attn_layers]
    single = [i for i in attn if i not in cfg.paired_head_layers]
    named = [("--xsa_layers", cfg.xsa_layers if cfg.xsa else (), single, "attention without paired heads"),
             ("--attn_gate_layers", cfg.attn_gate_layers if cfg.mudd_gate else (), attn, "attention"),
             ("--dc_layers", cfg.dc_layers, single, "attention without paired heads")]
    for flag, layers, allowed, what in named:
        bad = [i for i in layers if i not in allowed]
        if bad:
            raise UserError(f"{flag} names layers {bad}, which have no {what} (those that do: {allowed})")
    if cfg.mudd_gate and not 0 < cfg.mudd_gate_layer < L:
        raise UserError(f"--mudd_gate_layer {cfg.mudd_gate_layer} must be within 1..{L - 1}: its gate reads the "
                        f"stream entering that layer")
    if cfg.dc_layers and not cfg.mudd_gate:
        raise UserError("--dc_layers needs --mudd_gate, which makes DC's head mixes: pass --dc_layers= for no DC")
    early = [i for i in cfg.dc_layers if i < cfg.mudd_gate_layer]
    if early:
        raise UserError(f"--dc_layers {early} come before --mudd_gate_layer {cfg.mudd_gate_layer}, whose gate makes "
                        f"their mixes")
    if cfg.dc_layers and not 0 < cfg.dc_window <= DC_BACK:
        raise UserError(f"--dc_window {cfg.dc_window} must be within 1..{DC_BACK} tokens")


# ---- schedules: each a function of the step alone, so a resumed run continues them exactly

def scheduled_steps(cfg: Hyperparameters) -> int:
    """Steps over which lr, windows, batch size and multi-token weights follow their schedules; the
    extension steps after them keep the final values."""
    return cfg.num_steps - cfg.extension_steps


LR_FLOOR = 0.15  # the lr factor the cooldown ends at, kept through the extension (record 2026-02-10_ShortWindow)


def stage_starts(parts: int, cfg: Hyperparameters) -> list:
    """The first step of each of `parts` equal stages of the scheduled steps: round(c S) at c = 1/parts,
    2/parts, ... summed in floats, as the record sums its stages' durations (record 2026-01-30_VeFused's
    TrainingSchedule; the 2026-01-19 record's ceil(k S / parts) differs by a step where S does not divide)."""
    return [0] + [round(c * scheduled_steps(cfg)) for c in itertools.accumulate([1 / parts] * (parts - 1))]


def stage_at(step: int, parts: int, cfg: Hyperparameters) -> tuple[int, float]:
    """(which of `parts` stages `step` lies in, how far through it, 0 to 1): the last stage lasts until the
    scheduled steps end, and the extension steps after them count as past its end (1)."""
    S, starts = scheduled_steps(cfg), stage_starts(parts, cfg)
    if step >= S:
        return parts - 1, 1.0
    k = max(i for i, start in enumerate(starts) if start <= step)
    end = starts[k + 1] if k + 1 < parts else S
    return k, (step - starts[k]) / (end - starts[k])


def part(step: int, parts: int, cfg: Hyperparameters) -> int:
    """Which of `parts` stages of the scheduled steps `step` lies in; the last one from then on."""
    return stage_at(step, parts, cfg)[0]


def batch_seqs_at(step: int, cfg: Hyperparameters) -> int:
    """Micro-batches in this step (record: 8, 16, 24 GPU-sequences by thirds)."""
    return cfg.batch_seqs[part(step, len(cfg.batch_seqs), cfg)]


def max_doc_len_at(step: int, cfg: Hyperparameters) -> int:
    """The longest document piece of this step's batch (record 2026-02-10_ShortWindow: 896 tokens in the first
    third, 2048 after; it switches with the batch size)."""
    return cfg.max_doc_len[part(step, len(cfg.max_doc_len), cfg)]


def lr_factor(step: int, cfg: Hyperparameters) -> float:
    """The record's lr schedule (2026-01-30's TrainingSchedule): the stage's multiplier (it grows with the
    batch), then from step int(S (1 - cooldown_frac)) a linear blend towards LR_FLOOR, reached at the last
    scheduled step and kept through the extension."""
    S = scheduled_steps(cfg)
    lr = cfg.lr_stage_scales[part(step, len(cfg.lr_stage_scales), cfg)]
    cooldown_from = int(S * (1 - cfg.cooldown_frac))
    if step >= cooldown_from:
        t = 1.0 if S <= cooldown_from else min(1.0, (step - cooldown_from) / (S - cooldown_from))
        lr = lr * (1 - t) + LR_FLOOR * t
    return lr


def muon_momentum(step: int, cfg: Hyperparameters) -> float:
    """0.85 rising linearly to 0.95 over the first momentum_warmup_steps, falling back to 0.85 over the last
    momentum_cooldown_steps."""
    cooldown_from = cfg.num_steps - cfg.momentum_cooldown_steps
    if step < cfg.momentum_warmup_steps:
        return 0.85 + 0.10 * step / cfg.momentum_warmup_steps
    if step > cooldown_from:
        return 0.95 - 0.10 * (step - cooldown_from) / cfg.momentum_cooldown_steps
    return 0.95


def windows_at(step: int, cfg: Hyperparameters, final_val: bool = False) -> tuple[int, int]:
    """(short, long) sliding windows in 128-token blocks: long from --windows by part of the schedule, then
    --final_window; short is half the long one. The last validation widens the long one to --val_window."""
    long = cfg.final_window if step >= scheduled_steps(cfg) else cfg.windows[part(step, len(cfg.windows), cfg)]
    return long // 2, cfg.val_window if final_val else long


def long_window_stages(step: int, cfg: Hyperparameters) -> list:
    """The distinct long windows the run has moved through by `step`, in order: what YaRN has adapted to."""
    seen = []
    for s in stage_starts(len(cfg.windows), cfg) + [scheduled_steps(cfg)]:
        if s <= step:
            w = windows_at(s, cfg)[1]
            if not seen or seen[-1] != w:
                seen.append(w)
    return seen


def mtp_weights_at(step: int, cfg: Hyperparameters) -> list:
    """Loss weights of the next 3 tokens (record): [1, 0.5, 0.25 -> 0] across the first third, [1, 0.5 -> 0]
    across the second, [1] after; linear in the step within each third (2026-01-30's TrainingSchedule)."""
    k, t = stage_at(step, 3, cfg)
    if not cfg.mtp or k == 2:
        return [1.0, 0.0, 0.0]
    return [1.0, 0.5, 0.25 * (1 - t)] if k == 0 else [1.0, 0.5 * (1 - t), 0.0]


def prefix_weight_at(step: int, cfg: Hyperparameters) -> float:
    """The prefix-token loss's weight (record 2026-07-13_PrefixTokenPrediction): --prefix_weight across the first
    third, falling linearly to 0 across the second, 0 after."""
    k, t = stage_at(step, 3, cfg)
    return cfg.prefix_weight * (1.0, 1 - t, 0.0)[k]


def loss_weights_at(step: int, cfg: Hyperparameters) -> list:
    """The head's loss weights: the next 3 tokens' (mtp_weights_at), then, with --prefix_weight, the prefix
    token's (prefix_weight_at)."""
    return mtp_weights_at(step, cfg) + ([prefix_weight_at(step, cfg)] if cfg.prefix_weight else [])


def is_adam_step(step: int) -> bool:
    """Adam updates on odd steps only, from the sum of two steps' grads (record 2025-09-30)."""
    return step % 2 == 1


def split_step(cfg: Hyperparameters) -> int:
    """The step after whose update the token embedding is untied from lm_head: the third stage's first step,
    round(2/3 S), made odd (an Adam step)."""
    return round(cfg.split_embed_frac * scheduled_steps(cfg)) | 1


# ----------------------------------------------------------------------------------------------------------
# Model: each op beside the plain-torch rule it computes. Where a GPU kernel computes the same function faster,
# the op dispatches with on_gpu() and the kernel lives in the last section, "GPU fast paths".

GATE_DIMS = 12       # the attention, value-embedding, smear and skip gates read the first 12 dims of their input
ATTN_INIT_STD = 0.5  # q, k, v and o start uniform with std 0.5 / sqrt(dim), as the MLP's input (record 2026-01-30)
VE_GATE_X = 6        # the value-embedding gate reads the first 6 dims of x and of the value embedding (2026-02-03)
VE_INIT_STD = 0.01   # value embeddings start at 0.01 randn, not zero (record 2026-02-03_VeTuned)
RESID_INIT = 1.1 ** 0.5  # each sublayer's residual weight: 1.1 a layer over two (record 2026-03-06_SimplifyHC)
BIGRAM_INIT = 0.05   # the bigram embedding's share at each layer (record 2026-03-06_SimplifyHC; 0.1 before)
# MUDD (record 2026-04-22_MuddFormer, as the speedrun's master re-parametrized it by 2026-05-27 v3): per channel
# of the second-to-last layer's weights, 3 sources, the last layer's value-embedding gate and 4 of the last
# layer's stream weights
MUDD_HIDDEN = 64              # the width of MUDD's MLP
MUDD_COLS = 8
MUDD_SCALE = 0.1              # every weight MUDD makes is its MLP's output times this (0.2 / sqrt(3) in 04-22's)
MUDD_BACKOUT_BIAS = -0.5 / MUDD_SCALE  # the last mix's bias on the backout layer's output: -0.5 after the
                                       # scale, the backout MUDD replaces
ATTN_SCALE = 0.1     # softmax scale after QK-norm before any YaRN stage (record 2025-09-10_Yarn)
# the MUDD gate and lightweight DC (record 2026-05-27-MuddGatedAndDC, its v3)
GATE_HIDDEN = 64       # the gate MLPs' width
GATE_SCALE_INIT = 0.1  # every coefficient is an MLP's output times one learned scale, from this
# each kind of coefficient's value at init: the output weights start at zero, so the bias is it / the scale
GATE_START = {"xsa": 0.0, "out": 0.25, "x0": 0.0, "bigram": BIGRAM_INIT, "skip": 0.5, "dc_in": 1.0, "dc_out": 0.0}
DC_BACK = 128          # DC's keys lie at most this many positions back (the record's kernel takes windows <= 128)
DC_QUERY_BLOCK = 64    # queries per block of DC's blocked product: each reads DC_BACK + 64 keys
YARN_ALPHA, YARN_BETA = 1, 32  # YaRN slows frequencies turning < 1 time per window, keeps those > 32
BIGRAM_MULS = (36313, 27191)   # the record's bigram hash: (36313 * token) xor (27191 * previous token)
E4M3_MAX = 448.0     # largest finite float8_e4m3fn
E5M2_MAX = 57344.0   # largest finite float8_e5m2
# the MLP's down projection in FP8 (record 2026-07-17_FP8DownProjection), its scales delayed: the activation's is
# 1.8 x its largest value in the step before / 448, the weights' 1.12 x their largest before the last optimizer
# step / 448 (so a step's growth rarely clips), but their largest now / 448 for the initial weights' copy and
# after each of the first 16 optimizer steps, while the weights move fastest
FP8_DOWN_ACT_HEADROOM = 1.8
FP8_DOWN_WEIGHT_HEADROOM = 1.12
FP8_DOWN_EXACT_STEPS = 16
# lm_head FP8 scales (record 2025-12-19_RetieLMHead): the head's rms-normed inputs, its weights and its logit
# grads (within +-1.75 of the multi-token loss) divided by these fit e4m3, e4m3 and e5m2
HEAD_X_SCALE = 100 / 448
HEAD_W_SCALE = 1.6 / 448
HEAD_GRAD_SCALE = 0.75 / 448
SOFTCAP, SOFTCAP_SHIFT, SOFTCAP_DIV = 23.0, 5.0, 7.5  # capped logit 23 sigmoid((z + 5) / 7.5) (2025-12-26)
MTP_TOKENS = 3       # multi-token prediction looks at the next 3 tokens
EVAL_CHUNK = 16384   # tokens per head call in eval: a 262K-token val sequence's logits would take 52 GB
HEAD_CHUNK_ROWS = 4096  # rows per logits block of the bf16 head in training (SoftcapHead): about 3.3 GB


try:  # Triton comes with CUDA builds of torch; elsewhere every op runs its torch rule
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:  # host-side tensor descriptors (recent Triton releases), for the fused ReLU^2 matmul
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


def on_gpu(t: Tensor) -> bool:
    """Whether an op runs its hand-written kernel (CUDA tensor, Triton present) or its torch rule."""
    return t.is_cuda and triton is not None


def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))


def mm(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for bf16 a and b: what a GPU's bf16 GEMM computes (bf16 inputs, fp32 sums, one rounding to bf16).
    CPUs without bf16 matrix units run bf16 GEMMs 7-35x slower than fp32; there the same function runs as an
    fp32 matmul of the bf16 values."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        return (a.float() @ b.float()).bfloat16()
    return a @ b


def mm_add(c: Tensor, a: Tensor, b: Tensor, beta: float, alpha: float = 1.0) -> Tensor:
    """beta c + alpha a @ b for bf16 tensors (one matrix or a stack) in one GEMM: cuBLAS adds beta c to the fp32
    sums and rounds once to bf16, where a @ b, beta c and their sum as three ops cost two more passes over c and
    round three times (the record's polar_express calls baddbmm so). On CPU the same function in fp32 (see mm)."""
    if a.device.type == "cpu" and a.dtype == torch.bfloat16:
        return (beta * c.float() + alpha * (a.float() @ b.float())).bfloat16()
    if a.dim() == 2:
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)
    out = torch.baddbmm(*(t.reshape(-1, *t.shape[-2:]) for t in (c, a, b)), beta=beta, alpha=alpha)
    return out.view(*a.shape[:-2], *out.shape[-2:])


def init_uniform(shape: tuple, std: float) -> Tensor:
    return torch.empty(shape).uniform_(-(3**0.5) * std, 3**0.5 * std)


# ---- embeddings

def bigram_hash(idx: Tensor, rows: int) -> Tensor:
    """The bigram embedding's row for each position of each sequence (the last dim): (previous token, token)
    hashed into rows - 1 rows; the last row is position 0's, which has no previous token (record 2026-01-19).
    In int32, without overflow: 36313 * 50303 < 2^31."""
    x = idx.to(torch.int32)
    hashed = torch.bitwise_xor(BIGRAM_MULS[0] * x[..., 1:], BIGRAM_MULS[1] * x[..., :-1]) % (rows - 1)
    return torch.cat([x.new_full((*x.shape[:-1], 1), rows - 1), hashed], dim=-1)


def bigram_width(cfg: "Hyperparameters") -> int:
    """The bigram embedding's width: --bigram_dim, or the stream's (record 2026-05-27 v3: 768; 2026-05-20: 192)."""
    return cfg.bigram_dim or cfg.model_dim


def bigram_sign_rows(idx: Tensor, rows: int) -> Tensor:
    """Each position's row of the bigram sign table: (previous token xor token) mod rows; position 0 of each
    sequence (no previous token) row 0 (record 2026-05-20_BigramsSignTrick)."""
    x = idx.to(torch.int32)
    return torch.cat([x.new_zeros((*x.shape[:-1], 1)), torch.bitwise_xor(x[..., :-1], x[..., 1:]) % rows], dim=-1)


def add_to_first_dims(x: Tensor, y: Tensor) -> Tensor:
    """x plus y on x's first y.size(-1) dims: the bigram embedding, narrower than the stream, joins its first
    dims (the record's `x[..., :bigram_dim] += ...`)."""
    if y.size(-1) == x.size(-1):
        return x + y
    return torch.cat([x[..., :y.size(-1)] + y, x[..., y.size(-1):]], dim=-1)


class RowsIntoSum(torch.autograd.Function):
    """weight[ids], whose backward hands the rows' grads to a RowSink (the optimizer's fp32 sum of the table's
    grads) instead of making weight's dense grad; weight itself gets none."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, sink, order):
        ctx.save_for_backward(ids, *(order or ()))
        ctx.sink = sink
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, *order = ctx.saved_tensors
        ctx.sink.add(ids, grad, order or None)
        return None, None, None, None


# ---- RoPE with YaRN

def rope_freqs(head_dim: int) -> Tensor:
    """Angular frequency of each of the head_dim/2 rotating pairs: head_dim/4 from 1 down to 1/1024 radians per
    position, and head_dim/4 zeros, so half the dims carry position and half do not."""
    freqs = (1 / 1024) ** torch.linspace(0, 1, head_dim // 4)
    return torch.cat([freqs, freqs.new_zeros(head_dim // 4)])


def yarn(head_dim: int, stages: list) -> tuple[Tensor, float]:
    """RoPE frequencies and attention scale after the long window grew through `stages` (tokens / 128): at
    each growth old -> new, frequencies that turn fewer than YARN_ALPHA times over the old window slow by
    old/new (the new window then spans the angles the old one did), those turning more than YARN_BETA times
    keep their speed, those between blend; the scale grows by 1 + 0.2 ln(new/old) (record 2025-09-10)."""
    freqs, scale = rope_freqs(head_dim), ATTN_SCALE
    for old, new in zip(stages, stages[1:]):
        turns = MASK_BLOCK * old * freqs / (2 * math.pi)
        keep = ((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        freqs = freqs * (old / new + keep * (1 - old / new))
        scale *= 0.2 * math.log(new / old) + 1
    return freqs, scale


def paired_positions(T: int, heads: int, device=None) -> Tensor:
    """(T, heads) RoPE positions of paired heads: head h of token t sits at 2t + (h mod 2) (record 2026-01-07)."""
    return 2 * torch.arange(T, device=device)[:, None] + (torch.arange(heads, device=device) % 2)[None, :]


def rotary(x: Tensor, cos: Tensor, sin: Tensor, paired: bool = False, scale=None) -> Tensor:
    """RoPE on x (B, T, heads, head_dim): dims j and j + head_dim/2 turned together by angle theta[pos, j],
    in fp32, then times scale if given; pos is the token's index (paired heads: paired_positions)."""
    if paired:
        pos = paired_positions(x.size(1), x.size(2), x.device)
        cos, sin = cos[pos][None], sin[pos][None]
    else:
        cos, sin = cos[None, :x.size(1), None, :], sin[None, :x.size(1), None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    y = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
    return (y if scale is None else y * scale).type_as(x)


class Rotary(nn.Module):
    """RoPE's tables for positions up to max_len at the run's current YaRN stage, and the attention scale as a
    device scalar: a new stage rewrites them in place (new data, not a new compiled graph). One instance serves
    every layer (the tables for a 262K-token val sequence's paired positions are 268 MB)."""

    def __init__(self, head_dim: int, max_len: int):
        super().__init__()
        self.head_dim, self.stages = head_dim, None
        self.register_buffer("cos", torch.empty(max_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim // 2), persistent=False)
        self.register_buffer("scale", torch.empty(()), persistent=False)
        self.set_stages([1])

    @torch.no_grad()
    def set_stages(self, stages: list):
        if stages == self.stages:
            return
        freqs, scale = yarn(self.head_dim, stages)
        theta = torch.outer(torch.arange(self.cos.size(0), dtype=torch.float32, device=self.cos.device),
                            freqs.to(self.cos.device))
        self.cos.copy_(theta.cos())
        self.sin.copy_(theta.sin())
        self.scale.fill_(scale)
        self.stages = list(stages)


def norm_rotary_qk(qk: Tensor, rot: Rotary, paired: bool) -> tuple[Tensor, Tensor]:
    """QK-norm, then RoPE; q also times the attention scale. qk (B, T, 2 heads, head_dim) holds q's heads, then
    k's. On GPU the qk_norm_rotary op computes the same with its own kernels."""
    if on_gpu(qk) and qk.dtype == torch.bfloat16:
        return qk_norm_rotary(qk, rot.cos, rot.sin, rot.scale, paired)
    q, k = qk.chunk(2, dim=2)
    return rotary(norm(q), rot.cos, rot.sin, paired, rot.scale), rotary(norm(k), rot.cos, rot.sin, paired)


def shift_stationary_keys(k: Tensor) -> Tensor:
    """Partial key offset (record 2025-12-14): in the dims RoPE leaves still (the second quarter of each half)
    each key takes its predecessor's values, so one layer can attend to 'the token after the one like mine'.
    Position 0 keeps its own."""
    j = torch.arange(k.size(-1), device=k.device)
    still = j % (k.size(-1) // 2) >= k.size(-1) // 4
    return torch.where(still, torch.cat([k[:, :1], k[:, :-1]], dim=1), k)


# ---- the attention mask: one rule, as a dense matrix (CPU), FlexAttention's BlockMask or our kernels' first (GPU)

def mask_rule(q_idx: Tensor, kv_idx: Tensor, first: Tensor) -> Tensor:
    """The attention mask, the one definition: query q sees the keys from first[q] to itself, where first is
    first_visible()'s. The dense fallback applies it to every pair, the BlockMask's mask_mod to the pairs of
    partial blocks. One gather per query (records/2026-12-04_speed5-h200)."""
    return (kv_idx <= q_idx) & (kv_idx >= first[q_idx])


def document_starts(idx: Tensor) -> Tensor:
    """Where each token's document begins, for idx (T,) or sequences (B, T) laid end to end: every document
    starts with <|endoftext|>, so the position of the latest one so far, and each sequence's first token
    starts one too (sequences never see each other)."""
    pos = torch.arange(idx.numel(), device=idx.device)
    first = (idx.flatten() == BOS_ID) | (pos % idx.size(-1) == 0)
    # each token's document number, then each document's start (the non-starts write a spare slot): compiled,
    # a cumsum is a fast scan where cummax took a one-block one (1.2 ms per stage-3 step,
    # records/2026-12-06_speed9-h100)
    doc = first.cumsum(0) - 1
    at = pos.new_zeros(pos.numel() + 1).scatter_(0, torch.where(first, doc, pos.numel()), pos)
    return at[doc]


def interleaved_starts(starts: Tensor) -> Tensor:
    """Document starts over paired heads' interleaved sequence: positions 2t and 2t + 1 belong to token t's
    document, which starts at twice its start."""
    return (2 * starts).repeat_interleave(2)


def first_visible(starts: Tensor, window: Tensor) -> Tensor:
    """The first key each query sees: the later of its document's start and `window` positions back (the
    record's FlashAttention window: keys q - window .. q). Rises along the sequence, as starts do."""
    return torch.maximum(starts, torch.arange(starts.numel(), device=starts.device) - window)


def dense_attention_mask(first: Tensor) -> Tensor:
    """mask_rule for every (query, key) pair: a (T, T) bool matrix, for SDPA on CPU."""
    idx = torch.arange(first.numel(), device=first.device)
    return mask_rule(idx[:, None], idx[None, :], first)


def block_attention_mask(first: Tensor) -> BlockMask:
    """mask_rule as FlexAttention's BlockMask. first rises, so query block qb sees one run of key blocks: from
    lo (the block of its earliest first key) to itself. Of those, the blocks from hi (the first at or after
    its latest first key) to qb - 1 are wholly visible; the others partial, mask_rule deciding per pair (the
    diagonal always is). Per key block the same runs give the query blocks backward walks. Elementwise ops
    and two searchsorted calls: no sort (compiled, a slow Triton sort: pytorch issue 182060), no reduction
    over blocks (torch 2.11's inductor failed on one), no matmul (cubic in the val sequence's 4096 blocks)."""
    n = first.numel() // MASK_BLOCK
    per_block = first.view(n, MASK_BLOCK)
    lo = per_block[:, 0] // MASK_BLOCK
    hi = (per_block[:, -1] + MASK_BLOCK - 1) // MASK_BLOCK
    blk = torch.arange(n, device=first.device)
    col = blk[None, :]
    last = n - 1
    # per query block: partial lo .. min(hi, qb) - 1 and the diagonal, full hi .. qb - 1 (ascending)
    before = torch.minimum(hi, blk) - lo
    kv_i = torch.where(col < before[:, None], lo[:, None] + col, blk[:, None])
    full_kv_i = (hi[:, None] + col).clamp(max=last)
    # per key block kb: full kb + 1 .. (the last query block whose hi <= kb); partial the diagonal, then the
    # query blocks after both with lo <= kb
    last_full = torch.searchsorted(hi, blk, right=True) - 1
    last_some = torch.searchsorted(lo, blk, right=True) - 1
    start = torch.maximum(blk, last_full) + 1
    q_i = torch.where(col == 0, blk[:, None], (start[:, None] + col - 1).clamp(max=last))
    full_q_i = (blk[:, None] + 1 + col).clamp(max=last)
    i32 = partial(torch.Tensor.to, dtype=torch.int32)
    counts = [before + 1, (blk - hi).clamp(min=0), 1 + (last_some - start + 1).clamp(min=0),
              (last_full - blk).clamp(min=0)]
    kv_n, full_kv_n, q_n, full_q_n = (i32(c)[None, None] for c in counts)
    kv_i, full_kv_i, q_i, full_q_i = (i32(i)[None, None] for i in (kv_i, full_kv_i, q_i, full_q_i))

    # the same values as a no-op view, which makes Inductor store them in a buffer of fixed strides: else torch
    # 2.11's Flex lowering may inline first's formula into the mask, read document_starts' buffer, whose strides
    # are still open, and fail ("convert FlexibleLayout to FixedLayout first": the tests' tiny model at
    # validation, records/2026-12-06_evalfix-h100)
    stored = first.as_strided(first.shape, first.stride())

    def mask_mod(b, h, q_idx, kv_idx):
        return mask_rule(q_idx, kv_idx, stored)

    return BlockMask(seq_lengths=(first.numel(), first.numel()), kv_num_blocks=kv_n, kv_indices=kv_i,
                     full_kv_num_blocks=full_kv_n, full_kv_indices=full_kv_i, q_num_blocks=q_n, q_indices=q_i,
                     full_q_num_blocks=full_q_n, full_q_indices=full_q_i, BLOCK_SIZE=(MASK_BLOCK, MASK_BLOCK),
                     mask_mod=mask_mod)


class WindowMask(NamedTuple):
    """The mask as window_attention takes it: first_visible's first key per query (int32), which the kernels
    read as mask_rule does, and their launch (KernelSettings.attn_tiles)."""
    first: Tensor
    tiles: tuple


def attention_mask(first: Tensor, attn_tiles: tuple = None):
    """The mask in the form attention() takes on this device: on GPU a WindowMask for our kernels (with
    attn_tiles) or a BlockMask for FlexAttention; on CPU, where Flex has no backward, the dense matrix for SDPA."""
    if not first.is_cuda:
        return dense_attention_mask(first)
    return WindowMask(first.int(), attn_tiles) if attn_tiles else block_attention_mask(first)


def attention_masks(idx: Tensor, windows: Tensor, kinds: set, dc_window: int = 0, attn_tiles: tuple = None) -> dict:
    """The masks of the sequences idx (B, T), laid end to end as attention() sees them, built once per forward:
    {(paired, long): mask} for the kinds the layers use. windows: (short, long) in tokens, a device tensor (a
    new window is new data, not a new graph). With a dc_window, also "dc": the first key of DC's window per
    query (dc_correction's first)."""
    starts = document_starts(idx)
    masks = {}
    for paired, long in sorted(kinds):
        s = interleaved_starts(starts) if paired else starts
        masks[paired, long] = attention_mask(first_visible(s, windows[int(long)]), attn_tiles)
    if dc_window:
        masks["dc"] = first_visible(starts, dc_window - 1)  # the query and the dc_window - 1 keys before it
    return masks


# FlexAttention's default Triton tiles at head_dim 128 need more shared memory per thread block in the backward
# than GPUs below the A100/H100 class have (sm_86, sm_89, sm_120: 99 KiB) and the compile fails with "out of
# resource: shared memory"; halved tiles in one pipeline stage fit (the tiles users report working on an
# RTX 3090)
FLEX_SMALL_TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
                    "num_stages": 1}
FLEX_DEFAULT_TILES_SMEM = 160 * 1024  # bytes of shared memory per block from which Flex's own tiles fit
HOPPER = (9, 0)  # H100's and H200's compute capability, for which FLEX_HOPPER_TILES and MLP_HOPPER_TILES are tuned
# Hopper's forward runs 10% faster in 64x64 tiles than in Flex's default (records/2026-12-03_speed3-h200)
FLEX_HOPPER_TILES = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 4}


def choose_flex_tiles(choice: str, smem_per_block: int, capability: tuple):
    """FlexAttention kernel options for --flex_tiles on a GPU with this much shared memory per block (opt-in)
    and this compute capability: None keeps Flex's defaults."""
    if choice == "small" or (choice == "auto" and smem_per_block < FLEX_DEFAULT_TILES_SMEM):
        return dict(FLEX_SMALL_TILES)
    return dict(FLEX_HOPPER_TILES) if choice == "auto" and tuple(capability) == HOPPER else None


def attention(q: Tensor, k: Tensor, v: Tensor, mask, flex_options=None) -> Tensor:
    """Masked softmax attention over (B, T, heads, head_dim), at unit scale (q carries the scale), with a mask
    from attention_mask() over the B sequences laid end to end (one pass over B * T tokens; the mask keeps the
    sequences apart): our window_attention kernels, FlexAttention or SDPA, by the mask's form."""
    B, T = q.shape[:2]
    if isinstance(mask, WindowMask):
        flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v)]
        return window_attention(*flat, mask.first, list(mask.tiles))[0].view(q.shape)
    q, k, v = (t.reshape(1, B * T, *t.shape[2:]).transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, BlockMask):
        y = flex_attention(q, k, v, block_mask=mask, scale=1.0, kernel_options=flex_options)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return y.transpose(1, 2).reshape(B, T, y.size(1), y.size(-1))


def dc_correction(q: Tensor, k: Tensor, v: Tensor, mix_in: Tensor, mix_out: Tensor, first: Tensor,
                  window: int = DC_BACK) -> Tensor:
    """What lightweight DC adds to each head's attention output (DCFormer's composition of attention weights
    across heads, Xiao et al. 2024, cut to record 2026-05-27-MuddGatedAndDC's post-softmax, no-dense form): per
    query, each head h's softmax P_h over the keys first..itself of its window only (mask_rule; at most DC_BACK
    back); their mix A = sum_h a_h P_h, a = mix_in rms-normed over the heads; head h adds b_h (A @ v_h), b =
    mix_out. q, k, v: (B, T, H, D) as attention() takes them (q carries the scale); mix_in, mix_out (B, T, H);
    first: (B T,); window: at least the longest reach first allows, at most DC_BACK. Scores and weights in
    fp32, as the record's kernel; computed in blocks of DC_QUERY_BLOCK queries against the keys from DC_BACK
    before the block to its end, so memory grows with T, not T^2. On GPU the dc_mix op computes the same with
    its own kernels."""
    B, T, H, D = q.shape
    a = F.rms_norm(mix_in.float(), (H,), eps=1e-6).type_as(mix_in)  # the record's dc_gate, in fp32
    if on_gpu(q) and q.dtype == torch.bfloat16 and (B * T) % max(DC_KERNEL_TILES) == 0:
        flat = [t.reshape(B * T, H, D) for t in (q, k, v)]
        out = dc_mix(*flat, a.float().reshape(B * T, H), mix_out.float().reshape(B * T, H), first, window)[0]
        return out.view(B, T, H, D)
    n = math.gcd(B * T, DC_QUERY_BLOCK)
    nb, back = B * T // n, DC_BACK // n

    def with_earlier(t: Tensor) -> Tensor:  # (nb, back + 1 blocks of keys, H, D): blocks b - back .. b
        t = F.pad(t.reshape(nb, n, H, D), (0, 0, 0, 0, 0, 0, back, 0))
        return torch.cat([t[j:j + nb] for j in range(back + 1)], dim=1)

    q_pos = torch.arange(B * T, device=q.device).view(nb, n)
    k_pos = q_pos[:, :1] - back * n + torch.arange((back + 1) * n, device=q.device)
    visible = mask_rule(q_pos[:, :, None], k_pos[:, None, :], first)  # keys before 0 fall below every first
    scores = torch.einsum("bqhd,bkhd->bhqk", q.reshape(nb, n, H, D).float(), with_earlier(k).float())
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)  # the diagonal is always visible
    # a sum over heads, not a matmul: compiled, it joins the softmax's kernel (a batched gemv took 4 ms a step)
    mixed = (probs * a.float().view(nb, n, H).transpose(1, 2)[..., None]).sum(1)
    out = torch.einsum("bqk,bkhd->bqhd", mixed.to(v.dtype), with_earlier(v))
    return (mix_out.reshape(nb, n, H, 1).type_as(out) * out).reshape(B, T, H, D)


# ---- blocks

def weight_in(module: nn.Module, name: str, x: Tensor) -> Tensor:
    """module's fp32 matrix `name` in x's dtype: while training, the copy the optimizer keeps (WeightCopies),
    else cast here."""
    copy = module.copies.get(name)
    return copy if copy is not None and copy.dtype == x.dtype else getattr(module, name).type_as(x)


def gate(x: Tensor, w: Tensor) -> Tensor:
    """sigmoid of a linear map of x's first GATE_DIMS dims: (..., rows of w)."""
    return torch.sigmoid(mm(x[..., :GATE_DIMS], w.type_as(x).mT))


def qk_group_heads(num_heads: int) -> int:
    """Heads per NorMuon matrix of q's and of k's weights: a pair (record 2026-04-08_PairedHeadMuon), or one
    where the heads are odd (no layer can pair them then)."""
    return 2 if num_heads % 2 == 0 else 1


def own_ve_gate(cfg: "Hyperparameters", i: int) -> bool:
    """Layer i gates its value embedding with weights of its own: it has one, and it is not MUDD's last layer
    (whose gate MUDD makes)."""
    return cfg.value_embeds[i] >= 0 and not (cfg.mudd and i == cfg.num_layers - 1)


def has_xsa(cfg: "Hyperparameters", i: int) -> bool:
    """Layer i's attention takes out XSA's per-head shares (check_gate_layout keeps them off paired heads,
    whose values interleave)."""
    return cfg.xsa and i in cfg.xsa_layers


class HeadGates(NamedTuple):
    """A layer's per-token coefficients from the MUDD gate (record 2026-05-27 v3), each (B, T, heads) or None:
    XSA's shares before tanh, the heads' output gates, and DC's (mix_in, mix_out, first, window) for
    dc_correction."""
    xsa: Optional[Tensor] = None
    out: Optional[Tensor] = None
    dc: Optional[tuple] = None


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, ve_gate: bool, paired: bool, key_offset: bool,
                 xsa: bool = False, gated: bool = False):
        """gated: the MUDD gate makes this layer's XSA shares and output gate per token (HeadGates), so the
        learned constants below are not made."""
        super().__init__()
        self.num_heads, self.head_dim, self.paired, self.key_offset = num_heads, head_dim, paired, key_offset
        # all four at the MLP's scale, the output projection too (record 2026-01-30: attention contributes from
        # the first step). q's and k's rows by head pair, each pair its own matrix for NorMuon (record
        # 2026-04-08_PairedHeadMuon); v's and o's whole
        qkvo = torch.stack([init_uniform((dim, dim), ATTN_INIT_STD * dim**-0.5) for _ in range(4)])
        self.qk_w = nn.Parameter(qkvo[:2].reshape(2 * dim // (qk_group_heads(num_heads) * head_dim), -1, dim))
        self.vo_w = nn.Parameter(qkvo[2:])
        # per head, sigmoid(gate_w @ x[:12]) scales the head's output (0.5 at the zero init)
        self.gate_w = None if gated else nn.Parameter(torch.zeros(num_heads, GATE_DIMS, dtype=torch.bfloat16))
        # per head, 2 sigmoid(ve_gate_w @ [x[:6], ve[:6]]) scales the value embedding ve added to v (1 at the zero
        # init): the gate sees the embedding it scales (record 2026-02-03_VeTuned; on paired-head layers too since
        # the master of 2026-05-27 v3, x[:12] before). The last layer's comes from MUDD (ve_gate=False)
        self.ve_gate_w = nn.Parameter(torch.zeros(num_heads, GATE_DIMS, dtype=torch.bfloat16)) if ve_gate else None
        # per head, tanh(xsa_w) of its output along its own value is taken out (0 at the zero init; record
        # 2026-05-07_XSAGatedLayers, after arXiv:2603.09078)
        self.xsa_w = nn.Parameter(torch.zeros(num_heads)) if xsa and not gated else None
        self.copies = {}  # name -> the matrix's compute copy while training (WeightCopies)

    def forward(self, x: Tensor, ve, mask, rot: Rotary, sa: Tensor, flex_options, mudd=None,
                gates: HeadGates = None) -> Tensor:
        """x: the block's normed input (B, T, dim); sa: this layer's (value, output) scales; mudd: (what MUDD
        adds to v (B, T, H, D), the value embedding's gate (B, T, H)) on the last layer, else None;
        gates: the MUDD gate's for this layer, else None."""
        gates = gates or HeadGates()
        B, T = x.shape[:2]
        H, D = self.num_heads, self.head_dim
        # q and k from one matmul, v from another: the QK-norm + rotary op then owns its input's whole grad
        qk = mm(x, weight_in(self, "qk_w", x).flatten(0, 1).mT).view(B, T, 2 * H, D)
        q, k = norm_rotary_qk(qk, rot, self.paired)
        if self.key_offset:
            k = shift_stationary_keys(k)
        vo_w = weight_in(self, "vo_w", x)
        v = sa[0] * mm(x, vo_w[0].mT).view(B, T, H, D)
        if mudd is not None:
            v = v + mudd[0]
        if ve is not None and self.ve_gate_w is None:
            v = v + mudd[1][..., None] * ve.view_as(v)
        elif ve is not None:
            ve_in = torch.cat([x[..., :VE_GATE_X], ve[..., :GATE_DIMS - VE_GATE_X]], dim=-1)
            v = v + 2 * gate(ve_in, self.ve_gate_w)[..., None] * ve.view_as(v)
        if self.paired:  # heads 0..H/2-1 of token t at position 2t of a twice-as-long sequence, the others at 2t+1
            q, k, v = (t.reshape(B, 2 * T, H // 2, D) for t in (q, k, v))
        y = attention(q, k, v, mask, flex_options).reshape(B, T, H, D)
        if gates.dc is not None:
            y = y + dc_correction(q, k, v, *gates.dc)
        xsa = torch.tanh(self.xsa_w)[:, None] if self.xsa_w is not None else \
            None if gates.xsa is None else torch.tanh(gates.xsa)[..., None]
        if xsa is not None:  # y's part along v: (y.v) v / |v|^2, |v| at least 1e-4 (the master's form of PR 317)
            along = (y * v).sum(-1, keepdim=True) / v.square().sum(-1, keepdim=True).clamp_min(1e-8)
            y = y - xsa.type_as(y) * along * v
        out_gate = gate(x, self.gate_w) if self.gate_w is not None else gates.out
        if out_gate is not None:
            y = y * out_gate.type_as(y)[..., None]
        return sa[1] * mm(y.reshape(B, T, H * D), vo_w[1].mT)


# ---- the MLP's up-projection in FP8 (record 2026-05-19_FP8MLPUpProj): forward only, each operand in e4m3 scaled
# by its largest magnitude, the fp32 sums times both scales; backward reads the bf16 input and weights

def fp8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """(w / s in e4m3, s) for a bf16 matrix, s = its largest magnitude / 448 (fp32), computed as the record's
    refresh after each optimizer step does: s and w / s are bf16 ops, rounded to bf16 before e4m3."""
    scale = w.detach().abs().amax().clamp(min=1e-12) / E4M3_MAX
    return (w.detach() / scale).to(torch.float8_e4m3fn), scale.float()


def fp8_input(x: Tensor, w_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(x * 448 / amax in e4m3, what the fp8 product's sums are multiplied by: w_scale * amax / 448) for the
    MLP's normed input x, amax its largest magnitude in this pass (a device scalar: no sync). In fp32, rounded
    once, to e4m3: what the record's compiled bf16 ops compute (Inductor keeps their intermediates in fp32)."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    return (x.detach().float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn), w_scale * amax / E4M3_MAX


def fp8_mm(a_f8: Tensor, b_f8: Tensor, scale: Tensor) -> Tensor:
    """(a_f8 @ b_f8.T) times scale, rounded to bf16, for e4m3 a (rows, k) and b (n, k) and an fp32 device scalar:
    on the FP8 tensor cores of sm_89+ GPUs, with their fast accumulation as the fused kernel's (and the
    record's) Triton dot has it on Hopper; elsewhere the same fp32 sums of the same values."""
    if a_f8.is_cuda and has_fp8_tensor_cores(torch.cuda.get_device_capability(a_f8.device)):
        return torch._scaled_mm(a_f8, b_f8.T, scale_a=scale, scale_b=torch.ones_like(scale), out_dtype=torch.bfloat16,
                                use_fast_accum=True)
    return ((a_f8.float() @ b_f8.float().T) * scale).bfloat16()


# ---- the MLP's down projection in FP8 (record 2026-07-17_FP8DownProjection): forward only, relu(pre)^2 and the
# weights in e4m3 by delayed scales (FP8_DOWN_*); backward reads post and the weights in bf16

def fp8_post(post: Tensor, act_scale: Tensor) -> Tensor:
    """post's e4m3 copy for the down projection: min(post / act_scale, 448) (post >= 0), post times 1 /
    act_scale in fp32 as the record's kernel epilogue makes it."""
    return (post.float() * act_scale.reciprocal()).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_down_weight(w: Tensor, scale: Tensor) -> Tensor:
    """proj_w (4 dim, dim) in bf16 to (w / scale)^T in e4m3 (dim, 4 dim), clipped to +-448: divided in fp32 (the
    record's quantize kernel), laid out as fp8_mm's second operand."""
    return (w.detach().float() / scale).clamp(-E4M3_MAX, E4M3_MAX).mT.to(torch.float8_e4m3fn)


@torch.no_grad()
def fp8_down_weight_scales(scales: Tensor, weights: list, exact: bool):
    """After the weights change (an optimizer step; at init), per layer (a row of scales): column 1, the scale of
    the weights' next e4m3 copy, takes column 2's value, 1.12 x their largest magnitude before the change / 448
    (fp32), or with exact is their largest magnitude now / 448 (in bf16, the record's bootstrap); then column 2
    is set from the weights now. weights: each layer's proj_w in fp32 (its largest magnitude rounded to bf16
    is its bf16 copy's)."""
    top = torch.stack(torch._foreach_norm(weights, math.inf)).bfloat16()
    if exact:
        scales[:, 1] = (top.clamp(min=1e-12) / E4M3_MAX).float()
    else:
        scales[:, 1] = scales[:, 2]
    scales[:, 2] = top.float().clamp(min=1e-12) * (FP8_DOWN_WEIGHT_HEADROOM / E4M3_MAX)


@torch.no_grad()
def fp8_down_act_scales(scales: Tensor, amax: Tensor, comm: "Comm"):
    """At a step's end: column 0 of scales, the activations' scale for the next step, from amax (layers,), the
    largest ReLU^2 output of each layer in this step's passes, made the largest over the ranks (the same
    scales at any world size); amax restarts at 0. The record sets it after every forward pass, of one GPU's
    sequence: here a step's passes and ranks share one, so that a step trains the same however it is split."""
    comm.all_max(amax)
    scales[:, 0] = amax.clamp(min=1e-12) * (FP8_DOWN_ACT_HEADROOM / E4M3_MAX)
    amax.zero_()


class MLP(nn.Module):
    def __init__(self, dim: int, kernels: KernelSettings = None):
        super().__init__()
        # both stored (4 dim, dim), as the record's: Muon's shape factor sqrt(rows/cols) is 2 for both
        self.fc_w = nn.Parameter(init_uniform((4 * dim, dim), 0.5 * dim**-0.5))
        self.proj_w = nn.Parameter(torch.zeros(4 * dim, dim))
        self.kernels = kernels or KernelSettings()
        self.copies = {}  # name -> the matrix's compute copy while training (WeightCopies)
        self.fc_fp8 = None  # (fc_w in e4m3, its scale) while training with --fp8_mlp (WeightCopies)
        # with --fp8_down: (proj_w^T in e4m3, the activation's scale, the weights', the largest activation of the
        # step's passes so far), the scales views of GPT.fp8_down_scales' row, the last of GPT.fp8_down_amax's
        self.down_fp8 = None

    def forward(self, x: Tensor) -> Tensor:
        fc_w, proj_w = weight_in(self, "fc_w", x), weight_in(self, "proj_w", x)
        fused = self.kernels.mlp_tiles and on_gpu(x) and x.dtype == torch.bfloat16
        if self.training and self.fc_fp8 is not None and x.dtype == torch.bfloat16:
            x_f8, scale = fp8_input(x, self.fc_fp8[1])
            down = self.down_fp8
            tiles = self.kernels.mlp_launch(fp8=True, down=down is not None) if fused else []
            out, _, top = relu_square_mlp(x, fc_w, proj_w, tiles, x_f8.view(-1, x.size(-1)), self.fc_fp8[0], scale,
                                          *(down[:3] if down else ()))
            if down is not None:  # the step's largest so far, for the next step's scale (fp8_down_act_scales)
                down[3].copy_(torch.maximum(down[3], top))
            return out
        if fused:  # the same function, ReLU^2 in the matmul's epilogue
            return relu_square_mlp(x, fc_w, proj_w, self.kernels.mlp_launch())[0]
        return mm(F.relu(mm(x, fc_w.mT)).square(), proj_w)  # ReLU^2


class Block(nn.Module):
    def __init__(self, cfg: "Hyperparameters", i: int, kernels: KernelSettings = None):
        super().__init__()
        self.long_window, self.paired = i in cfg.long_window_layers, i in cfg.paired_head_layers
        self.attn = None if i in cfg.no_attn_layers else Attention(
            cfg.model_dim, cfg.num_heads, cfg.head_dim, own_ve_gate(cfg, i), self.paired,
            key_offset=self.long_window and not self.paired, xsa=has_xsa(cfg, i), gated=cfg.mudd_gate)
        self.mlp = MLP(cfg.model_dim, kernels)

    def forward(self, x: Tensor, x0: Tensor, bigram, attn_in, mix, ve, masks: dict, rot: Rotary,
                sa: Tensor, flex_options=None, skip=None, mudd=None, gates: HeadGates = None) -> Tensor:
        """Each sublayer's update is x = resid x + post out (record 2026-03-06_SimplifyHC); the attention's
        also adds x0's and the bigram embedding's shares. mix: (attention's resid, post, MLP's resid, post, x0,
        bigram) weights, scalars or per token (B, T, 1) from MUDD or the MUDD gate; bigram None where it does not
        join; gates: the attention's HeadGates. attn_in:
        what the attention reads if not x (the backout layer's output, for the layers after it); skip: (gate,
        an earlier layer's output), added first (the layer without attention); mudd: Attention.forward's.
        Inside the block so that a block-by-block compile fuses them with the rest (eager, such glue was ~30
        passes over the residual stream per micro-step)."""
        if skip is not None:
            x = x + skip[0] * skip[1]
        if self.attn is not None:
            y = self.attn(norm(x if attn_in is None else attn_in), ve, masks[self.paired, self.long_window], rot, sa,
                          flex_options, mudd, gates)
            x = mix[0] * x + mix[1] * y + mix[4] * x0
            if bigram is not None:
                x = add_to_first_dims(x, mix[5] * bigram)
        return mix[2] * x + mix[3] * self.mlp(norm(x))


def token_mlp(x: Tensor, w_in: Tensor, w_out: Tensor, bias: Tensor, scale) -> Tensor:
    """Per-token weights from a small MLP, MUDD's and the MUDD gate's: (gelu(x w_in^T) w_out + bias) times scale,
    in x's dtype; w_in (hidden, dim), w_out (hidden, outputs)."""
    h = F.gelu(mm(x, w_in.type_as(x).mT))
    return (mm(h, w_out.type_as(x)) + bias.type_as(x)) * scale


class MUDD(nn.Module):
    """Multiway dynamic dense connections (Xiao et al. 2025) as the record 2026-04-22_MuddFormer trims them and
    the speedrun's master re-parametrized them (2026-05-27 v3's code: scale 0.1, v's sources unscaled, the value
    gate's 2 in its bias; 04-22's 0.2 / sqrt(3) and 1.15 are in its log): two small MLPs (dim -> 64, gelu, ->
    2 channels x 8 columns, plus a bias, times MUDD_SCALE) make per-token weights from the stream. After the
    second-to-last layer (inner), from its output x: channel 1 mixes x0 and the backout layer's output into x
    (x kept at 1 + its weight); channel 0 makes what the last layer adds to its v; column 3 of channel c, the
    gate of the last layer's value embedding on heads c H/2 .. (c + 1) H/2 - 1; columns 4-7, the last layer's
    attention and MLP residual and output weights and its x0 and bigram shares, per token (v3's 14 outputs, in
    another order: Adam's steps are per element). After the last layer (outer), the second MLP's channel 1 mixes
    x0, the backout layer's output, the second-to-last layer's, the first value embedding and the skip's source
    into x. bf16 weights, as the record's; w_out starts at zero, so only the biases speak at first: the last
    layer's weights at their old init, its value gates at 2 and the backout at -0.5."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        w_in = torch.empty(2, MUDD_HIDDEN, dim)
        for w in w_in:
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # uniform within +-1/sqrt(dim), torch's Linear init
        self.w_in = nn.Parameter(w_in.bfloat16())
        self.w_out = nn.Parameter(torch.zeros(2, MUDD_HIDDEN, 2, MUDD_COLS, dtype=torch.bfloat16))
        bias = torch.zeros(2, 2, MUDD_COLS)
        bias[0, :, 3] = 2 / MUDD_SCALE            # the last layer's value-embedding gates: 2 sigmoid(0)
        bias[0, :, 4] = RESID_INIT / MUDD_SCALE   # the last layer's residual weights (attention, MLP)
        bias[0, :, 5] = 1 / MUDD_SCALE            # and output weights
        bias[0, 0, 7] = BIGRAM_INIT / MUDD_SCALE  # its bigram share (x0's, column 6, starts at 0)
        bias[1, 1, 1] = MUDD_BACKOUT_BIAS
        self.bias = nn.Parameter(bias.bfloat16())

    def weights(self, x: Tensor, j: int) -> Tensor:
        return token_mlp(x, self.w_in[j], self.w_out[j].flatten(1), self.bias[j].flatten(), MUDD_SCALE) \
            .unflatten(-1, (2, MUDD_COLS))

    def inner(self, x: Tensor, x0: Tensor, backout_x: Tensor):
        """x: the second-to-last layer's output. Returns (x mixed, the last layer's Attention.forward mudd, its
        mix: Block.forward's six weights, each (B, T, 1))."""
        m = self.weights(x, 0)
        v, r = m[..., 0, :3], m[..., 1, :3]
        v_add = v[..., 0:1] * x0 + v[..., 1:2] * backout_x + v[..., 2:3] * x
        x = (1 + r[..., 2:3]) * x + r[..., 0:1] * x0 + r[..., 1:2] * backout_x
        ve_gate = m[..., 3].repeat_interleave(self.heads // 2, dim=-1)
        mix = [m[..., 0, 4:5], m[..., 0, 5:6], m[..., 1, 4:5], m[..., 1, 5:6], m[..., 0, 6:7], m[..., 0, 7:8]]
        return x, (v_add.view(*x.shape[:-1], self.heads, -1), ve_gate), mix

    def outer(self, x: Tensor, sources: list) -> Tensor:
        """x: the last layer's output; sources: x0, the backout layer's output, the second-to-last layer's, the
        first value embedding, the skip's source."""
        m = self.weights(x, 1)[..., 1, :len(sources)]
        for k, source in enumerate(sources):
            x = x + m[..., k:k + 1] * source
        return x


def gate_layout(cfg: "Hyperparameters") -> list:
    """The MUDD gate's coefficients, in order, as (kind, layer, width) for each of its two MLPs: the first (on
    x0) serves the layers before --mudd_gate_layer, the second (on the stream entering it) that layer and the
    later ones. Each serves, of its layers: XSA's shares (a head each), the output gates (a head each), x0's
    and the bigram's shares of every attention but MUDD's last layer's (MUDD mixes those), the skip's weight,
    then DC's two head mixes (record 2026-05-27-MuddGatedAndDC v3: 26 and 41 coefficients at 11 layers)."""
    L, g, H = cfg.num_layers, cfg.mudd_gate_layer, cfg.num_heads
    inject = [i for i in range(L) if i not in cfg.no_attn_layers and not (cfg.mudd and i == L - 1)]
    parts = []
    for lo, hi in ((0, g), (g, L)):
        def own(layers):
            return sorted(i for i in layers if lo <= i < hi)
        part = [("xsa", i, H) for i in own(cfg.xsa_layers if cfg.xsa else ())]
        part += [("out", i, H) for i in own(cfg.attn_gate_layers)]
        part += [(kind, i, 1) for i in own(inject) for kind in ("x0", "bigram")]
        part += [("skip", i, 1) for i in own(cfg.skip[1:])]
        part += [(kind, i, H) for i in own(cfg.dc_layers) for kind in ("dc_in", "dc_out")]
        parts.append(part)
    return parts


class MuddGate(nn.Module):
    """The MUDD gate (record 2026-05-27-MuddGatedAndDC v3): two MLPs (dim -> 64, gelu, -> its coefficients, plus
    a bias), their outputs times one learned scale (from 0.1), make gate_layout's coefficients per token. bf16
    weights, the scale fp32, as the record's; the output weights start at zero, so each coefficient starts at
    GATE_START of its kind."""

    def __init__(self, dim: int, layout: list):
        super().__init__()
        # per MLP, each coefficient's (kind, layer) and its columns of the MLP's output
        self.spans = [[(kind, i, at, at + w) for (kind, i, w), at in
                       zip(part, itertools.accumulate((w for *_, w in part), initial=0))] for part in layout]
        widest = max(part[-1][-1] for part in self.spans)
        w_in = torch.empty(2, GATE_HIDDEN, dim)
        for w in w_in:
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # torch's Linear init, as MUDD's
        self.w_in = nn.Parameter(w_in.bfloat16())
        self.w_out = nn.Parameter(torch.zeros(2, widest, GATE_HIDDEN, dtype=torch.bfloat16))
        bias = torch.zeros(2, widest)
        for j, part in enumerate(self.spans):
            for kind, _, start, stop in part:
                bias[j, start:stop] = GATE_START[kind] / GATE_SCALE_INIT
        self.bias = nn.Parameter(bias.bfloat16())
        self.scale = nn.Parameter(torch.tensor(GATE_SCALE_INIT))

    def coefficients(self, x: Tensor, j: int) -> dict:
        """MLP j's coefficients from x (B, T, dim): {(kind, layer): (B, T, width)}."""
        n = self.spans[j][-1][-1]
        c = token_mlp(x, self.w_in[j], self.w_out[j, :n].mT, self.bias[j, :n], self.scale.type_as(x))
        return {(kind, i): c[..., start:stop] for kind, i, start, stop in self.spans[j]}


# ---- the head

GPT2_RANKS = Path(__file__).resolve().parent / "data" / "gpt2.tiktoken"  # GPT-2's byte strings, one per token id


@functools.lru_cache(maxsize=None)
def prefix_tokens(vocab_size: int) -> tuple:
    """Per token id, the id of the longest proper prefix of its byte string that is a GPT-2 token itself, or -1
    where none is (<|endoftext|> and the padding ids too): the prefix-token loss's targets (record
    2026-07-13_PrefixTokenPrediction), from GPT-2's vocabulary alone, never the data."""
    ids = {}
    for line in GPT2_RANKS.read_bytes().splitlines():
        token, rank = line.split()
        ids[base64.b64decode(token)] = int(rank)
    table = [-1] * vocab_size
    for token, i in ids.items():
        table[i] = next((ids[token[:n]] for n in range(len(token) - 1, 0, -1) if token[:n] in ids), -1)
    return tuple(table)


def softcap(z: Tensor) -> Tensor:
    """The head's logit cap, in fp32: 23 sigmoid((z + 5) / 7.5), within (0, 23)."""
    return z.to(torch.float32, copy=True).add_(SOFTCAP_SHIFT).div_(SOFTCAP_DIV).sigmoid_().mul_(SOFTCAP)  # one copy


def softcap_ce_parts(z: Tensor, targets: Tensor, weights: Tensor, seq_len: int = 0,
                     prefix: Tensor = None, row0: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The training head's loss by its formula, for logits z (n, vocab) of rows row0 .. row0 + n - 1 of the
    N = len(targets) rows of sequences of seq_len rows laid end to end (0: one sequence) and capped logits
    c = softcap(z): per row the multi-token loss, sum over k of weights[k] * (logsumexp(c[row]) -
    c[row, targets[row + k]]) where row + k lies in the row's sequence; the next-token loss (k = 0); and the
    multi-token loss's grad wrt z, in fp32:
    (sum_k w_k softmax(c) - sum_k w_k onehot(targets[row + k])) * dc/dz, dc/dz = c (1 - c/23) / 7.5. With
    prefix (N,), each row's next token's prefix token or -1 (prefix_tokens), the multi-token loss also holds
    weights[-1] times the cross-entropy against it where there is one."""
    n, N = z.size(0), targets.numel()
    S = seq_len or N
    c = softcap(z)
    lse = torch.logsumexp(c, dim=-1)
    rows = torch.arange(row0, row0 + n, device=z.device)
    # per term, each row's target and weight: 0 where the row's k-th next token is past its sequence (or past
    # targets, should the last sequence be cut short); masks, not a gather of rows, so the GPU never waits
    terms = [(targets[(rows + k).clamp(max=N - 1)], weights[k].float() * ((rows % S < S - k) & (rows < N - k)))
             for k in range(len(weights) - (prefix is not None))]
    if prefix is not None:
        p = prefix[rows]
        terms.append((p.clamp(min=0), weights[-1].float() * (p >= 0)))
    loss, weight_sum = c.new_zeros(n), c.new_zeros(n)
    for target, w in terms:
        loss += w * (lse - c.gather(1, target[:, None])[:, 0])
        weight_sum += w
    dz = (c - lse[:, None]).exp_().mul_(weight_sum[:, None])
    for target, w in terms:
        dz.scatter_add_(1, target[:, None], -w[:, None])
    dz.mul_(c.div(SOFTCAP).neg_().add_(1).mul_(c)).div_(SOFTCAP_DIV)  # c (1 - c/23): one buffer, not three
    return loss, lse - c.gather(1, targets[rows][:, None])[:, 0], dz


@torch.compiler.disable  # traced, the loop unrolls into a slow-to-compile graph that rounds unlike the rule
def softcap_head_chunks(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, seq_len: int, prefix: Tensor,
                        chunk: int, launch=(8, 512, 8), approx: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SoftcapHead's forward: (multi-token loss, next-token loss, their grads wrt x and w), chunk rows at a time.
    On GPU each chunk's loss and grad come from the FP8 head's kernel (launch, approx: its settings), the grad
    written in bf16 over the logits it read; eager, the rule's fifteen passes over them made the Ampere-like
    path's step 2.9x the default's (records/2026-12-07_sm86-caps-h100)."""
    wb = w.bfloat16()
    loss, ntp = x.new_zeros((), dtype=torch.float32), x.new_zeros((), dtype=torch.float32)
    dx, dw = torch.empty_like(x), torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    for a in range(0, x.size(0), chunk):
        xc = x[a:a + chunk]
        z = mm(xc, wb.mT)
        # the grad in bf16 (what a bf16 matmul's backward would get), written over z: on GPU each of the kernel's
        # programs reads a tile of z before it writes that tile's grad
        per_row = torch.empty(2, z.size(0), device=z.device)
        rows_loss, rows_ntp, dz = softcap_ce_rows(z, targets, weights, 1.0, launch, approx, seq_len, (*per_row, z),
                                                  prefix, row0=a)
        loss, ntp = loss + rows_loss.sum(), ntp + rows_ntp.sum()
        dx[a:a + chunk] = mm(dz, wb)
        dw += mm(dz.mT, xc).float()
    return loss, ntp, dx, dw


class SoftcapHead(torch.autograd.Function):
    """The head's path where FP8 is off, from the normed bf16 rows x (N, dim) and the head's weight w (vocab,
    dim): (multi-token loss, next-token loss) summed over rows, softcap_ce_parts' on the logits mm(x, w.mT),
    computed HEAD_CHUNK_ROWS rows at a time with their grads wrt x and w, so the logits and their grad never
    exist for more rows than that (all of a 4-sequence pass's would take 40 GiB: 2026-12-07_paths-h100). The
    backward scales the grads kept; the next-token loss carries none. launch, approx: the CE kernel's settings
    (softcap_head_chunks)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, seq_len: int = 0,
                prefix: Tensor = None, chunk: int = 0, launch=(8, 512, 8), approx: bool = True):
        loss, ntp, dx, dw = softcap_head_chunks(x, w, targets, weights, seq_len, prefix, chunk or HEAD_CHUNK_ROWS,
                                                launch, approx)
        ctx.save_for_backward(dx, dw)
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(ntp)
        return loss, ntp

    @staticmethod
    def backward(ctx, grad_loss, _):
        dx, dw = ctx.saved_tensors
        return dx * grad_loss.to(dx.dtype), (dw * grad_loss).to(ctx.w_dtype), *[None] * 7


def to_fp8(t: Tensor, scale: float, dtype) -> Tensor:
    """t / scale in fp8, saturating: torch's cast turns out-of-range values into NaN, not the largest value."""
    top = E4M3_MAX if dtype == torch.float8_e4m3fn else E5M2_MAX
    return t.div(scale).clamp(-top, top).to(dtype)


def has_fp8_tensor_cores(capability: tuple) -> bool:
    return tuple(capability) >= (8, 9)  # Ada and Hopper; A100s (8.0) and older have none


def scaled_mm(a: Tensor, b: Tensor, scale_a: float, scale_b: float, out_dtype, fast_accum: bool) -> Tensor:
    """(a*scale_a) @ (b*scale_b) for fp8 a (row-major) and b (column-major): on the FP8 tensor cores of sm_89+
    GPUs; elsewhere the same product of the same fp8 values in fp32. The scales become device scalars by fill
    kernels (torch.tensor(value, device) would be a blocking copy)."""
    if a.is_cuda and has_fp8_tensor_cores(torch.cuda.get_device_capability(a.device)):
        sa, sb = (torch.full((), s, dtype=torch.float32, device=a.device) for s in (scale_a, scale_b))
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def head_loss(x: Tensor, head_w: Tensor, targets: Tensor, weights: Tensor, fp8: bool,
              launch: tuple = (8, 512, 8, 64, 128), approx: bool = True,
              prefix: Tensor = None) -> tuple[Tensor, Tensor]:
    """The training head on the last layer's output x (..., T, dim), sequences of T tokens: rms-norm, logits,
    soft cap, then (multi-token loss to backpropagate, next-token loss), each summed over tokens; targets of
    the next tokens do not reach past a sequence's end. The sum, not the mean, keeps each logit's grad within
    +-1.75, the range HEAD_GRAD_SCALE assumes; both optimizers ignore the loss's scale. launch and approx:
    the kernel settings (KernelSettings) of the CE kernel (both paths, on GPU) and the FP8 grads' transposes.
    prefix: the targets' prefix tokens (softcap_ce_parts), whose loss weights[-1] weighs."""
    seq_len = x.size(-2)
    x, targets = norm(x.flatten(0, -2)).bfloat16(), targets.flatten()
    prefix = None if prefix is None else prefix.flatten()
    if fp8:
        x_f8 = to_fp8(x.detach(), HEAD_X_SCALE, torch.float8_e4m3fn)
        w_f8 = to_fp8(head_w.detach(), HEAD_W_SCALE, torch.float8_e4m3fn)
        loss, ntp, _, _ = fp8_head_loss(x, head_w, x_f8, w_f8, targets, weights, seq_len, list(launch), approx,
                                        prefix)
        return loss, ntp
    return SoftcapHead.apply(x, head_w, targets, weights, seq_len, prefix, 0, tuple(launch[:3]), approx)


def eval_loss(x: Tensor, head_w: Tensor, targets: Tensor, chunk: int = EVAL_CHUNK) -> Tensor:
    """Validation as the record measures it: the bf16 head's next-token loss, summed, in chunks of tokens (the
    same sum in a fraction of the memory)."""
    x, total = norm(x.flatten(0, -2)).bfloat16(), 0
    for xc, tc in zip(x.split(chunk), targets.flatten().split(chunk)):
        total = total + F.cross_entropy(softcap(mm(xc, head_w.bfloat16().mT)), tc, reduction="sum")
    return total


# ---- the model

class GPT(nn.Module):
    def __init__(self, cfg: "Hyperparameters", kernels: KernelSettings = None):
        super().__init__()
        L, dim, V = cfg.num_layers, cfg.model_dim, cfg.vocab_size
        self.fp8_head, self.kernels = cfg.fp8_head, kernels or KernelSettings()
        self.skip_from, self.skip_to, self.backout_layer = *cfg.skip, cfg.backout_layer
        bf16 = dict(dtype=torch.bfloat16)
        # lm_head, and the token embedding tied to it (its copy) until split_step (record 2025-12-19)
        self.head_w = nn.Parameter((torch.randn(V, dim) * 0.005).bfloat16())
        self.embed = nn.Embedding(V, dim, _weight=self.head_w.detach().clone())
        bigram_dim = bigram_width(cfg)
        self.bigram_embed = (nn.Embedding(cfg.bigram_vocab, bigram_dim,
                                          _weight=torch.zeros(cfg.bigram_vocab, bigram_dim, **bf16))
                             if cfg.bigram_vocab else None)
        self.ve_of_layer = list(cfg.value_embeds)
        self.value_embeds = nn.ModuleList(nn.Embedding(V, dim, _weight=(torch.randn(V, dim) * VE_INIT_STD).bfloat16())
                                          for _ in range(max(cfg.value_embeds) + 1))
        self.rotary = Rotary(cfg.head_dim, 2 * max(cfg.seq_len, cfg.val_seq_len))
        self.blocks = nn.ModuleList(Block(cfg, i, self.kernels) for i in range(L))
        self.smear_gate_w = nn.Parameter(torch.zeros(1, GATE_DIMS, **bf16))
        # with the MUDD gate, it makes the skip's weight and x0's and the bigram's shares per token instead
        self.skip_gate_w = None if cfg.mudd_gate else nn.Parameter(torch.zeros(1, GATE_DIMS, **bf16))
        # attention value and output weights (0.5, 1) per layer; smear (0), backout (0.5; none with MUDD, whose
        # bias takes its place) and skip (-1.5: sigmoid 0.18) weights (record)
        self.scalars = nn.Parameter(torch.cat([torch.tensor([0.5, 1.0]).repeat(L),
                                               torch.tensor([0.0, -1.5] if cfg.mudd else [0.0, 0.5, -1.5])]))
        # per layer, (attention, MLP): x = resid x + post out; resid from sqrt(1.1) (1.1 a layer, as before),
        # post from 1 (record 2026-03-06_SimplifyHC)
        self.resid_lambdas = nn.Parameter(torch.full((L, 2), RESID_INIT))
        self.post_lambdas = nn.Parameter(torch.ones(L, 2))
        self.x0_lambdas = None if cfg.mudd_gate else nn.Parameter(torch.zeros(L))  # x0's share with each attention
        self.bigram_lambdas = (nn.Parameter(torch.full((L,), BIGRAM_INIT)) if cfg.bigram_vocab and not cfg.mudd_gate
                               else None)  # and the bigram embedding's
        self.mudd = MUDD(dim, cfg.num_heads) if cfg.mudd else None
        self.gate = MuddGate(dim, gate_layout(cfg)) if cfg.mudd_gate else None
        self.gate_at, self.dc_window = cfg.mudd_gate_layer, (cfg.dc_window if cfg.dc_layers else 0)
        self.mudd_ve = next(t for t in cfg.value_embeds if t >= 0) if cfg.mudd else None  # the first VE layer's
        self.head_loss, self.eval_loss = head_loss, eval_loss
        # the bigram sign table: random +-1 in bf16, a buffer the checkpoint holds (record 2026-05-20). Drawn last,
        # so that the other weights start as they did before it
        self.register_buffer("bigram_sign_table", torch.randn(cfg.bigram_signs, bigram_dim).sign().bfloat16()
                             if cfg.bigram_vocab and cfg.bigram_signs else None)
        # each token's prefix token (prefix_tokens), for the prefix-token loss: fixed, so not in checkpoints
        self.register_buffer("prefix_table", torch.tensor(prefix_tokens(V)) if cfg.prefix_weight else None,
                             persistent=False)
        # --fp8_down's scales per layer: the activation's (1 at first, as the record's), the weights' for their
        # e4m3 copy now and the one set from them for the next (fp8_down_weight_scales); state a checkpoint holds.
        # Rows of 16 bytes (a fourth column unused): the activation's scale, which the MLP kernel reads, is then
        # 16-byte aligned in every layer, so one compiled kernel serves all (Triton specializes on alignment).
        # And each layer's largest activation in the step's passes so far, 0 between steps
        self.register_buffer("fp8_down_scales", torch.ones(L, 4) if cfg.fp8_down else None)
        self.register_buffer("fp8_down_amax", torch.zeros(L) if cfg.fp8_down else None, persistent=False)
        if cfg.fp8_down:
            fp8_down_weight_scales(self.fp8_down_scales, [b.mlp.proj_w for b in self.blocks], exact=True)
        self.grad_sinks = {}  # table weight -> RowSink, attached by the optimizer (ShardedOptimizer.row_sinks)
        self.weight_copies = None  # the matrices' compute copies while training (use_weight_copies)

    def lambdas(self):
        """The scalars by name: attention (L, 2) weights; smear, backout (None with MUDD), skip."""
        L, s = len(self.blocks), self.scalars
        return s[:2 * L].view(L, 2), s[2 * L], None if self.mudd else s[2 * L + 1], s[-1]

    def compile_regions(self, whole: bool, backend: str = "inductor"):
        """torch.compile the blocks and the head, either as one graph (whole) or block by block. One graph fuses
        the glue between blocks and the building of the attention masks, and suits one GPU. Block by block,
        backward finishes block by block, so the grads of late layers are final (and their reduce-scatter
        starts) while early layers are still running: what several GPUs need."""
        # each block instance, with and without grad, is its own compiled variant: lift dynamo's cap of 8
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        # pointwise kernels take Inductor's heuristic launch instead of timing several at the first step: 1.5 s
        # less cold warm-up, the same kernel time (records/2026-12-06_warmup-h100)
        import torch._inductor.config as inductor_config
        inductor_config.triton.autotune_pointwise = False
        if whole:
            self.core = torch.compile(self.core, dynamic=False, backend=backend)
        else:
            for block in self.blocks:
                block.compile(dynamic=False, backend=backend)
        self.head_loss = torch.compile(head_loss, dynamic=False, backend=backend)
        self.eval_loss = torch.compile(eval_loss, dynamic=False, backend=backend)

    def tables(self) -> list:
        """The embedding tables, each read a row per token."""
        return [self.embed, *self.value_embeds] + ([self.bigram_embed] if self.bigram_embed is not None else [])

    def lookup(self, table: nn.Embedding, ids: Tensor, order: tuple = None) -> Tensor:
        """table's rows at ids. While training with the optimizer's row sinks attached (grad_sinks), the
        rows' grads are added straight into the table's fp32 grad sum: no dense (rows x dim) grad per
        micro-step (the bigram table has 251,520 rows). order: ids flattened and sorted, and where each came
        from (torch.sort), shared by the tables that the same ids index."""
        sink = self.grad_sinks.get(table.weight)
        if sink is None or not torch.is_grad_enabled():
            return table(ids)
        return RowsIntoSum.apply(table.weight, ids, sink, order)

    def embed_tokens(self, x: Tensor) -> Tensor:
        """x0 from the token embeddings x (B, T, dim): each plus a gated share of its predecessor's in its
        sequence (smear, record 2025-09-18), rms-normed."""
        share = self.lambdas()[1] * gate(x[:, 1:], self.smear_gate_w)
        return norm(torch.cat([x[:, :1], x[:, 1:] + share * x[:, :-1]], dim=1))

    @torch.no_grad()
    def step_fp8_down(self, step: int, comm: "Comm"):
        """After optimizer step `step` under --fp8_down: the next step's activation scales from this one's
        passes, and the weights' for their next e4m3 copies (exact after the first FP8_DOWN_EXACT_STEPS steps)."""
        fp8_down_act_scales(self.fp8_down_scales, self.fp8_down_amax, comm)
        fp8_down_weight_scales(self.fp8_down_scales, [b.mlp.proj_w for b in self.blocks],
                               exact=step < FP8_DOWN_EXACT_STEPS)

    def use_weight_copies(self, copies: "WeightCopies"):
        """Compute with copies' bf16 matrices (each block's attention and MLP looks its own up by name)."""
        self.weight_copies = copies
        of = {id(p): c for p, c in zip(copies.masters, copies.copies)}
        fp8 = {id(copies.masters[i]): f8 for i, f8 in copies.fp8.items()}
        for module in self.modules():
            if isinstance(module, (Attention, MLP)):
                module.copies = {name: of[id(p)] for name, p in module.named_parameters(recurse=False)
                                 if id(p) in of}
            if isinstance(module, MLP):
                module.fc_fp8 = fp8.get(id(module.fc_w))
        if self.fp8_down_scales is not None and copies.fp8:  # the down projection in FP8 too
            index = {id(p): i for i, p in enumerate(copies.masters)}
            for i, block in enumerate(self.blocks):
                scales = self.fp8_down_scales[i]
                w_f8 = copies.fp8_down(index[id(block.mlp.proj_w)], scales[1:2])
                block.mlp.down_fp8 = (w_f8, scales[0:1], scales[1:2], self.fp8_down_amax[i:i + 1])

    def hidden(self, idx: Tensor, windows: Tensor) -> Tensor:
        """idx: (B, T) token ids of B sequences, or (T,) of one; windows: (short, long) window in tokens.
        Returns the last block's output after MUDD's last mix (or less the backout), (B, T, dim). The table
        lookups run outside the compiled graph (core), so that their grads can go straight into the fp32 sums."""
        idx = idx if idx.dim() == 2 else idx[None]
        if self.weight_copies is not None:
            self.weight_copies.sync()
        bigram = None
        if self.bigram_embed is not None:
            bigram = self.lookup(self.bigram_embed, bigram_hash(idx, self.bigram_embed.num_embeddings))
        # the token ids in order, once for the six tables they index: each table's rows then sum a run of
        # equal ids before one atomic add (add_rows_into_fp32)
        order = tuple(torch.sort(idx.flatten())) if self.grad_sinks and torch.is_grad_enabled() else None
        return self.core(idx, windows, self.lookup(self.embed, idx, order), bigram,
                         [self.lookup(e, idx, order) for e in self.value_embeds])

    def core(self, idx: Tensor, windows: Tensor, tokens: Tensor, bigram, ve: list) -> Tensor:
        """The masks, the bigram signs and every block, from the rows the tables gave (B, T, dim each): one
        compiled graph."""
        kinds = {(b.paired, b.long_window) for b in self.blocks if b.attn is not None}
        if bigram is not None and self.bigram_sign_table is not None:
            bigram = bigram * self.bigram_sign_table[bigram_sign_rows(idx, self.bigram_sign_table.size(0))]
        masks = attention_masks(idx, windows, kinds, self.dc_window, self.kernels.attn_launch())
        return self.run_blocks(tokens, bigram, ve, masks)

    def stream_weights(self) -> Tensor:
        """Per layer, Block.forward's learned constants: (attention's resid, post, MLP's resid, post), then x0's
        and the bigram's shares unless the MUDD gate makes those, (L, 6 or 4)."""
        w = [self.resid_lambdas[:, 0], self.post_lambdas[:, 0], self.resid_lambdas[:, 1], self.post_lambdas[:, 1]]
        if self.gate is None:
            w += [self.x0_lambdas, self.x0_lambdas.new_zeros(len(self.blocks)) if self.bigram_lambdas is None
                  else self.bigram_lambdas]
        return torch.stack(w, dim=1)

    def mix(self, weights: Tensor, coef: dict, i: int):
        """Layer i's six weights for Block.forward: the constants, x0's and the bigram's shares from the MUDD
        gate's coefficients where it makes them."""
        return weights[i] if self.gate is None else [*weights[i], coef.get(("x0", i)), coef.get(("bigram", i))]

    def head_gates(self, coef: dict, masks: dict, i: int) -> Optional[HeadGates]:
        """Layer i's HeadGates from the MUDD gate's coefficients; None without it."""
        if self.gate is None:
            return None
        dc = (coef["dc_in", i], coef["dc_out", i], masks["dc"], self.dc_window) if ("dc_in", i) in coef else None
        return HeadGates(coef.get(("xsa", i)), coef.get(("out", i)), dc)

    def run_blocks(self, tokens: Tensor, bigram, ve: list, masks: dict) -> Tensor:
        """The record's layers (2026-03-06_SimplifyHC): the bigram embedding joins the stream before layer 0 and
        each later layer's attention output, x0 each attention output; the layers after the backout layer attend
        to its output, not to x (they keep out what the last MLPs write for the prediction). With the MUDD gate
        (2026-05-27 v3) x0's and the bigram's shares, the skip's weight and the heads' XSA, output and DC
        coefficients are per token: from x0 for the layers before gate_at, from the stream entering it for the
        others. MUDD's x0 is the stream as layer 0 gets it (`first`), the bigram's share included; the x0 that
        joins each layer is too without the gate (2026-05-20's in-place add), not with it (v3's x0.clone())."""
        sa, _, backout, skip_w = self.lambdas()
        x0 = self.embed_tokens(tokens)
        weights = self.stream_weights().type_as(x0)  # in the stream's dtype, as the record's .bfloat16()
        coef = self.gate.coefficients(x0, 0) if self.gate is not None else {}
        x = first = x0 if bigram is None else add_to_first_dims(x0, self.mix(weights, coef, 0)[5] * bigram)
        if self.gate is None:
            x0 = first
        skipped = backout_x = second_last = mudd = None
        for i, block in enumerate(self.blocks):
            if self.gate is not None and i == self.gate_at:
                coef.update(self.gate.coefficients(x, 1))
            skip = None
            if i == self.skip_to:  # the earlier output times sigmoid(skip_w) x the gate's weight or 2 gate(x0)
                weight = coef["skip", i] if self.gate is not None else 2 * gate(x0, self.skip_gate_w)
                skip = (torch.sigmoid(skip_w) * weight, skipped)
            ve_i = ve[self.ve_of_layer[i]] if self.ve_of_layer[i] >= 0 else None
            gates = self.head_gates(coef, masks, i)
            if mudd is None:
                x = block(x, x0, bigram if i > 0 else None, backout_x, self.mix(weights, coef, i), ve_i, masks,
                          self.rotary, sa[i], self.kernels.flex_options, skip, None, gates)
            else:  # the last layer, its weights per token from MUDD
                x = block(x, first, bigram, backout_x, mudd[1], ve_i, masks, self.rotary, sa[i],
                          self.kernels.flex_options, skip, mudd[0], gates)
            if self.mudd is not None and i == len(self.blocks) - 2:
                second_last = x
                x, *mudd = self.mudd.inner(x, first, backout_x)
            if i == self.skip_from:
                skipped = x
            if i == self.backout_layer:
                backout_x = x
        if self.mudd is not None:
            return self.mudd.outer(x, [first, backout_x, second_last, ve[self.mudd_ve], skipped])
        return x - backout * backout_x

    def forward(self, idx: Tensor, targets: Tensor, windows: Tensor, mtp_weights: Tensor = None):
        """idx, targets: (B, T) token ids of B sequences, or (T,) of one. Training: (multi-token loss to
        backpropagate, next-token loss), each summed over the tokens; eval: the next-token loss sum, twice.
        mtp_weights: loss_weights_at's, the prefix token's last where the model has a prefix table."""
        x = self.hidden(idx, windows)
        targets = targets.long()
        if not self.training:
            loss = self.eval_loss(x, self.head_w, targets)
            return loss, loss
        k = self.kernels
        prefix = None if self.prefix_table is None else self.prefix_table[targets]
        assert mtp_weights.numel() == MTP_TOKENS + (prefix is not None), "loss_weights_at's weights, one per term"
        return self.head_loss(x, self.head_w, targets, mtp_weights, self.fp8_head,
                              k.head_launch(), k.ce_tanh_approx, prefix)


def param_groups(model: GPT) -> tuple[dict, dict]:
    """NorMuon gets the hidden matrices, Adam the rest, each by its group of MUON_GROUPS / ADAM_GROUPS."""
    blocks = list(model.blocks)
    attns = [b.attn for b in blocks if b.attn is not None]
    muon = {"attn_qk": [a.qk_w for a in attns], "attn_vo": [a.vo_w for a in attns],
            "mlp_in": [b.mlp.fc_w for b in blocks], "mlp_out": [b.mlp.proj_w for b in blocks]}
    adam = {"head": [model.head_w, model.embed.weight],  # this order: the optimizer ties the second to the first
            "embeds": [e.weight for e in model.value_embeds] + ([model.bigram_embed.weight] if model.bigram_embed
                                                                else []),
            "scalars": [model.scalars], "resid": [model.resid_lambdas],
            "inject": [model.post_lambdas, model.x0_lambdas, model.bigram_lambdas],
            "gates": [w for b in blocks if b.attn is not None for w in (b.attn.gate_w, b.attn.ve_gate_w)],
            "smear": [model.smear_gate_w], "skip": [model.skip_gate_w],
            "xsa": [b.attn.xsa_w for b in blocks if b.attn is not None],
            "mudd": [model.mudd.w_in, model.mudd.w_out] if model.mudd else [],
            "mudd_bias": [model.mudd.bias] if model.mudd else [],
            "mudd_gate": [model.gate.w_in, model.gate.w_out] if model.gate else [],
            "mudd_gate_bias": [model.gate.bias, model.gate.scale] if model.gate else []}
    muon, adam = ({k: [p for p in v if p is not None] for k, v in g.items()} for g in (muon, adam))
    muon, adam = ({k: v for k, v in g.items() if v} for g in (muon, adam))
    grouped = [id(p) for g in (muon, adam) for ps in g.values() for p in ps]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters()), "every parameter in exactly one group"
    return muon, adam


# ----------------------------------------------------------------------------------------------------------
# Optimizer: the update rules as pure tensor functions, then the sharded optimizer that keeps their state and
# overlaps its communication with backward

# Polar Express (Amsel et al., 2025), as the record runs it (2025-09-29_PolarExpress): 5 iterations with
# these coefficients, computed for a 2e-2 safety factor and cushion 2
POLAR_EXPRESS_COEFFS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def polar_express(G: Tensor) -> Tensor:
    """Approximately orthogonalize G (the U V^T of its SVD) in bf16: odd matrix polynomials a X + (b A + c A^2) X,
    A = X X^T, whose coefficients change per iteration to push every singular value towards 1 quickly."""
    X = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation: X @ X.T is then the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)  # spectral norm <= Frobenius norm < 1
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = mm(X, X.mT)
        X = mm_add(X, mm_add(A, A, A, b, c), X, a)
    return X.mT if tall else X


def muon_shape_factor(shape) -> float:
    """Tall matrices (fan-out > fan-in) step sqrt(rows/cols) further."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def normuon_update(grad: Tensor, momentum_buf: Tensor, second_buf: Tensor, momentum: float, beta2: float) -> Tensor:
    """NorMuon's direction for a stack of matrices (record 2025-10-24): Nesterov momentum, orthogonalized; then
    each neuron's row (or column, along the longer side) divided by the root of its running mean square
    (second_buf, decay beta2), and the matrix rescaled to the orthogonalized one's Frobenius norm."""
    momentum_buf.lerp_(grad, 1 - momentum)
    v = polar_express(grad.lerp(momentum_buf, momentum)).float()
    second_buf.lerp_(v.square().mean(dim=neuron_dim(v.shape), keepdim=True), 1 - beta2)
    u = v * second_buf.clamp_min(1e-10).rsqrt()
    return u * (v.norm(dim=(-2, -1), keepdim=True) / u.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))


def neuron_dim(shape) -> int:
    """The dim NorMuon averages over: within rows if there are at least as many rows as columns."""
    return -1 if shape[-2] >= shape[-1] else -2


def second_moment_shape(shape) -> tuple:
    return (*shape[:-2], shape[-2], 1) if neuron_dim(shape) == -1 else (*shape[:-2], 1, shape[-1])


def adam_update(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, betas, eps: float) -> Tensor:
    """Bias-corrected Adam direction (no weight decay), m_hat / (sqrt(v_hat) + eps), written over grad once the
    moments have taken it in: no temporary the size of the bucket (the head's is 77M values)."""
    exp_avg.lerp_(grad, 1 - betas[0])
    exp_avg_sq.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    denom = torch.div(exp_avg_sq, 1 - betas[1] ** step, out=grad).sqrt_().add_(eps)
    return torch.div(exp_avg, denom, out=denom).div_(1 - betas[0] ** step)


def finite(t: Tensor) -> Tensor:
    """Whether every value of t is finite, as a device bool, in one read of t: its min and max are NaN if any
    value is, and +-inf if any value is infinite. isfinite().all() made 4 passes with bool temporaries (the
    optimizer's 540M values each step)."""
    return torch.stack(torch.aminmax(t)).isfinite().all() if t.numel() else t.new_ones((), dtype=torch.bool)


def cautious_step(p: Tensor, update: Tensor, lr: float, decay: float, strict: bool):
    """p -= lr * update + decay * p, the decay only where update and p have the same sign, so that it never
    works against the update (cautious weight decay, records 2025-11-10 and 2025-12-18). The record's Muon
    counts a zero product as agreeing, its Adam does not (strict)."""
    step = torch.mul(update, p)  # one temporary, reused: the sign products, then the whole step
    agree = step > 0 if strict else step >= 0
    torch.mul(p, agree, out=step).mul_(decay).add_(update, alpha=lr)
    p.sub_(step)


# torch 2.13 renamed the tensor-to-tensor collectives and warns on the old names; 2.11 has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class Comm:
    """The collectives the trainer needs; with one process they are copies."""

    class _Done:
        def wait(self):
            pass

    def __init__(self, rank: int, world: int, device=None):
        self.rank, self.world, self.device = rank, world, device

    def reduce_scatter(self, out: Tensor, inp: Tensor):
        if self.world == 1:
            out.copy_(inp)
            return self._Done()
        return _reduce_scatter(out, inp, op=dist.ReduceOp.SUM, async_op=True)

    def all_gather(self, out: Tensor, inp: Tensor):
        if self.world == 1:
            if inp.data_ptr() != out.data_ptr():  # the optimizer updates a one-process shard in place
                out.copy_(inp)
            return self._Done()
        return _all_gather(out, inp, async_op=True)

    def all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def all_max(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def all_ok(self, ok: bool) -> bool:
        """True if ok is true on every rank: how ranks agree to go on after a step that can fail on one of them
        (reading a checkpoint, writing one), instead of the others hanging in their next collective."""
        if self.world == 1:
            return ok
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


class Bucket:
    """Parameters of one group whose gradients travel together: laid end to end in `flat` (fp32), zero-padded
    to `world` shards of `shard_numel`. Rank r reduces, updates and broadcasts shard r. A NorMuon bucket holds
    up to `world` matrices of one shape per rank slot, so each rank orthogonalizes whole matrices. Optimizer
    state is fp32 (record); the grads of bf16 parameters are summed in fp32 (`acc`) micro-step by micro-step,
    so the sum is the same at any world size."""

    def __init__(self, params: list, kind: str, group: str, shard_numel: int, world: int):
        device = params[0].device
        self.params, self.kind, self.group = params, kind, group
        self.numel = sum(p.numel() for p in params)
        self.device, self.flat_numel = device, world * shard_numel
        self.flat = None  # made by scratch() when a step needs it, dropped at the step's end
        self.grad = torch.zeros(shard_numel, device=device)
        self.finite = torch.ones((), dtype=torch.bool, device=device)  # its parameters after their last update
        # each state's size per parameter: what state_dict() gathers and splits
        if kind == "muon":
            sizes = {"momentum": [p.numel() for p in params],
                     "second": [math.prod(second_moment_shape(p.shape)) for p in params]}
        else:
            sizes = {"exp_avg": [p.numel() for p in params], "exp_avg_sq": [p.numel() for p in params]}
        per_slot = shard_numel // params[0].numel() if kind == "muon" else None
        self.state_sizes = sizes
        self.state = {name: torch.zeros(shard_numel if kind == "adam" or name == "momentum" else per_slot * s[0],
                                        device=device) for name, s in sizes.items()}
        self.acc = None
        if params[0].dtype != torch.float32:
            self.sum_in_fp32(world)
        self.ready = 0      # params of this bucket whose grads are final
        self.work = None    # the collective in flight

    def sum_in_fp32(self, world: int):
        """Sum the micro-steps' grads in fp32 (acc); on one process the sum is the grad the optimizer reads, as
        it is (the bigram table's sum alone is 773 MB)."""
        self.acc = torch.zeros(self.numel, device=self.device)
        if world == 1:
            self.grad = self.acc

    def scratch(self) -> Tensor:
        """flat: the parameters (or, for the reduce, the grads) end to end in fp32, its padding to `world`
        shards zero; made when a step first needs it and dropped at the step's end, where held for the run
        one GPU's 2 GB of them sat in the forward's peak (records/2026-12-06_mb4-h100)."""
        if self.flat is None:
            self.flat = torch.empty(self.flat_numel, device=self.device)
            self.flat[self.numel:].zero_()
        return self.flat


def _grad_ready_hook(opt_ref, bucket_index: int, offset: int, param: Tensor):
    opt = opt_ref()
    if opt is not None:
        opt._grad_ready(opt.buckets[bucket_index], offset, param)


class RowSink:
    """Where an embedding table's micro-step grads go: each row's grad added into the table's fp32 sum (its
    view of the bucket's acc), then the bucket told that this grad is final."""

    def __init__(self, acc: Tensor, ready):
        self.acc, self.ready = acc, ready

    @torch.no_grad()
    def add(self, ids: Tensor, grad: Tensor, order: tuple = None):
        add_rows_into_fp32(self.acc, ids.flatten(), grad.reshape(-1, grad.size(-1)), order=order)
        self.ready()


class WeightCopies:
    """bf16 copies of the fp32 matrices, which the model computes with while training: cast once when the
    matrices change (an optimizer step, a checkpoint's or warm-up's restore), not in every micro-step's
    forward, and each copy's grad goes straight into its bucket's fp32 sum (as a bf16 parameter's does), so
    backward makes no fp32 grad to add to .grad. The same function: the same casts, the same fp32 sums in the
    same order. sync() finds changed matrices by their version counters (every in-place write bumps one)."""

    def __init__(self, masters: list, dtype: torch.dtype, fp8: tuple = ()):
        self.masters = masters
        self.copies = [p.detach().to(dtype).requires_grad_() for p in masters]
        self.versions = [p._version for p in masters]
        # {index: (e4m3 copy, its scale)} for the masters at these indices (the MLPs' fc_w under --fp8_mlp): made
        # from the bf16 copy whenever it is, in place, so the compiled graphs keep reading the same tensors
        self.fp8 = {i: fp8_weight(self.copies[i]) for i in fp8}
        self.down = {}  # {index: (e4m3 copy, the scale it is made with)}: the MLPs' proj_w under --fp8_down

    def fp8_down(self, i: int, scale: Tensor) -> Tensor:
        """An e4m3 copy of master i (an MLP's proj_w) by fp8_down_weight at scale, a device scalar that others
        set (fp8_down_weight_scales, a checkpoint's restore): remade with the bf16 copy, in place."""
        self.down[i] = (fp8_down_weight(self.copies[i], scale).contiguous(), scale)
        return self.down[i][0]

    @torch.no_grad()
    def sync(self):
        stale = [i for i, p in enumerate(self.masters) if p._version != self.versions[i]]
        if stale:
            torch._foreach_copy_([self.copies[i] for i in stale], [self.masters[i] for i in stale])
            self.versions = [p._version for p in self.masters]
        for i in (i for i in stale if i in self.fp8):
            for held, new in zip(self.fp8[i], fp8_weight(self.copies[i])):
                held.copy_(new)
        for i in (i for i in stale if i in self.down):
            held, scale = self.down[i]
            held.copy_(fp8_down_weight(self.copies[i], scale))


class ShardedOptimizer:
    """NorMuon for hidden matrices, Adam for the rest, ZeRO-1 style: gradients are reduce-scattered so each rank
    updates only its shard, then the updated parameters are all-gathered. A bucket's reduce-scatter starts from
    a post-accumulate-grad hook as soon as its last gradient is final (during the last micro-step's backward),
    so communication overlaps the rest of backward; step() waits on the handles. Adam's buckets take part only
    in Adam steps (adam_now); in between their grads keep summing. While `tied`, the head bucket's second
    parameter (the token embedding) adds its grad to the first's (lm_head) and is then set to its copy."""

    def __init__(self, muon_groups: dict, adam_groups: dict, cfg: "Hyperparameters", comm: Comm):
        self.comm, self.cfg = comm, cfg
        self.steps = self.adam_steps = 0
        self.reduce_in_backward = False  # set by the loop for the last micro-step of a batch
        self.adam_now, self.tied = True, True  # set by the loop for each step
        self.buckets = []
        for group, params in muon_groups.items():
            # backward produces the last layers' grads first, so bucket them first
            params = list(reversed(params))
            # several ranks: one matrix per rank, so a bucket's reduce-scatter starts as soon as backward has
            # made `world` of them. One GPU has nothing to overlap: every matrix of the group in one bucket,
            # orthogonalized as one batch (one by one, 46 matrices were ~2,500 small kernels per step)
            per_rank = len(params) if comm.world == 1 else 1
            for i in range(0, len(params), per_rank * comm.world):
                self.buckets.append(Bucket(params[i:i + per_rank * comm.world], "muon", group,
                                           per_rank * params[0].numel(), comm.world))
        for group, params in adam_groups.items():
            numel = sum(p.numel() for p in params)
            self.buckets.append(Bucket(params, "adam", group, math.ceil(numel / comm.world), comm.world))
        self.head = next((b for b in self.buckets if b.group == "head"), None)
        self.params = [p for b in self.buckets for p in b.params]  # fixed order, the same at any world size
        for i, b in enumerate(self.buckets):
            self._hook_grads(i, b.params)

    def _hook_grads(self, i: int, tensors: list):
        """Each of tensors (bucket i's parameters, or what stands in for them) hands its grad, once accumulated,
        to _grad_ready at its parameter's offset in the bucket. A tensor's hooks live in C++, where the cycle
        collector cannot see them: a hook holding the optimizer (which holds the parameter) would keep both alive
        for ever, so it holds a weak reference."""
        me, offset = weakref.ref(self), 0
        for p, t in zip(self.buckets[i].params, tensors, strict=True):
            t.register_post_accumulate_grad_hook(partial(_grad_ready_hook, me, i, offset))
            offset += p.numel()

    def active(self, b: Bucket) -> bool:
        return b.kind == "muon" or self.adam_now

    def weight_copies(self, dtype: torch.dtype) -> WeightCopies:
        """The NorMuon matrices' compute copies in dtype, whose grads (a micro-step's each) their buckets then
        sum in fp32, as they sum bf16 parameters'."""
        muon = [(i, b) for i, b in enumerate(self.buckets) if b.kind == "muon" and b.acc is None]
        groups = [b.group for _, b in muon for _ in b.params]
        made = WeightCopies([p for _, b in muon for p in b.params], dtype,
                            fp8=tuple(j for j, g in enumerate(groups) if g == "mlp_in" and self.cfg.fp8_mlp))
        copies = iter(made.copies)
        for i, b in muon:
            b.sum_in_fp32(self.comm.world)
            self._hook_grads(i, [next(copies) for _ in b.params])
        return made

    def row_sinks(self, weights: list) -> dict:
        """{weight: RowSink} for the embedding tables among `weights` that are bf16 (summed in fp32): the model
        hands their rows' grads to these (GPT.lookup) instead of making dense grads."""
        sinks = {}
        for b in self.buckets:
            offset = 0
            for p in b.params:
                if b.acc is not None and any(p is w for w in weights):
                    sinks[p] = RowSink(b.acc[offset:offset + p.numel()].view(p.shape), partial(self._count_ready, b))
                offset += p.numel()
        return sinks

    @torch.no_grad()
    def _grad_ready(self, bucket: Bucket, offset: int, param: Tensor):
        if param.grad is None:  # a table whose rows' grads went to its RowSink, which counts it
            return
        if bucket.acc is not None:  # fold this micro-step's bf16 grad into the fp32 sum
            add_into_fp32(bucket.acc[offset:offset + param.numel()], param.grad.reshape(-1))
            param.grad = None
        self._count_ready(bucket)

    def _count_ready(self, bucket: Bucket):
        """One more of the bucket's grads is final for this micro-step; on the last micro-step, once all are,
        its reduce starts."""
        if self.reduce_in_backward and self.active(bucket):
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._reduce(bucket)

    @torch.no_grad()
    def _reduce(self, b: Bucket):
        summed = b.grad if b.acc is b.grad else b.scratch()  # one process: the fp32 sum is reduced where it is
        if b.acc is None:
            torch.cat([p.grad.reshape(-1) for p in b.params], out=b.flat[:b.numel])
        elif b.acc is not b.grad:
            b.flat[:b.numel].copy_(b.acc)
            b.acc.zero_()
        if b is self.head and self.tied:  # the embedding's grad joins lm_head's; its own update is then a copy
            n = b.params[0].numel()
            summed[:n] += summed[n:2 * n]
            summed[n:2 * n].zero_()
        b.work = Comm._Done() if summed is b.grad else self.comm.reduce_scatter(b.grad, b.flat)

    def _shard_slice(self, b: Bucket, numel: int) -> slice:
        return slice(self.comm.rank * numel, (self.comm.rank + 1) * numel)

    @property
    def launched(self) -> int:
        return sum(b.work is not None for b in self.buckets)

    @torch.no_grad()
    def step(self, lr_factor: float, muon_momentum: float):
        self.steps += 1
        self.adam_steps += self.adam_now
        active = [b for b in self.buckets if self.active(b)]
        for b in active:
            if b.work is None:
                self._reduce(b)
        for b in active:
            b.work.wait()
            torch.cat([p.reshape(-1) for p in b.params], out=b.scratch()[:b.numel])
            shard = b.flat[self._shard_slice(b, b.grad.numel())]
            if self.comm.world > 1:  # the all-gather's input may not alias its output; on one process it is it
                shard = shard.clone()
            if b.kind == "adam":
                self._adam(b, shard, lr_factor)
            else:
                self._muon(b, shard, lr_factor, muon_momentum)
            b.work = self.comm.all_gather(b.flat, shard)
        for b in active:
            b.work.wait()
            b.work, b.ready = None, 0
            if b.acc is b.grad:  # consumed: the next step sums from zero
                b.acc.zero_()
            if b is self.head and self.tied:
                n = b.params[0].numel()
                b.flat[n:2 * n].copy_(b.flat[:n])
            b.finite = finite(b.flat[:b.numel])
        params = [p for b in active for p in b.params]
        news = [new.view_as(p) for b in active
                for new, p in zip(b.flat[:b.numel].split([p.numel() for p in b.params]), b.params)]
        torch._foreach_copy_(params, news)  # one launch for every parameter, not one each
        for p in params:
            p.grad = None
        for b in active:
            b.flat = None

    def _adam(self, b: Bucket, shard: Tensor, lr_factor: float):
        cfg, group = self.cfg, ADAM_GROUPS[b.group]
        lr = cfg.adam_lr * group.lr_mul * lr_factor
        cautious_step_fused(shard, b.state["exp_avg"], lr, lr * lr * cfg.adam_wd * group.wd_mul, strict=True,
                            adam=(b.grad, b.state["exp_avg_sq"], self.adam_steps, group.betas, cfg.adam_eps))

    def _muon(self, b: Bucket, shard: Tensor, lr_factor: float, momentum: float):
        """This rank's matrices are the bucket's [rank * k, rank * k + k); those past its end are padding."""
        cfg, shape = self.cfg, b.params[0].shape
        k = b.grad.numel() // b.params[0].numel()
        mine = min(k, len(b.params) - self.comm.rank * k)
        if mine <= 0:
            return
        update = normuon_update(b.grad.view(k, *shape)[:mine], b.state["momentum"].view(k, *shape)[:mine],
                                b.state["second"].view(k, *second_moment_shape(shape))[:mine], momentum,
                                cfg.muon_beta2)
        base = cfg.muon_lr * lr_factor
        lr = base * MUON_GROUPS[b.group] * muon_shape_factor(shape)
        # the record's decay: muon_wd times the scheduled base lr times this group's lr
        cautious_step_fused(shard[:update.numel()].view_as(update), update, lr, cfg.muon_wd * base * lr,
                            strict=False)

    @torch.no_grad()
    def untie(self):
        """From now on the token embedding trains on its own, from lm_head's weights and Adam state (record
        2025-12-19: at 2/3 of training). Collective."""
        b, n = self.head, self.head.params[0].numel()
        for name, shard in b.state.items():
            full = self._gathered(b, shard)
            full[n:2 * n] = full[:n]
            shard.copy_(full[self._shard_slice(b, shard.numel())])
        self.tied = False

    def _gathered(self, b: Bucket, shard: Tensor) -> Tensor:
        full = shard.new_empty(shard.numel() * self.comm.world)
        self.comm.all_gather(full, shard).wait()
        return full

    def _adam_sums(self) -> list:
        """Each Adam bucket's grads summed so far on this rank (the fp32 sums of bf16 parameters, the .grad of
        fp32 ones): what the next Adam step will reduce."""
        sums = []
        for b in self.buckets:
            if b.kind == "adam":
                sums.append(b.acc if b.acc is not None else torch.cat(
                    [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params]))
        return sums

    @torch.no_grad()
    def set_pending_grads(self, sums: list):
        for b, s in zip([b for b in self.buckets if b.kind == "adam"], sums):
            if b.acc is not None:
                b.acc.copy_(s)
                continue
            for p, g in zip(b.params, s.split([p.numel() for p in b.params])):
                p.grad = g.view_as(p).to(p.dtype).clone()

    @torch.no_grad()
    def zero_grads(self):
        """Drop every grad summed so far (the fp32 sums included): warm-up's steps must leave none behind."""
        for b in self.buckets:
            if b.acc is not None:
                b.acc.zero_()
            b.ready, b.work = 0, None
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def all_finite(self) -> Tensor:
        """Whether every parameter is finite, as a device bool (no sync): a diverged run can keep a finite,
        soft-capped loss for steps after its weights overflowed. Each bucket's verdict was made at its last
        update, in fp32, before the parameters' cast (a bucket not updated since keeps it)."""
        return torch.stack([b.finite for b in self.buckets]).all()

    @torch.no_grad()
    def state_dict(self) -> dict:
        """Full (unsharded) state per parameter, so a checkpoint resumes at any world size. Collective."""
        state = [{} for _ in self.params]
        i = 0
        for b in self.buckets:
            for name, shard in b.state.items():
                sizes = b.state_sizes[name]
                full = self._gathered(b, shard)[:sum(sizes)]
                for j, t in enumerate(full.split(sizes)):
                    shape = second_moment_shape(b.params[j].shape) if name == "second" else b.params[j].shape
                    state[i + j][name] = t.view(shape).cpu()  # full is a fresh buffer: no copy of it
            i += len(b.params)
        # after an even step, Adam's grads of that step wait for the next: the sum over all ranks is kept (rank 0
        # gets it back on resume), so a resumed run takes the same Adam step
        pending = [self.comm.all_reduce(s.clone()).cpu() for s in self._adam_sums()] if self.steps % 2 else None
        return {"steps": self.steps, "adam_steps": self.adam_steps, "tied": self.tied, "state": state,
                "pending_adam_grads": pending}

    def local_state(self) -> dict:
        """What state_dict holds, as this rank has it, copied to host memory for load_local_state on the same
        rank: its shards of the states (the gathered whole would put world copies of it on one host) and its own
        Adam grads pending. Not collective."""
        pending = [s.to("cpu", copy=True) for s in self._adam_sums()] if self.steps % 2 else None
        return {"steps": self.steps, "adam_steps": self.adam_steps, "tied": self.tied, "pending_adam_grads": pending,
                "shards": [{name: shard.to("cpu", copy=True) for name, shard in b.state.items()} for b in self.buckets]}

    @torch.no_grad()
    def load_local_state(self, sd: dict):
        self.steps, self.adam_steps, self.tied = sd["steps"], sd["adam_steps"], sd["tied"]
        if sd["pending_adam_grads"] is not None:
            self.set_pending_grads([s.to(self.buckets[0].device) for s in sd["pending_adam_grads"]])
        for b, shards in zip(self.buckets, sd["shards"], strict=True):
            for name, shard in b.state.items():
                shard.copy_(shards[name])

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        self.steps, self.adam_steps, self.tied = sd["steps"], sd["adam_steps"], sd["tied"]
        if sd["pending_adam_grads"] is not None:
            mine = self.comm.rank == 0
            self.set_pending_grads([(s if mine else torch.zeros_like(s)).to(self.buckets[0].device)
                                    for s in sd["pending_adam_grads"]])
        i = 0
        for b in self.buckets:
            for name, shard in b.state.items():
                full = shard.new_zeros(shard.numel() * self.comm.world)
                flat = torch.cat([sd["state"][i + j][name].reshape(-1) for j in range(len(b.params))])
                full[:flat.numel()] = flat
                shard.copy_(full[self._shard_slice(b, shard.numel())])
            i += len(b.params)


# ----------------------------------------------------------------------------------------------------------
# Data: FineWeb-format shards

SHARD_MAGIC = 20240520   # first int32 of a FineWeb .bin shard (llm.c's format)
SHARD_VERSION = 1
HEADER_BYTES = 256 * 4   # 256 int32: magic, version, token count, then zeros; uint16 tokens follow
DATA_HINT = ("get FineWeb shards with `python data/cached_fineweb10B.py 9`, or make shards from your own text "
             "with `python data/tokenize_text.py`")


class ShardFormatError(UserError):
    pass


def unreadable(path: str, e: OSError) -> ShardFormatError:
    return ShardFormatError(f"{path}: cannot read it ({e.strerror or e}): check its permissions (and the disk). "
                            f"{DATA_HINT}")


def read_header(path: str) -> int:
    """Checks a shard's header against its size; returns its token count."""
    try:
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype="<i4", count=256) if size >= HEADER_BYTES else None
    except OSError as e:
        raise unreadable(path, e) from None
    if header is None:
        raise ShardFormatError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header. {DATA_HINT}")
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ShardFormatError(f"{path}: header starts {header[0]}, {header[1]}; a shard starts {SHARD_MAGIC}, "
                               f"{SHARD_VERSION}. Not a FineWeb-format shard. {DATA_HINT}")
    num_tokens = int(header[2])
    if size != HEADER_BYTES + 2 * num_tokens:
        raise ShardFormatError(f"{path}: header says {num_tokens:,} tokens ({HEADER_BYTES + 2 * num_tokens:,} "
                               f"bytes) but the file has {size:,} bytes: truncated or corrupt. {DATA_HINT}")
    return num_tokens


def is_shard(path) -> bool:
    """True if path exists and its header matches its size: how the data scripts skip finished shards."""
    try:
        read_header(str(path))
        return True
    except (OSError, ShardFormatError):
        return False


def load_shard(path: str) -> np.ndarray:
    """A shard's tokens, checked to be GPT-2 ids: a larger id would crash the step that reaches it, and every
    resume after it, with an IndexError that names no file."""
    count = read_header(path)
    try:
        tokens = np.fromfile(path, dtype="<u2", count=count, offset=HEADER_BYTES)
    except OSError as e:
        raise unreadable(path, e) from None
    if tokens.size and tokens.max() >= GPT2_VOCAB:
        pos = int(np.argmax(tokens >= GPT2_VOCAB))
        raise ShardFormatError(f"{path}: token {int(tokens[pos])} at position {pos:,} is not a GPT-2 id (< "
                               f"{GPT2_VOCAB}). Check all shards with `python data/check.py FILES`; {DATA_HINT}")
    return tokens


def missing_folders(folder: Path) -> list:
    """folder and those of its parents that do not exist yet, deepest first: what a data script that makes
    folder has made, for remove_empty to take back after a failed download."""
    return [p for p in [folder, *folder.parents] if not p.exists()]


def remove_empty(folders: list):
    """Remove each of folders (deepest first) while they are empty: a failed download leaves no folder behind."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def load_train_shard(path: str) -> np.ndarray:
    """load_shard's tokens, of a shard the trainer can cut into documents: at least one document start
    (<|endoftext|>, before every document). The trainer's rule for its train shards, and data/check.py's."""
    tokens = load_shard(path)
    if not np.any(tokens == BOS_ID):
        raise ShardFormatError(f"{path} holds no document start (<|endoftext|>, {BOS_ID}): every document must "
                               f"begin with one. {DATA_HINT}")
    return tokens


def find_shards(pattern: str, flag: str = "--train_files") -> list:
    """The files the glob matches, sorted, each a readable shard: fail before training, not an hour into it."""
    if os.path.isdir(pattern):
        raise ShardFormatError(f"{flag} {pattern!r} is a folder: pass a glob of its shards, e.g. "
                               f"'{os.path.join(pattern, '*.bin')}'")
    files = sorted(glob.glob(pattern))
    if not files and Path(pattern).parent == SAMPLE_SHARDS:
        raise ShardFormatError(f"no shards match {pattern!r}: the presets train on the shipped books, tokenized by "
                               f"the README's quick start: python {SAMPLE_SHARDS.parent / 'tokenize_text.py'} --out "
                               f"{SAMPLE_SHARDS} --name sample --val_tokens 16384 {SAMPLE_SHARDS.parent}/sample/"
                               f"books_val.jsonl {SAMPLE_SHARDS.parent}/sample/books_train.jsonl")
    if not files:
        raise ShardFormatError(f"no shards match {pattern!r}: {DATA_HINT}")
    for f in files:
        if os.path.isdir(f):
            raise ShardFormatError(f"{flag} {pattern!r} matches the folder {f}: make the glob match only shards")
        if not os.path.exists(f):  # glob lists a broken symbolic link
            raise ShardFormatError(f"{f} is a link to {os.readlink(f)!r}, which does not exist: fix or remove it")
        read_header(f)
    return files


FINGERPRINT_BYTES = 2**20


def shard_fingerprint(path: str) -> list:
    """[name, bytes, hash of the first and last MiB]: what a checkpoint records of each shard it read, so that a
    resume notices other data under the same glob without reading whole shards."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
        digest.update(f.read())
    return [os.path.basename(path), size, digest.hexdigest()[:16]]


def data_changes(flag: str, pattern: str, then: list, now: list) -> str:
    """How the shards a checkpoint read (`then`, shard_fingerprint lists) differ from the ones the glob matches
    now; empty if they are the same."""
    if len(then) != len(now):
        gone = sorted({n for n, *_ in then} - {n for n, *_ in now})
        return (f"{flag} {pattern!r} matches {len(now)} shards, and {len(then)} when the checkpoint was written"
                + (f" (missing now: {', '.join(gone[:5])})" if gone else ""))
    for (name, size, digest), (name_now, size_now, digest_now) in zip(then, now):
        if name != name_now:
            return f"{flag} matched {name} at this place when the checkpoint was written, {name_now} now"
        if (size, digest) != (size_now, digest_now):
            what = f"{size:,} bytes then, {size_now:,} now" if size != size_now else "the same size, other content"
            return f"shard {name} ({flag}) is not the one the checkpoint read: {what}"
    return ""


class TrainLoader:
    """Micro-batches of seq_len + 1 tokens built from whole documents in order, each clipped to the step's
    max_doc_len tokens (the record's BOS-aligned batches): the last document of a micro-batch is cut to fill it
    exactly and the next micro-batch starts at the following document. One that would run past a shard's end
    starts over at the next shard's first document (shards cycle). Micro-batch i of a step goes to rank i % world, so a
    step sees the same tokens at any world size."""

    def __init__(self, pattern: str, seq_len: int, max_doc_len: int, rank: int, world: int):
        self.files = find_shards(pattern)
        for f in self.files:  # every shard now, not when the run reaches it an hour in
            load_train_shard(f)
        self.seq_len, self.rank, self.world, self.shard = seq_len, rank, world, None
        self.load_state({"shard": 0, "doc": 0})
        self._next_seq(max_doc_len)  # shards that cannot fill one micro-batch fail here, before the log is created
        self.load_state({"shard": 0, "doc": 0})

    def load_state(self, state: dict):
        if not 0 <= state["shard"] < len(self.files):
            raise UserError(f"the checkpoint's data position is shard {state['shard']}, but --train_files matches "
                            f"{len(self.files)} shards: resume with the shards the run trained on")
        # a position in the shard already in memory (a batch put back, warm-up's restore) is not read again
        if state["shard"] != self.shard:
            self.tokens = load_shard(self.files[state["shard"]])
            self.starts = np.flatnonzero(self.tokens == BOS_ID)
        self.shard, self.doc = state["shard"], state["doc"]

    def state(self) -> dict:
        return {"shard": self.shard, "doc": self.doc}

    def _pieces(self, max_doc_len: int) -> tuple[list, int]:
        """The documents of the micro-batch starting at self.doc, clipped and cut; and the next document."""
        pieces, have, d, need = [], 0, self.doc, self.seq_len + 1
        while have < need and d < len(self.starts):
            start = self.starts[d]
            end = min(self.starts[d + 1] if d + 1 < len(self.starts) else len(self.tokens),
                      start + max_doc_len, start + need - have)
            pieces.append(self.tokens[start:end])
            have, d = have + end - start, d + 1
        return (pieces if have == need else None), d

    def _next_seq(self, max_doc_len: int) -> np.ndarray:
        for _ in range(len(self.files) + 1):
            pieces, after = self._pieces(max_doc_len)
            if pieces is not None:
                self.doc = after
                return np.concatenate(pieces)
            self.load_state({"shard": (self.shard + 1) % len(self.files), "doc": 0})
        if not any(np.any(load_shard(f) == BOS_ID) for f in self.files):
            raise ShardFormatError(f"no shard of {self.files[0]}... holds a document start (<|endoftext|>, "
                                   f"{BOS_ID}): every document must begin with one. {DATA_HINT}")
        raise ShardFormatError(f"no shard of {self.files[0]}... holds --seq_len {self.seq_len} + 1 tokens of "
                               f"documents (from its first <|endoftext|> on): lower --seq_len or use larger shards")

    def next_batch(self, num_seqs: int, max_doc_len: int) -> list:
        seqs = []
        for i in range(num_seqs):
            seq = self._next_seq(max_doc_len)
            if i % self.world == self.rank:
                seqs.append(torch.from_numpy(seq.astype(np.int32)))
        return seqs


def val_files_read(pattern: str, num_tokens: int) -> list:
    """The val shards that hold the first num_tokens (+1, the last target) val tokens, from their headers."""
    files, have = [], 0
    for f in find_shards(pattern, "--val_files"):
        files.append(f)
        have += read_header(f)
        if have >= num_tokens + 1:
            return files
    raise ShardFormatError(f"val shards {pattern!r} hold {have:,} tokens; --val_tokens asks for {num_tokens:,} "
                           f"(+1 for the last target). Lower --val_tokens or add val data.")


def load_val_tokens(pattern: str, num_tokens: int) -> Tensor:
    """The first num_tokens (+1, the last target) tokens of the val shards, in order."""
    tokens, have = [], 0
    for f in val_files_read(pattern, num_tokens):
        tokens.append(load_shard(f)[:num_tokens + 1 - have])
        have += len(tokens[-1])
    return torch.from_numpy(np.concatenate(tokens).astype(np.int32))


# ----------------------------------------------------------------------------------------------------------
# Training: the Trainer that build() sets up, and the named steps main() runs: warm-up, train step, validation

class Stopwatch:
    """Training time in ms; stopped while validating and checkpointing. Synchronizes the GPU at each start and
    stop, so queued work is counted where it runs."""

    def __init__(self, device: torch.device, ms: float = 0.0):
        self.device, self.ms, self.t0 = device, ms, None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start(self):
        self._sync()
        self.t0 = time.perf_counter()

    def stop(self):
        self._sync()
        self.ms += (time.perf_counter() - self.t0) * 1000
        self.t0 = None

    def elapsed_ms(self) -> float:
        return self.ms + (0.0 if self.t0 is None else (time.perf_counter() - self.t0) * 1000)


LEARNING_BY_STEP = 10  # a run whose train loss is no better (by 0.01) than a uniform guess by this step stops


@dataclass
class Trainer:
    cfg: Hyperparameters
    comm: Comm
    device: torch.device
    model: GPT
    opt: ShardedOptimizer
    train_loader: TrainLoader
    val_tokens: Tensor
    run_id: str
    log_path: Path
    clock: Stopwatch
    kernels: KernelSettings
    micro_batch: int = 1          # sequences per forward pass
    step: int = 0                 # optimizer steps done
    last_checkpoint: str = ""     # the newest complete checkpoint of this run
    last_good_checkpoint: str = ""  # the newest written while the run was healthy (see save_checkpoint)
    target_ms: float = None       # training time at the first val at or below the target (None: not yet)
    vals: list = field(default_factory=list)  # (step, val loss) of the run's validations, resumes included
    log_open: bool = False
    profiler: object = None
    fingerprints: dict = None     # of the shards this run reads, once a checkpoint needs them
    window_tensors: dict = field(default_factory=dict)  # (short, long) in tokens -> device tensor
    windows: Tensor = None        # this step's, one of window_tensors
    mtp_host: Tensor = None       # this step's multi-token weights, staged for the device (pinned on CUDA)
    mtp: Tensor = None            # this step's, copied from the table (a fixed tensor: no new graph)
    learning_by_step: float = LEARNING_BY_STEP  # benches that time fresh weights at late steps lift it
    lock: object = None           # this run's lock file (run_lock), held while it lives
    pending_checkpoint: dict = None  # captured, written once its weights' loss is known (save_checkpoint)
    init_max_abs: float = 1.0     # the largest weight at initialization: what a healthy checkpoint's are held to
    started: bool = False         # the timed run has begun (warm-up is over)
    ahead: tuple = None           # (step, data position before it, its passes on the host): read during the step before

    def data(self) -> dict:
        """Fingerprints of the train shards and of the val shards that val_tokens reaches."""
        if self.fingerprints is None:
            cfg = self.cfg
            self.fingerprints = {"train": [shard_fingerprint(f) for f in self.train_loader.files],
                                 "val": [shard_fingerprint(f) for f in
                                         val_files_read(cfg.val_files, len(self.val_tokens) - 1)]}
        return self.fingerprints

    def log(self, line: str):
        if self.comm.rank == 0:
            print(line, flush=True)
            if self.log_open:
                append_line(self.log_path, line, self.last_checkpoint)

    def set_schedule(self, step: int, final_val: bool = False):
        """The step's windows, RoPE stage and multi-token weights, as device data the compiled graphs read."""
        cfg = self.cfg
        self.model.rotary.set_stages(long_window_stages(step, cfg))
        tokens = tuple(w * MASK_BLOCK for w in windows_at(step, cfg, final_val))
        if tokens not in self.window_tensors:
            self.window_tensors[tokens] = torch.tensor(tokens, dtype=torch.int32, device=self.device)
        self.windows = self.window_tensors[tokens]
        weights = loss_weights_at(step, cfg)
        if self.mtp is None:  # fixed tensors: new weights are new data, not a new graph
            self.mtp_host = torch.empty(len(weights), pin_memory=self.device.type == "cuda")
            self.mtp = torch.empty(len(weights), device=self.device)
        # the previous step's copy is done (each step ends in a host sync), so the staging buffer is free
        self.mtp_host.copy_(torch.tensor(weights))
        self.mtp.copy_(self.mtp_host, non_blocking=True)


def write_fix(e: OSError, folder_flag: str = "--log_dir") -> str:
    """What to do about a failed write, by the cause the OS gave: a full disk is not a read-only file system,
    nor a file or folder removed under the run."""
    return {errno.ENOSPC: "free disk space", errno.EDQUOT: "free space within your disk quota",
            errno.EROFS: f"the file system is read-only: make it writable or point {folder_flag} at another",
            errno.ENOENT: "the file or its folder was removed while the run used it: put the folder back",
            errno.EACCES: f"make the folder writable for this user or point {folder_flag} elsewhere",
            errno.EPERM: f"make the folder writable for this user or point {folder_flag} elsewhere",
            }.get(e.errno, f"fix the cause the system gave, or point {folder_flag} elsewhere")


def append_line(path: Path, line: str, newest_checkpoint: str = ""):
    """Append one line to a log, whole or not at all: unbuffered writes, so that a full disk fails the write
    (not a later flush or close), and what a failed write left is cut back off."""
    data = memoryview((line + "\n").encode())
    fd = size = None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        size = os.fstat(fd).st_size
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        if size is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        then = (f"resume from the newest checkpoint, {newest_checkpoint}" if newest_checkpoint else
                "start the run again (no checkpoint was written yet)")
        raise UserError(f"cannot append to the log {path} ({e.strerror or e}): {write_fix(e)}, then {then}") from None
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def setup(cfg: Hyperparameters):
    rank, world, device = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), cfg.device
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if any(n % world for n in cfg.batch_seqs):
        g = math.gcd(*cfg.batch_seqs)
        counts = ", ".join(str(n) for n in range(1, g + 1) if g % n == 0)
        raise UserError(f"{world} processes cannot split batches of {','.join(map(str, cfg.batch_seqs))} "
                        f"micro-batches evenly; launch with --nproc_per_node (x nodes) in {counts}, the common "
                        f"divisors of --batch_seqs")
    if cfg.micro_batch and any(n // world % cfg.micro_batch for n in cfg.batch_seqs):
        per = "/".join(str(n // world) for n in cfg.batch_seqs)
        raise UserError(f"--micro_batch {cfg.micro_batch} does not divide the {per} sequences per process of "
                        f"--batch_seqs {','.join(map(str, cfg.batch_seqs))} over {world} processes: pick a common "
                        f"divisor, or 0 (auto)")
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("no CUDA GPU is visible. train_gpt.py needs one per process; on CPU, run a tiny model "
                            "with --preset smoke or --preset books (README.md, Quick start)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # fp32 matmuls on TF32 tensor cores: DC's scores and their grads are the only ones, and their inputs are
        # bf16 values, which TF32 holds exactly, summed in fp32 (the record's kernel dots in tf32 too)
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    else:
        device = torch.device(cfg.device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return rank, world, device


def micro_batch(cfg: Hyperparameters, world: int) -> int:
    """Sequences per forward pass: --micro_batch, or for 0 the first of AUTO_MICRO_BATCHES that divides every
    stage's sequences per process, else 1 (micro_batch_choice: and that fits a GPU's free memory)."""
    return micro_batch_choice(cfg, world)[0]


# one GPU's peak at the default recipe, measured on an H100 (allocated, not reserved): at 2026-05-20's, 32,070 MiB at
# four 16,384-token sequences per pass (records/2026-12-07_fp8sign-h100) and 19,537 MiB at two
# (records/2026-12-07_cap24-h100): 6,267 MiB a sequence, 7,004 besides; 2026-05-27 v3's 34,031 MiB at four
# (records/2026-12-07_muddgate-dc-h100) adds 1,961 besides (its wider bigram table); the master's port peaked at
# 33,747 (records/2026-12-07_master-h200, an H200). Other settings scale them: a sequence's share by its tokens x
# width x depth, the rest by the parameters
PEAK_SEQ_MIB, PEAK_REST_MIB = 6267, 7004 + 1961
PEAK_MARGIN = 0.9  # of the free memory: the allocator reserves more than it hands out (33.6 GiB for 32.1)


def estimated_peak(cfg: Hyperparameters, per_pass: int) -> float:
    """Bytes of GPU memory a process of these settings peaks at with per_pass sequences a pass: an estimate."""
    ref = Hyperparameters()
    seq = PEAK_SEQ_MIB * (cfg.seq_len * cfg.model_dim * cfg.num_layers) / (ref.seq_len * ref.model_dim * ref.num_layers)
    rest = PEAK_REST_MIB * sum(parameter_counts(cfg)) / sum(parameter_counts(ref))
    return (rest + per_pass * seq) * 2**20


def micro_batch_choice(cfg: Hyperparameters, world: int, free: float = None) -> tuple[int, str]:
    """(sequences per pass, why auto chose it, as a log note, or ''): --micro_batch, or for 0 the largest of
    AUTO_MICRO_BATCHES and 1 that divides every stage's sequences per process and, given the GPU's free bytes,
    whose estimated peak fits them (PEAK_MARGIN); the smallest that divides if none does."""
    if cfg.micro_batch:
        return cfg.micro_batch, ""
    divides = [b for b in (*AUTO_MICRO_BATCHES, 1) if all(n // world % b == 0 for n in cfg.batch_seqs)]
    if free is None:
        return divides[0], ""
    gib = lambda b: f"{estimated_peak(cfg, b) / 2**30:.1f}GiB"
    fits = [b for b in divides if estimated_peak(cfg, b) <= PEAK_MARGIN * free]
    chosen = fits[0] if fits else divides[-1]
    bigger = [b for b in divides if b > chosen]
    why = (f"peak_near_{gib(chosen)}_(an_estimate)_of_{free / 2**30:.1f}GiB_free" if fits else
           f"even_{chosen}_a_pass_may_not_fit:_near_{gib(chosen)}_(an_estimate)_of_{free / 2**30:.1f}GiB_free")
    if bigger:
        why += f";_{bigger[-1]}_a_pass_would_peak_near_{gib(bigger[-1])}"
    return chosen, log_line(note="micro_batch_auto", chose=chosen, why=why)


def gpu_free_bytes(device: torch.device) -> float:
    """What this process may still allocate on the GPU: its free memory, under the cap a
    torch.cuda.set_per_process_memory_fraction put on this process (a 24 GiB card played on a larger one)."""
    free, total = torch.cuda.mem_get_info(device)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    cap = get_fraction(device) * total if get_fraction else total
    return min(free, cap - torch.cuda.memory_reserved(device))


STATE_BYTES = 20  # per parameter beside itself: its share of the flat fp32 copy and grad, two fp32 states, a sum


def parameter_counts(cfg: Hyperparameters) -> tuple[int, int]:
    """(bf16, fp32) parameter counts of the model these settings build, from its shapes: the tables, lm_head and
    gates in bf16; the matrices and scalars in fp32 (a test checks it against GPT built on the meta device,
    which would cost a second of imports at every launch)."""
    V, d, L, heads = cfg.vocab_size, cfg.model_dim, cfg.num_layers, cfg.num_heads
    attn = [i for i in range(L) if i not in cfg.no_attn_layers]
    ve_gates = [i for i in attn if own_ve_gate(cfg, i)]
    mudd = (2 * MUDD_HIDDEN * d + 2 * MUDD_HIDDEN * 2 * MUDD_COLS + 2 * 2 * MUDD_COLS) if cfg.mudd else 0
    if cfg.mudd_gate:  # the gate's MLPs (their output rows as many as the wider one's coefficients) and scale
        rows = max(sum(w for *_, w in part) for part in gate_layout(cfg))
        gates = 2 * GATE_HIDDEN * d + 2 * rows * (GATE_HIDDEN + 1) + len(ve_gates) * heads * GATE_DIMS + GATE_DIMS
        stream, constants = 6 * L, 1
    else:  # output gates on every attention, the skip's gate, x0's and the bigram's shares, XSA's
        gates = (len(attn) + len(ve_gates)) * heads * GATE_DIMS + 2 * GATE_DIMS
        stream = (8 if cfg.bigram_vocab else 7) * L
        constants = sum(has_xsa(cfg, i) for i in attn) * heads
    bf16 = (2 + max(cfg.value_embeds) + 1) * V * d + cfg.bigram_vocab * bigram_width(cfg) + gates + mudd
    fp32 = L * 8 * d * d + len(attn) * 4 * d * d + stream + (2 if cfg.mudd else 3) + constants
    return bf16, fp32


def check_memory(cfg: Hyperparameters, device: torch.device):
    """Refuse settings whose parameters and optimizer state alone do not fit the memory free now, before any
    of it is allocated (a 10^9-row vocab would otherwise end in the allocator's traceback)."""
    bf16, fp32 = parameter_counts(cfg)
    need = bf16 * (2 + STATE_BYTES) + fp32 * (4 + STATE_BYTES)
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"GPU {device.index}"
    else:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:  # not Linux: the allocator's own error will have to do
            return
        free, where = int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1)) * 1024, "this machine"
    if need > free:
        raise UserError(f"the parameters and optimizer state of these settings need {need / 2**30:,.1f} GiB, and "
                        f"{where} has {free / 2**30:,.1f} GiB free: lower --vocab_size, --bigram_vocab, --model_dim "
                        f"or --num_layers")


def load_data(cfg: Hyperparameters, rank: int, world: int) -> tuple[TrainLoader, Tensor]:
    """The train loader (every shard checked) and the val tokens; a train shard that is a val shard the run
    scores, by path or by content (a copy), is refused."""
    train_loader = TrainLoader(cfg.train_files, cfg.seq_len, min(cfg.max_doc_len), rank, world)
    val_tokens = load_val_tokens(cfg.val_files, cfg.val_tokens)
    val_files = val_files_read(cfg.val_files, cfg.val_tokens)
    overlap = sorted(set(map(os.path.realpath, train_loader.files)) & set(map(os.path.realpath, val_files)))
    if overlap:
        raise UserError(f"--train_files also matches {overlap[0]}, a shard --val_files scores: the run would train "
                        f"on its validation data. Make the train glob match only training shards")
    val_content = {tuple(shard_fingerprint(f)[1:]): f for f in val_files}
    for f in train_loader.files:
        twin = val_content.get(tuple(shard_fingerprint(f)[1:]))
        if twin:
            raise UserError(f"train shard {f} holds the same bytes as the val shard {twin} (size and the hash of "
                            f"its first and last MiB): the run would train on its validation data. Use training "
                            f"shards that are not copies of the val shards")
    return train_loader, val_tokens


def build(cfg: Hyperparameters) -> Trainer:
    """Everything that can fail on the user's input, before the log is created: flags, launch, checkpoint, log
    folder, data."""
    saved = saved_config(cfg.resume) if cfg.resume else None
    if saved:  # another version's checkpoint, before its settings meet this version's checks
        version_check(cfg.resume, *saved)
    check_config(cfg)
    rank, world, device = setup(cfg)
    comm = Comm(rank, world, device)
    notes, kernels = [], KernelSettings()
    fp8 = [name for name in ("fp8_head", "fp8_mlp", "fp8_down") if getattr(cfg, name)]
    if fp8 and device.type == "cuda" and not has_fp8_tensor_cores(torch.cuda.get_device_capability(device)):
        cfg = dataclasses.replace(cfg, **{name: False for name in fp8})  # emulated FP8 would be slower than bf16
        notes.append(log_line(note=",".join(f"{name}_off" for name in fp8),
                              why=f"{torch.cuda.get_device_name(device).replace(' ', '_')}_has_no_FP8_tensor_cores"))
    if cfg.profile_steps and device.type != "cuda":  # it times GPU kernels by category
        notes.append(log_line(note="profile_steps_ignored", why="the_profile_times_GPU_kernels:_it_needs_CUDA"))
    if device.type == "cuda":
        smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        capability = tuple(torch.cuda.get_device_capability(device))
        kernels.flex_options = choose_flex_tiles(cfg.flex_tiles, smem, capability)
        if kernels.flex_options == FLEX_SMALL_TILES and cfg.flex_tiles == "auto":
            notes.append(log_line(note="flex_small_tiles", why=f"{smem // 1024}KiB_shared_memory_per_block"))
        if cfg.mlp_kernel and capability == HOPPER and TensorDescriptor:
            kernels.mlp_tiles = MLP_HOPPER_TILES
        if cfg.attn_kernel and capability == HOPPER:
            kernels.attn_tiles = ATTN_HOPPER_TILES
    if cfg.eval_hellaswag:  # a missing file or tokenizer now, not after an hour of training
        hellaswag_items(cfg.eval_hellaswag)
        gpt2_encoding()
    ckpt = read_checkpoint(cfg, comm) if cfg.resume else None
    # a resumed run keeps its run_id, and so its log, unless told otherwise
    run_id = cfg.run_id or (ckpt or {}).get("run_id") or str(uuid.uuid4())
    log_path = Path(cfg.log_dir) / f"{run_id}.txt"
    lock = check_log_dir(cfg, log_path, comm, ckpt)
    try:  # a failure from here on drops the lock
        train_loader, val_tokens = load_data(cfg, rank, world)
        check_memory(cfg, device)
        per_pass, why = micro_batch_choice(cfg, world, gpu_free_bytes(device) if device.type == "cuda" else None)
        notes += [why] if why else []
        torch.manual_seed(cfg.seed)
        model = GPT(cfg, kernels).to(device)
        init_max_abs = max(p.detach().abs().max().item() for p in model.parameters())
        opt = ShardedOptimizer(*param_groups(model), cfg, comm)
        model.grad_sinks = opt.row_sinks([t.weight for t in model.tables()])
        model.use_weight_copies(opt.weight_copies(torch.bfloat16))
        trainer = Trainer(cfg, comm, device, model, opt, train_loader, val_tokens, run_id, log_path,
                          Stopwatch(device), kernels, micro_batch=per_pass, lock=lock, init_max_abs=init_max_abs)
        if ckpt is not None:
            notes += restore(trainer, ckpt)
        if cfg.compile and device.type == "cuda":
            model.compile_regions(whole=cfg.compile_scope == "model" or (cfg.compile_scope == "auto" and world == 1))
        open_log(trainer, ckpt)
    except BaseException:
        release_lock(lock)
        raise
    for note in notes:
        trainer.log(note)
    return trainer


def diverged(trainer: Trainer, what: str) -> UserError:
    """The error that stops a diverged run: what went wrong and where, and the checkpoint to go back to."""
    rates = f"--{', --'.join(RESUME_ADJUSTABLE)}"
    if not trainer.last_good_checkpoint:
        return UserError(f"{what}: the run diverged, and no healthy checkpoint was written. Start again with lower "
                         f"learning rates ({rates})")
    return UserError(f"{what}: the run diverged. Newest good checkpoint: {trainer.last_good_checkpoint}. Resume "
                     f"from it with lower learning rates ({rates} may change on resume), or start again with lower "
                     f"ones")


def train_step(trainer: Trainer, step: int) -> float:
    """One optimizer step over this step's micro-batches (this rank's share); returns the mean next-token train
    loss. Stops the run at the first non-finite loss or parameter, and at a loss that is still no better than
    guessing uniformly after LEARNING_BY_STEP steps: weights blown up by a huge learning rate can keep a
    finite, soft-capped loss forever (the recipe's runs are below that loss from step 2)."""
    cfg = trainer.cfg
    trainer.set_schedule(step)
    trainer.opt.adam_now = is_adam_step(step)
    loss = torch.zeros((), device=trainer.device)
    passes = batch_for(trainer, step)
    for i, host in enumerate(passes):
        seq = host.to(trainer.device, non_blocking=True)
        trainer.opt.reduce_in_backward = i == len(passes) - 1  # the last micro-step's grads are final: reduce them now
        mtp_loss, next_token_loss = trainer.model(seq[:, :-1], seq[:, 1:], trainer.windows, trainer.mtp)
        mtp_loss.backward()
        loss += next_token_loss.detach()
    trainer.opt.step(lr_factor(step, cfg), muon_momentum(step, cfg))
    if trainer.model.fp8_down_scales is not None:
        trainer.model.step_fp8_down(step, trainer.comm)
    if step == split_step(cfg) and trainer.opt.tied:
        trainer.opt.untie()
    if step + 1 < cfg.num_steps:
        read_ahead(trainer, step + 1)
    stats = torch.stack([loss, trainer.opt.all_finite().float()])
    if trainer.comm.world > 1:
        dist.all_reduce(stats)
    loss_sum, finite = stats.tolist()  # the step's one host sync
    train_loss, trainer.step = loss_sum / (batch_seqs_at(step, cfg) * cfg.seq_len), step + 1
    if trainer.pending_checkpoint is not None:  # this loss is that of the checkpoint's weights: now it is judged
        trainer.clock.stop()
        write_checkpoint(trainer, healthy(trainer, trainer.pending_checkpoint, train_loss))
        trainer.clock.start()
    if not math.isfinite(train_loss) or finite < trainer.comm.world:
        what = "the parameters" if math.isfinite(train_loss) else f"the train loss ({train_loss})"
        raise diverged(trainer, f"{what} became non-finite at step {trainer.step}")
    uniform = math.log(cfg.vocab_size)
    if trainer.step >= trainer.learning_by_step and train_loss > uniform - 0.01:
        raise not_learning(trainer, f"the train loss at step {trainer.step}, {train_loss:.4f}, is no better than "
                                    f"guessing uniformly among {cfg.vocab_size:,} tokens (ln {cfg.vocab_size} = "
                                    f"{uniform:.4f})")
    return train_loss


def not_learning(trainer: Trainer, what: str) -> UserError:
    """The error for a loss that stayed at a uniform guess's: a divergence if the weights grew past
    HEALTHY_GROWTH times their largest at initialization (a huge learning rate), else a run that is not
    learning: learning rates of 0, or far below the record's, or data or settings that cannot train."""
    cfg, record = trainer.cfg, Hyperparameters()
    if blew_up(trainer.model.parameters(), trainer.init_max_abs):
        return diverged(trainer, what)
    rates = f"--muon_lr {cfg.muon_lr:g} --adam_lr {cfg.adam_lr:g}; the record's: {record.muon_lr} and {record.adam_lr}"
    if cfg.muon_lr == 0 and cfg.adam_lr == 0:
        return UserError(f"{what}, and no wonder: the learning rates are 0 ({rates}), so nothing trains. Set them "
                         f"above 0")
    if cfg.muon_lr < record.muon_lr / 100 and cfg.adam_lr < record.adam_lr / 100:
        return UserError(f"{what}, while its weights stayed in range: the run is not learning, not diverging. Its "
                         f"learning rates are too low to move it ({rates}): raise them")
    return UserError(f"{what}, while its weights stayed in range: the run is not learning, not diverging. Check "
                     f"that the shards hold text (python data/check.py FILES) and the settings (--help)")


def host_passes(trainer: Trainer, step: int) -> list:
    """step's batch (this rank's share) read from the loader, as its forward passes' inputs on the host: each
    pass's sequences stacked and, on CUDA, pinned, so that the copy to the GPU is only queued (from pageable
    memory it may wait for the stream to reach it: CUDA's API synchronization rules)."""
    cfg, B = trainer.cfg, trainer.micro_batch
    seqs = trainer.train_loader.next_batch(batch_seqs_at(step, cfg), max_doc_len_at(step, cfg))
    passes = [torch.stack(seqs[i:i + B]) for i in range(0, len(seqs), B)]
    return [p.pin_memory() for p in passes] if trainer.device.type == "cuda" else passes


def read_ahead(trainer: Trainer, step: int):
    """Make step's passes now, before the step before it syncs: the host's data work (documents walked, clipped
    and cut, records/bench/loaderbench.py; stacked, pinned) then runs while the GPU still has that step's work,
    not after the sync with the GPU idle (a gap growing with the batch in records/2026-12-06_launches-h100)."""
    trainer.ahead = (step, trainer.train_loader.state(), host_passes(trainer, step))


def batch_for(trainer: Trainer, step: int) -> list:
    """This step's passes on the host: the ones read ahead for it, or read now. A batch read ahead for another
    step (a bench that jumps to a later stage) is put back first."""
    ahead, trainer.ahead = trainer.ahead, None
    if ahead is not None and ahead[0] == step:
        return ahead[2]
    if ahead is not None:
        trainer.train_loader.load_state(ahead[1])
    return host_passes(trainer, step)


def data_position(trainer: Trainer) -> dict:
    """Where the next step's data starts: before any batch read ahead, which no step has trained on yet."""
    return trainer.ahead[1] if trainer.ahead is not None else trainer.train_loader.state()


def tokens_before(step: int, cfg: Hyperparameters) -> int:
    """Training tokens in the steps before `step`, stage by stage (not step by step: a run of 10^8 steps must not
    take a minute to log a line)."""
    n = len(cfg.batch_seqs)
    starts = stage_starts(n, cfg) + [math.inf]
    seqs = sum(max(0, min(step, starts[k + 1] if k < n - 1 else math.inf) - starts[k]) * cfg.batch_seqs[k]
               for k in range(n))
    return int(seqs) * cfg.seq_len


def log_train(trainer: Trainer, train_loss: float):
    ms, n = trainer.clock.elapsed_ms(), trainer.cfg.num_steps
    done, total = tokens_before(trainer.step, trainer.cfg), tokens_before(n, trainer.cfg)
    trainer.log(log_line(step=f"{trainer.step}/{n}", train_loss=f"{train_loss:.4f}", train_time=f"{ms:.0f}ms",
                   step_avg=f"{ms / trainer.step:.2f}ms", eta=f"{ms / done * (total - done) / 1000:.0f}s"))


@torch.no_grad()
def validate(trainer: Trainer, step: int) -> bool:
    """Mean loss over the first val_tokens val tokens, in val_seq_len sequences split over the ranks, with the
    bf16 head and the step's windows (the last validation: the widest), as the record measures it. Logs it;
    returns whether it is at or below the target."""
    cfg = trainer.cfg
    trainer.clock.stop()
    trainer.model.eval()
    trainer.set_schedule(step, final_val=step == cfg.num_steps)
    total = torch.zeros(2, device=trainer.device)
    for i in range(trainer.comm.rank, len(trainer.val_tokens) // cfg.val_seq_len, trainer.comm.world):
        seq = trainer.val_tokens[i * cfg.val_seq_len:(i + 1) * cfg.val_seq_len + 1].to(trainer.device)
        total[0] += trainer.model(seq[:-1], seq[1:], trainer.windows)[0]
        total[1] += cfg.val_seq_len
    if trainer.comm.world > 1:
        dist.all_reduce(total)
    trainer.model.train()
    val_loss = (total[0] / total[1]).item()
    trainer.log(log_line(step=f"{step}/{cfg.num_steps}", val_loss=f"{val_loss:.4f}",
                         train_time=f"{trainer.clock.ms:.0f}ms",
                   step_avg=f"{trainer.clock.ms / max(step, 1):.2f}ms"))
    if not math.isfinite(val_loss):
        raise diverged(trainer, f"val loss is {val_loss} at step {step}")
    trainer.vals.append((step, val_loss))
    reached = val_loss <= cfg.target_val_loss
    if reached and trainer.target_ms is None:
        trainer.target_ms = trainer.clock.ms
        trainer.log(log_line(reached_target=cfg.target_val_loss, at_step=step, train_time=f"{trainer.clock.ms:.0f}ms"))
    trainer.clock.start()
    return reached


def model_on_host(model: nn.Module) -> dict:
    """The model's state_dict copied to host memory: the next step updates the weights in place."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


@dataclass
class Snapshot:
    """What warm-up's steps change, to be put back before the timed run: what a checkpoint holds of the model and
    the optimizer (this rank's part of its state), in host memory. On the GPU the weights, optimizer states
    and pending grads sat above the training's own peak (records/2026-12-06_peak-h100)."""
    model: dict
    optimizer: dict
    loader: dict
    step: int


def warm_up(trainer: Trainer):
    """Compile and autotune on real batches, then put everything back: the timed run starts clean."""
    cfg = trainer.cfg
    if not cfg.warmup_steps:
        return
    saved = Snapshot(model_on_host(trainer.model), trainer.opt.local_state(), data_position(trainer), trainer.step)
    start = time.perf_counter()
    rehearsal = KernelRehearsal(trainer) if trainer.device.type == "cuda" and cfg.compile else None
    for i in range(cfg.warmup_steps):
        train_step(trainer, min(saved.step + i, cfg.num_steps - 1))
        trainer.log(log_line(warmup_step=f"{i + 1}/{cfg.warmup_steps}", time=f"{time.perf_counter() - start:.0f}s"))
    if rehearsal is not None:
        rehearsal.finish()
    trainer.model.load_state_dict(saved.model)
    trainer.opt.zero_grads()  # before the snapshot's pending grads go back
    trainer.opt.load_local_state(saved.optimizer)
    trainer.step, trainer.ahead = saved.step, None
    trainer.train_loader.load_state(saved.loader)
    trainer.log(log_line(warmup_steps=cfg.warmup_steps, warmup_time=f"{(time.perf_counter() - start) * 1000:.0f}ms"))


# GPU kernels by name, first match wins: where a step's time goes (--profile_steps). cuBLAS names its FP8
# GEMMs nvjet_sm90_q*; torch's copy kernels (float8_copy_kernel_cuda, ...) are copies, not FP8 GEMMs.
# a compiled kernel named for a masked_fill it fused is compiled glue, not a fill
KERNEL_CATEGORIES = [("copies and fills", r"^(?!triton_).*([Mm]emcpy|[Mm]emset|copy_kernel|[Ff]ill)"),
                     ("softcap CE + fp8 transposes", r"_softcap_ce|_transpose_bytes"),
                     ("QK-norm + rotary", r"_qk_norm_rotary"), ("ReLU^2 GEMM (fused)", r"_relu_square_mm"),
                     ("DC (dc_mix)", r"^_dc_"),
                     ("FlexAttention", r"flex|triton_tem"), ("attention (window_attention)", r"^_attn_"),
                     ("FP8 GEMM", r"nvjet_sm90_q|e4m3|e5m2"), ("bf16 GEMM", r"gemm|xmma|cutlass|nvjet|cublas"),
                     ("NCCL", r"nccl"), ("Triton fused (compiled)", r"triton"), ("other", r"")]


def kernel_category(kernel: str) -> str:
    return next(name for name, rule in KERNEL_CATEGORIES if re.search(rule, kernel))


PROFILE_KERNELS = 100  # listed by name: the compiled glue is many small kernels
COSTLIEST = "costliest kernels (ms per step, launches per step):"  # the list's heading, read back by gluebw
# idle GPU between kernels, by the gap's length: under 10 us the launch latency of a GPU the host keeps fed;
# longer, the host fell behind or waited (a sync, a pageable copy, the step's end)
GAP_BOUNDS_US = (10, 100, 1000)
PROFILE_GAPS = 8  # the longest gaps listed, with the kernels on either side


def idle_gaps(spans: list) -> list:
    """The idle stretches of a GPU between (start_us, end_us, name) spans of its kernels and copies, streams
    merged: (length_us, the name before, the name after) for each stretch no span covers."""
    spans = sorted(spans)
    gaps, (_, end, before) = [], spans[0]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, before, name))
        if stop > end:
            end, before = stop, name
    return gaps


def gap_lines(gaps: list, steps: int) -> list:
    """The profile's account of idle time per step: by GAP_BOUNDS_US, then the PROFILE_GAPS longest gaps."""
    edges = (0, *GAP_BOUNDS_US, math.inf)
    lines = [f"idle between kernels, per step: {sum(g for g, _, _ in gaps) / 1000 / steps:.2f} ms in "
             f"{len(gaps) / steps:.0f} gaps"]
    for lo, hi in zip(edges, edges[1:]):
        inside = [g for g, _, _ in gaps if lo <= g < hi]
        lines.append(f"  gaps of {lo}-{hi} us: {len(inside) / steps:7.1f} per step, "
                     f"{sum(inside) / 1000 / steps:7.2f} ms")
    lines.append(f"  the {PROFILE_GAPS} longest (us, kernel before -> kernel after):")
    lines += [f"  {g:9.0f}  {a[:60]} -> {b[:60]}" for g, a, b in sorted(gaps, reverse=True)[:PROFILE_GAPS]]
    return lines


@contextlib.contextmanager
def profiled(trainer: Trainer, step: int):
    """Under --profile_steps A,B: torch.profiler from train step A through B, then a table of GPU time per
    kernel category and the PROFILE_KERNELS costliest kernels, per step, in <log_dir>/<run_id>_profile.txt."""
    first, last = trainer.cfg.profile_steps or (-1, -1)
    if step == first and trainer.device.type == "cuda":
        trainer.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        trainer.profiler.__enter__()
        trainer.profiler.clock_ms = trainer.clock.elapsed_ms()  # the clock synchronized when it last started
    yield
    if step == last and trainer.profiler is not None:
        trainer.clock.stop()  # summarizing takes seconds: not training time
        trainer.profiler.__exit__(None, None, None)
        steps = last - first + 1
        wall = (trainer.clock.ms - trainer.profiler.clock_ms) / steps
        kernels = [(e.key, e.self_device_time_total / 1000 / steps, e.count / steps)
                   for e in trainer.profiler.key_averages() if e.self_device_time_total > 0]
        busy = sum(ms for _, ms, _ in kernels)
        by_category = {name: 0.0 for name, _ in KERNEL_CATEGORIES}
        for key, ms, _ in kernels:
            by_category[kernel_category(key)] += ms
        lines = [f"GPU time per train step, steps {first}..{last} (rank {trainer.comm.rank}): {busy:.1f} ms of "
                 f"kernels in "
                 f"{wall:.1f} ms of training time per step ({busy / wall:.0%} busy; the profiler itself slows the "
                 f"host); step_avg so far {trainer.clock.ms / max(trainer.step, 1):.1f} ms"]
        lines += [f"{name:<26} {ms:9.2f} ms" for name, ms in by_category.items()]
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in trainer.profiler.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
        lines += ([""] + gap_lines(idle_gaps(spans), steps)) if spans else []
        lines += [""] + costliest_kernels(kernels)
        if trainer.comm.rank == 0:
            path = Path(trainer.cfg.log_dir) / f"{trainer.run_id}_profile.txt"
            path.write_text("\n".join(lines) + "\n")
            trainer.log(log_line(profile=path))
        trainer.profiler = None
        trainer.clock.start()


def costliest_kernels(kernels: list) -> list[str]:
    """A profile's lines for the PROFILE_KERNELS costliest of kernels [(name, ms per step, launches per step)]:
    a kernel's time over its launches is its time per launch, what records/bench/gluebw.py sets beside the same
    kernel timed alone."""
    costliest = sorted(kernels, key=lambda k: -k[1])[:PROFILE_KERNELS]
    return [COSTLIEST] + [f"{ms:9.2f} {n:8.1f}  {key[:150]}" for key, ms, n in costliest]


# ----------------------------------------------------------------------------------------------------------
# Logs and checkpoints: a log is only ever appended to; a checkpoint is written whole or not at all

def log_line(**fields) -> str:
    """The one log format: `key:value` pairs, read back by regex (records/tool.py)."""
    return " ".join(f"{k}:{v}" for k, v in fields.items())


SOURCE_END = "=" * 100  # the line that ends the copy of this script at the top of every log


def start_log(path: Path, script: str) -> Path:
    """A log starts with the script's source and the environment, each closed by SOURCE_END. The header is
    written to a file of its own and linked into place, which fails if the log exists: a disk too full for the
    header leaves no empty log behind, and of two launches with one run_id only one gets the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    header = f"{Path(script).read_text()}\n{SOURCE_END}\n{environment()}\n{SOURCE_END}\n"
    try:
        tmp.write_text(header)
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            with open(path, "x") as f:  # a file system without hard links: exclusive, if not atomic
                f.write(header)
    except FileExistsError:
        raise UserError(f"{path} exists: another launch with this --run_id took it first; pass another "
                        f"--run_id") from None
    except OSError as e:
        raise UserError(f"cannot write the log {path} ({e.strerror or e}): {write_fix(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def cpu_name() -> str:
    """The host's CPU model (Linux names it in /proc/cpuinfo; elsewhere what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment() -> str:
    # the host CPU too: compiling happens there, and one code's cold warm-up took 48.5 to 78.7 s on fresh H100
    # machines (records/2026-12-06_full-main-h100)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [f"python {platform.python_version()}", f"torch {torch.__version__}", f"numpy {np.__version__}",
             f"cuda {torch.version.cuda}", f"cpu {cpu_name()}, {cores} cores"]
    try:
        import triton
        lines.append(f"triton {triton.__version__}")
    except ImportError:
        lines.append("triton not installed")
    try:
        lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.TimeoutExpired):
        lines.append("nvidia-smi: not available")
    return "\n".join(lines)


def source_sha256() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def config_diff(saved: dict, now: dict) -> dict:
    """Settings that differ between a checkpoint's config and this run's: {name: (saved, now)}."""
    saved, now = (json.loads(json.dumps(c)) for c in (saved, now))  # tuples and lists compare alike
    saved = per_part_lists(saved)
    return {k: (saved.get(k), now.get(k)) for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)}


def write_durably(obj, path: Path):
    """torch.save to a .tmp file of this writer's own, fsync, rename over path, fsync the folder: after a crash
    or power loss the checkpoint is either complete or absent, never half-written, and an older one is never
    touched."""
    tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# what a checkpoint holds, with each value's type ("data": the fingerprints of the shards the run reads;
# "content_sha256": a hash of every tensor's bytes, which torch's zip reader does not check)
CHECKPOINT_KEYS = {"model": dict, "optimizer": dict, "loader": dict, "step": int, "train_ms": (int, float),
                   "config": dict, "source_sha256": str, "run_id": str, "data": dict, "healthy": bool,
                   "content_sha256": str}


def content_digest(*objs) -> str:
    """sha256 of every tensor's bytes in nested dicts and lists, in a fixed order: written with a checkpoint and
    checked when it is read, so a flipped byte is found before it trains."""
    digest = hashlib.sha256()

    def walk(o):
        if isinstance(o, Tensor):
            digest.update(str((tuple(o.shape), o.dtype)).encode())
            digest.update(o.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                digest.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            digest.update(repr(o).encode())

    for o in objs:
        walk(o)
    return digest.hexdigest()


def checkpoint_problem(ckpt) -> str:
    """Why an unpickled object is not a checkpoint train_gpt.py can use, or '': its keys and their types, sane
    fields (a step and a data position not below 0, a finite time), finite tensors, and its content hash."""
    if not isinstance(ckpt, dict) or not CHECKPOINT_KEYS.keys() <= ckpt.keys():
        return "not a checkpoint written by train_gpt.py"
    wrong = [f"{k} is a {type(ckpt[k]).__name__}" for k, kind in CHECKPOINT_KEYS.items()
             if not isinstance(ckpt[k], kind)]
    loader = ckpt["loader"]
    if not wrong and not all(isinstance(loader.get(k), int) and loader[k] >= 0 for k in ("shard", "doc")):
        wrong = ["its data position is not two integers of 0 or more"]
    if not wrong and (ckpt["step"] < 0 or not 0 <= ckpt["train_ms"] < math.inf):
        wrong = [f"step {ckpt['step']} and train_ms {ckpt['train_ms']}: the step and time must be 0 or more"]
    if wrong:
        return f"not a checkpoint written by train_gpt.py ({'; '.join(wrong)})"
    if content_digest(ckpt["model"], ckpt["optimizer"]) != ckpt["content_sha256"]:
        return "its tensors' bytes do not match the hash written with them: the file is corrupt"
    bad = [name for name, t in ckpt["model"].items() if isinstance(t, Tensor) and not torch.isfinite(t).all()]
    if bad:
        return f"its weights are not finite ({', '.join(bad[:3])}{'...' if len(bad) > 3 else ''})"
    return ""


def set_aside_later_checkpoints(folder: Path, run_id: str, step: int) -> list:
    """A run resumed from step k in its own folder starts a new lineage: its checkpoints after k (the abandoned
    future) are renamed .abandoned.pt, so that pruning and the newest checkpoint follow the live lineage.
    Returns their steps."""
    later = sorted(s for s in checkpoint_files(folder, run_id) if s > step)
    for s in later:
        old = folder / f"{run_id}_step{s:06d}.pt"
        new, n = folder / f"{run_id}_step{s:06d}.abandoned.pt", 1
        while new.exists():
            new, n = folder / f"{run_id}_step{s:06d}.abandoned{n}.pt", n + 1
        os.replace(old, new)
    return later


def checkpoint_files(folder: Path, run_id: str) -> dict:
    """{step: path} of this run's checkpoints in folder, matched by exact name (a run_id is not a pattern)."""
    name = re.compile(re.escape(run_id) + r"_step(\d{6})\.pt")
    return {int(m.group(1)): folder / f for f in os.listdir(folder) if (m := name.fullmatch(f))}


def is_own_tmp(name: str, run_id: str) -> bool:
    """A .tmp file left by a checkpoint write of this run_id that a crash interrupted."""
    return re.fullmatch(re.escape(run_id) + r"_step\d{6}(\.[0-9a-f]{8})?\.tmp", name) is not None


def first_lines(e: Exception, n: int = 2) -> str:
    """An exception's first n non-empty lines as one ("Error(s) in loading state_dict for GPT:" says nothing
    without the next)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:n])[:300]


def load_checkpoint(path: str) -> tuple[dict, str]:
    """(checkpoint, '') or (None, why it is not one train_gpt.py can use): the one way a checkpoint is read,
    weights only (a checkpoint never runs code)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None, "no such file"
    except pickle.UnpicklingError:  # objects a checkpoint never holds, refused unread
        return None, "not a checkpoint of this trainer: it holds objects other than tensors and plain data"
    except Exception as e:  # a truncated or foreign file
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'unreadable'}"
    problem = checkpoint_problem(ckpt)
    return (None, problem) if problem else (ckpt, "")


def version_check(path: str, config: dict, sha: str):
    """Refuse a checkpoint of another version of train_gpt.py: its config has settings this one does not know,
    or lacks settings of this one that a resume may not change (their defaults would build another model)."""
    fields = {f.name for f in dataclasses.fields(Hyperparameters)}
    unknown = sorted(config.keys() - fields)
    missing = sorted(fields - config.keys() - set(RESUME_FREE + RESUME_ADJUSTABLE))
    if unknown or missing:
        what = (f"settings this one does not know: {', '.join(unknown)}" if unknown else
                f"none of this one's settings {', '.join(missing)}")
        raise UserError(f"checkpoint {path} was written by another version of train_gpt.py, with {what}. Resume it "
                        f"with the version that wrote it (its source sha256 starts {sha[:16]}; its log holds that "
                        f"source: python records/tool.py source LOG -o old_train_gpt.py)")


def read_checkpoint(cfg: Hyperparameters, comm: Comm) -> dict:
    """The checkpoint --resume names, read by every rank, all of them succeeding; its settings must equal this
    run's but for RESUME_FREE and RESUME_ADJUSTABLE (another version's, build() has refused: version_check)."""
    path = cfg.resume
    ckpt, problem = load_checkpoint(path)
    if not comm.all_ok(not problem):
        raise UserError(f"cannot read checkpoint {path}: {problem or 'another rank could not read it'}. Pass a "
                        f"complete checkpoint of train_gpt.py, at a path every rank can read (with several "
                        f"nodes: a shared file system, or a copy at the same path on each node)")
    diff = {k: v for k, v in config_diff(ckpt["config"], dataclasses.asdict(cfg)).items()
            if k not in RESUME_FREE + RESUME_ADJUSTABLE}
    if diff:
        listed = "; ".join(f"{k}: {old!r} in the checkpoint, {new!r} now" for k, (old, new) in diff.items())
        raise UserError(f"checkpoint {path} belongs to another run: {listed}. A resume keeps its run's settings: "
                        f"leave out --{', --'.join(diff)} (only {', '.join(RESUME_FREE + RESUME_ADJUSTABLE)} may "
                        f"change)")
    if 0 < cfg.stop_at <= ckpt["step"]:
        raise UserError(f"--stop_at {cfg.stop_at} is not after checkpoint {path}'s step {ckpt['step']}: name a later "
                        f"step, or leave it out to train to the end")
    if ckpt["step"] >= cfg.num_steps:
        raise UserError(f"checkpoint {path} is at step {ckpt['step']}, the run's last (--num_steps "
                        f"{cfg.num_steps}): there is nothing left to train")
    return ckpt


def log_owner(log_path: Path):
    """(run_id, config) from a log's config line, or None if it has none."""
    for line in log_path.read_text(errors="replace").split(f"\n{SOURCE_END}\n")[-1].splitlines():
        if m := re.match(r"config:(\S+) .*\brun_id:(\S+)", line):
            return m.group(2), json.loads(m.group(1))
    return None


def check_log_dir(cfg: Hyperparameters, log_path: Path, comm: Comm, ckpt):
    """Rank 0 writes the log: refuse a folder it cannot write, a run_id another live process holds (returns
    that lock, held while this run lives), a log that exists (logs are only appended: a new run must not
    overwrite an old one's), and, on resume, a log that belongs to another run."""
    problem, lock = "", None
    if comm.rank == 0:
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path.parent / f".{log_path.stem}.probe", "w"):
                pass
            (log_path.parent / f".{log_path.stem}.probe").unlink()
        except OSError as e:
            problem = f"cannot write to --log_dir {cfg.log_dir!r} ({e.strerror or e}); pick a writable folder"
        if not problem:
            lock, problem = run_lock(log_path)
        if not problem and log_path.exists() and not cfg.resume:
            problem = (f"{log_path} exists: pass another --run_id, or --resume one of its checkpoints to "
                       f"continue it")
        elif not problem and log_path.exists():
            problem = resume_log_problem(log_path, ckpt, cfg.resume)
    if not comm.all_ok(not problem):
        release_lock(lock)  # a refused launch leaves no lock file behind
        raise UserError(problem or "rank 0 cannot write the log")
    return lock


def run_lock(log_path: Path):
    """(an open file holding an exclusive lock on <log_dir>/.<run_id>.lock, '') or (None, why not): one live
    process per run, so two launches never write one log and prune each other's checkpoints. The operating
    system drops the lock when the process ends, however it ends, so a crashed run leaves none behind."""
    import fcntl
    path = log_path.parent / f".{log_path.stem}.lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        return None, (f"run {log_path.stem} is running already ({holder} holds {path}): wait for it to end, or "
                      f"pass another --run_id")
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {platform.node()}")
    f.flush()
    return f, ""


def release_lock(lock):
    """Drop the run's lock and its file (removed while still held, so no other launch is locking it)."""
    if lock is not None:
        with contextlib.suppress(OSError):
            os.unlink(lock.name)
        lock.close()


def resume_log_problem(log_path: Path, ckpt: dict, ckpt_path: str) -> str:
    """Why a resumed run must not append to this existing log (it is another run's), or ''."""
    owner = log_owner(log_path)
    if owner is None:
        return f"{log_path} has no config line, so it is no run's log to continue: pass another --run_id"
    run_id, _ = owner
    return "" if ckpt["run_id"] == run_id else (f"{log_path} is the log of run {run_id}, and {ckpt_path} is a "
                                               f"checkpoint of run {ckpt['run_id']}: pass --run_id "
                                               f"{ckpt['run_id']} to append to its log, or a new --run_id for a "
                                               f"log of its own")


def cut_torn_line(path: Path) -> str:
    """A log whose last line was cut off (the process killed mid-write) gets that fragment removed, so the next
    line starts on a line of its own; returns the fragment."""
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        f.seek(max(0, end - 65536))
        tail = f.read()
        if not tail or tail.endswith(b"\n"):
            return ""
        keep = end - len(tail) + tail.rfind(b"\n") + 1
        f.truncate(keep)
        return tail[tail.rfind(b"\n") + 1:].decode(errors="replace")


def restore(trainer: Trainer, ckpt: dict) -> list:
    """Continue from a checkpoint read by read_checkpoint: the same data (by the shards' fingerprints, wherever
    they are now), then every state. Returns the log's notes: the shard globs that moved."""
    cfg, now = trainer.cfg, trainer.data()
    change = (data_changes("--train_files", cfg.train_files, ckpt["data"]["train"], now["train"])
              or data_changes("--val_files", cfg.val_files, ckpt["data"]["val"], now["val"]))
    if change:
        raise UserError(f"{change}. Checkpoint {cfg.resume} continues only on the data it was trained on")
    moved = {k: (ckpt["config"][k], getattr(cfg, k)) for k in ("train_files", "val_files")
             if ckpt["config"].get(k) != getattr(cfg, k)}
    try:
        trainer.model.load_state_dict(ckpt["model"])
        trainer.opt.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, KeyError, IndexError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {cfg.resume} does not fit this model: {first_lines(e)}") from None
    trainer.train_loader.load_state(ckpt["loader"])
    trainer.step, trainer.clock.ms, trainer.last_checkpoint = ckpt["step"], ckpt["train_ms"], cfg.resume
    # the summary covers the whole run: its vals and target time before the pause (older checkpoints: none)
    trainer.vals = [tuple(v) for v in ckpt.get("vals", [])]
    trainer.target_ms = ckpt.get("target_ms")
    trainer.last_good_checkpoint = cfg.resume if ckpt["healthy"] else ""
    return [log_line(note="same_shards_at_another_path", **{k: f"{old}->{new}".replace(" ", "_")})
            for k, (old, new) in moved.items()]


def open_log(trainer: Trainer, ckpt):
    """A new log starts with the source, environment and config; a resumed run appends a resumed_from line (to
    its own log, or after the config line of a new one)."""
    cfg = trainer.cfg
    new, problem = False, ""
    if trainer.comm.rank == 0:
        print(f"log: {trainer.log_path}", flush=True)
        if ckpt is None or not trainer.log_path.exists():  # a fresh run's log must not exist, even if one appeared
            try:                                     # since check_log_dir looked: another launch's
                start_log(trainer.log_path, __file__)
                new = True
            except UserError as e:
                problem = str(e)
        for stale in os.listdir(trainer.log_path.parent):  # a checkpoint write that a crash interrupted
            if is_own_tmp(stale, trainer.run_id):
                (trainer.log_path.parent / stale).unlink()
    if not trainer.comm.all_ok(not problem):
        raise UserError(problem or "rank 0 could not create the log")
    trainer.log_open = True
    if new or ckpt is None:
        trainer.log(log_line(config=json.dumps(dataclasses.asdict(cfg), separators=(",", ":")),
                       world_size=trainer.comm.world, micro_batch=trainer.micro_batch, run_id=trainer.run_id))
        trainer.log(log_line(kernels=json.dumps(dataclasses.asdict(trainer.kernels), separators=(",", ":"))))
    if ckpt is None:
        return
    torn = cut_torn_line(trainer.log_path) if trainer.comm.rank == 0 and not new else ""
    if torn:
        trainer.log(log_line(note="torn_last_line_removed", bytes=len(torn.encode())))
    changed = {k: new for k, (_, new) in config_diff(ckpt["config"], dataclasses.asdict(cfg)).items()}
    trainer.log(log_line(resumed_from=cfg.resume, step=trainer.step, world_size=trainer.comm.world,
                         changed=json.dumps(changed, separators=(",", ":"))))
    if trainer.comm.rank == 0:
        abandoned = set_aside_later_checkpoints(trainer.log_path.parent, trainer.run_id, trainer.step)
        if abandoned:
            trainer.log(log_line(note="later_checkpoints_set_aside", steps=",".join(map(str, abandoned)),
                                 now_named="<run_id>_stepNNNNNN.abandoned.pt"))
    rates = {k: changed[k] for k in RESUME_ADJUSTABLE if k in changed}
    if rates:
        def flat(v):  # a log value holds no spaces
            return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
        trainer.log(log_line(note="resumed_with_changed_learning_rates",
                             **{k: f"{flat(ckpt['config'][k])}->{flat(v)}" for k, v in rates.items()}))
    source = source_sha256()
    if ckpt["source_sha256"] != source:
        trainer.log(log_line(warning="resumed_with_changed_source", checkpoint_sha256=ckpt["source_sha256"][:16],
                       source_sha256=source[:16]))


HEALTHY_MARGIN = 0.05  # a checkpoint is healthy if its weights' loss is at most a uniform guess's plus this
HEALTHY_GROWTH = 1000  # and its largest weight at most this many times the largest at initialization


def healthy(trainer: Trainer, ckpt: dict, loss: float) -> bool:
    """Whether a checkpoint's weights are a healthy run's: the loss they gave (the next step's, or the final
    validation's) finite, no worse than a uniform guess's (plus HEALTHY_MARGIN) and, from learning_by_step on,
    better than it, as train_step demands; and no weight over HEALTHY_GROWTH times the largest at
    initialization (a huge learning rate can blow weights up 10^5-fold while the capped loss still looks sane).
    False for NaN."""
    uniform, step = math.log(trainer.cfg.vocab_size), ckpt["step"] + 1
    if not (loss <= uniform + HEALTHY_MARGIN and not (step >= trainer.learning_by_step and loss > uniform - 0.01)):
        return False
    return not blew_up(ckpt["model"].values(), trainer.init_max_abs)


def blew_up(weights, init_max_abs: float) -> bool:
    """Whether any of these weights grew past HEALTHY_GROWTH times the largest at initialization: what tells a
    run blown up by a huge learning rate (its capped loss can stay sane) from one that is merely not learning."""
    largest = max(t.detach().abs().max().item() for t in weights if t.is_floating_point() and t.numel())
    return largest > HEALTHY_GROWTH * init_max_abs


def save_checkpoint(trainer: Trainer, loss: float = None):
    """Capture everything a bitwise-identical continuation needs (collective: every rank builds the unsharded
    optimizer state). It is written once the loss of these very weights is known: the next train step's
    (train_step writes it then), or `loss`, the final validation's. So `healthy` judges the weights it holds,
    not the loss they were trained on: an update that blew them up is not saved as healthy."""
    trainer.clock.stop()
    pending = trainer.pending_checkpoint
    if pending is None or pending["step"] != trainer.step:
        if not all(torch.isfinite(p).all() for p in trainer.model.parameters()):
            raise diverged(trainer, f"non-finite parameters at step {trainer.step}, so no checkpoint was written")
        trainer.pending_checkpoint = {  # copies: the next step updates the weights in place
            "model": model_on_host(trainer.model),
            "optimizer": trainer.opt.state_dict(),
            "loader": data_position(trainer), "step": trainer.step, "train_ms": trainer.clock.ms,
            "config": dataclasses.asdict(trainer.cfg), "source_sha256": source_sha256(), "run_id": trainer.run_id,
            "data": trainer.data(), "vals": list(trainer.vals), "target_ms": trainer.target_ms}
    if loss is not None:
        write_checkpoint(trainer, healthy(trainer, trainer.pending_checkpoint, loss))
    trainer.clock.start()


def write_checkpoint(trainer: Trainer, healthy: bool):
    """Write the pending checkpoint durably, with a hash of its tensors, then prune. Rank 0 writes; all ranks
    stop together if it fails. Pruning keeps the newest healthy checkpoint however old."""
    cfg, ckpt = trainer.cfg, trainer.pending_checkpoint
    trainer.pending_checkpoint = None
    ckpt["healthy"] = healthy
    path = Path(cfg.log_dir) / f"{trainer.run_id}_step{ckpt['step']:06d}.pt"
    problem, fix = "", "free disk space or point --log_dir elsewhere"
    if trainer.comm.rank == 0:
        ckpt["content_sha256"] = content_digest(ckpt["model"], ckpt["optimizer"])
        try:
            write_durably(ckpt, path)
        except OSError as e:
            problem, fix = e.strerror or str(e), write_fix(e)
        except RuntimeError as e:  # torch.save's zip writer turns a failed write into "unexpected pos ..."
            if isinstance(e.__context__, (KeyboardInterrupt, Terminated)):  # a signal inside the write
                raise e.__context__ from None
            if isinstance(e.__context__, OSError):  # the zip writer's own write, e.g. to a read-only disk
                problem, fix = e.__context__.strerror or str(e.__context__), write_fix(e.__context__)
            else:
                free = shutil.disk_usage(path.parent).free
                problem = f"torch.save: {str(e).strip().splitlines()[0][:120]}; {free / 2**20:,.0f} MiB free on that disk"
    if not trainer.comm.all_ok(not problem):
        raise UserError(f"could not write checkpoint {path} ({problem or 'rank 0 failed'}); the newest complete "
                        f"one, {trainer.last_checkpoint or 'none'}, is intact: {fix}")
    trainer.last_checkpoint = str(path)
    if healthy:
        trainer.last_good_checkpoint = str(path)
    trainer.log(log_line(checkpoint=path, **({} if healthy else {"healthy": "no"})))
    if trainer.comm.rank == 0 and cfg.keep_last:
        saved = checkpoint_files(path.parent, trainer.run_id)
        for step in sorted(saved)[:-cfg.keep_last]:
            if str(saved[step]) not in (str(path), trainer.last_good_checkpoint):
                saved[step].unlink()


# ----------------------------------------------------------------------------------------------------------
# Sampling and HellaSwag from a checkpoint: python train_gpt.py --generate CKPT --prompt "..." and
# python train_gpt.py --hellaswag CKPT

def gpt2_encoding():
    """GPT-2's BPE from the ranks shipped in data/, through data/tokenize_text.py (needs tiktoken)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("tokenize_text", Path(__file__).parent / "data" / "tokenize_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpt2_encoding()


@torch.no_grad()
def sample(model: GPT, prompt: list, max_new_tokens: int, windows: Tensor, temperature: float, top_k: int,
           gen: torch.Generator) -> list:
    """Continue the token list `prompt` (which starts with <|endoftext|>) one token at a time. No KV cache: each
    token runs the whole sequence, padded to whole 128-token blocks (padding after the last token is causally
    invisible to it)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        n = len(tokens)
        idx = torch.tensor(tokens + [0] * (-n % MASK_BLOCK), dtype=torch.int32, device=windows.device)
        x = norm(model.hidden(idx, windows)[0, n - 1]).bfloat16()
        logits = softcap(mm(x[None], model.head_w.bfloat16().mT))[0, :GPT2_VOCAB]
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            top = torch.topk(logits / temperature, min(top_k, GPT2_VOCAB) if top_k > 0 else GPT2_VOCAB)
            nxt = int(top.indices[torch.multinomial(top.values.softmax(-1).cpu(), 1, generator=gen)])
        tokens.append(nxt)
    return tokens


def device_flag(device: str) -> torch.device:
    """--generate's and --hellaswag's --device, checked: cuda only where a GPU is visible."""
    if device not in ("cuda", "cpu") or (device == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"--device {device}: " + ("no CUDA GPU is visible; pass --device cpu" if device == "cuda"
                                                  else "must be cuda or cpu"))
    return torch.device(device)


def model_from_checkpoint(path: str, device: torch.device, use: str) -> tuple:
    """(model in eval mode with the checkpoint's weights, its Hyperparameters, the last validation's windows as a
    device tensor, RoPE set for them): how --generate and --hellaswag read a checkpoint. use: what for, in the
    messages."""
    ckpt, problem = load_checkpoint(path)
    if problem:
        raise UserError(f"cannot read checkpoint {path} ({problem}): pass one written by train_gpt.py --save_every"
                        + (log_beside(path) if problem.startswith("not a checkpoint") else ""))
    # a checkpoint of another version (a model since changed by a ported record): say how to run that version
    other = (f"; another version of train_gpt.py wrote it (its source sha256 starts {ckpt['source_sha256'][:16]}): "
             f"{use} with that version, which its run's log holds (python records/tool.py source LOG -o "
             f"other_train_gpt.py)" if ckpt["source_sha256"] != source_sha256() else "")
    try:
        cfg = hyperparameters_from(ckpt["config"])
        check_config(dataclasses.replace(cfg, device=device.type))
    except (TypeError, UserError) as e:
        raise UserError(f"checkpoint {path} holds settings this train_gpt.py cannot build a model from "
                        f"({str(e).splitlines()[0]}){other}") from None
    model = GPT(cfg).to(device).eval()
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"checkpoint {path}: its weights do not fit the model its settings describe "
                        f"({first_lines(e)}){other}") from None
    model.rotary.set_stages(long_window_stages(cfg.num_steps, cfg))
    windows = torch.tensor([w * MASK_BLOCK for w in windows_at(cfg.num_steps, cfg, final_val=True)],
                           dtype=torch.int32, device=device)
    return model, cfg, windows


def log_beside(path: str) -> str:
    """For a file that is not a checkpoint: the run's checkpoints beside it, if it is a log of one."""
    if Path(path).suffix != ".txt":
        return ""
    found = sorted(Path(path).parent.glob(f"{Path(path).stem}_step*.pt"))
    if not found:
        return f". {path} is a run's log, and no checkpoint of it is beside it (--save_every K writes them)"
    return f". {path} is a run's log; its checkpoints: {', '.join(map(str, found[-3:]))}"


def generate(argv) -> str:
    parser = _Parser(description="Continue a prompt with a model trained by train_gpt.py.")
    parser.add_argument("--generate", required=True, metavar="CKPT", help="a checkpoint written by --save_every")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens to add (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = always the likeliest (default: 0.8)")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest; 0 = all (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    mode_help(parser, argv)
    args = parser.parse_args(argv)
    device = device_flag(args.device)
    model, cfg, windows = model_from_checkpoint(args.generate, device, "sample")
    enc = gpt2_encoding()
    prompt = [BOS_ID, *enc.encode_ordinary(args.prompt)]
    limit = max(cfg.seq_len, cfg.val_seq_len)
    if len(prompt) == 1:
        raise UserError("the prompt is empty: pass some text with --prompt")
    if len(prompt) + args.max_new_tokens > limit:
        raise UserError(f"the prompt ({len(prompt) - 1} tokens) plus --max_new_tokens {args.max_new_tokens} is "
                        f"longer than the {limit - 1} tokens this model has positions for: shorten one of them")
    for wrong, says in ((args.max_new_tokens < 1, f"--max_new_tokens must be positive (it is {args.max_new_tokens})"),
                        (not 0 <= args.temperature < math.inf,
                         f"--temperature must be a finite number, 0 or more (it is {args.temperature})"),
                        (args.top_k < 0, f"--top_k must be 0 or more (it is {args.top_k})"),
                        (not 0 <= args.seed < 2**63, f"--seed must be at least 0 and below 2^63 (it is {args.seed})")):
        if wrong:  # the flag that is wrong, alone: a list of every rule reads as if all were
            raise UserError(says)
    tokens = sample(model, prompt, args.max_new_tokens, windows, args.temperature, args.top_k,
                    torch.Generator().manual_seed(args.seed))
    return decode(enc, tokens[1:])


def decode(enc, tokens: list) -> str:
    """Text of GPT-2 tokens, some of which hold part of a multi-byte UTF-8 character: bytes that form no whole
    character (a split the model did not complete) are left out rather than printed as U+FFFD."""
    return enc.decode_bytes(tokens).decode("utf-8", errors="ignore")


# HellaSwag (Zellers et al. 2019): a context and 4 endings, one right. Each ending is scored by the log-likelihood
# of its tokens after the context: acc takes the ending of the highest sum, acc_norm of the highest mean per
# token (the length-normalized form, the one the speedrun's evals/hellaswag.py reports). GPT-2 small (124M)
# reaches about 0.29 (acc) and 0.31 (acc_norm) on the 10,042 validation items.
HELLASWAG_FILE = Path(__file__).resolve().parent / "data" / "hellaswag" / "hellaswag_val.jsonl"
HELLASWAG_BATCH_TOKENS = 16384  # tokens per forward pass: sequences of one padded length, side by side


def hellaswag_items(path: str) -> list:
    """The items of a HellaSwag .jsonl (one JSON object per line with ctx, 4 endings and the label's index, as
    data/hellaswag.py downloads them), checked: one line naming the first bad one."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file: get HellaSwag's validation split with `python data/hellaswag.py`, "
                        f"or pass --hellaswag_file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ctx, endings, label = item["ctx"], item["endings"], int(item["label"])
            assert isinstance(ctx, str) and len(endings) == 4 and all(isinstance(e, str) for e in endings)
            assert 0 <= label < 4
        except (ValueError, KeyError, TypeError, AssertionError):
            raise UserError(f"{path}, line {n}: not a HellaSwag item (a JSON object with a \"ctx\" string, 4 "
                            f"\"endings\" and a \"label\" 0-3)") from None
        items.append((ctx, endings, label))
    if not items:
        raise UserError(f"{path}: holds no items")
    return items


@torch.no_grad()
def ending_logprobs(model: GPT, seqs: list, windows: Tensor, device: torch.device) -> list:
    """For token lists [BOS, context..., ending...] with the ending's length each, (sequence tokens, ending
    length): the sum of the ending tokens' log-probabilities given what precedes them, under the model's
    validation head (bf16, capped). Each sequence alone (its own document), padded to one length, side by side
    in passes of about HELLASWAG_BATCH_TOKENS; one shape for all passes, so a compiled model compiles once."""
    T = -(-max(len(t) for t, _ in seqs) // MASK_BLOCK) * MASK_BLOCK
    B = min(max(1, HELLASWAG_BATCH_TOKENS // T), len(seqs))
    out = []
    for i in range(0, len(seqs), B):
        part = seqs[i:i + B]
        idx = torch.zeros(B, T, dtype=torch.int32)
        for b, (tokens, _) in enumerate(part):
            idx[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        x = model.hidden(idx.to(device), windows)
        for b, (tokens, n) in enumerate(part):
            rows = norm(x[b, len(tokens) - n - 1:len(tokens) - 1]).bfloat16()  # they predict the ending's tokens
            logits = softcap(mm(rows, model.head_w.bfloat16().mT))
            targets = torch.tensor(tokens[-n:], device=device)
            out.append(logits.log_softmax(-1).gather(1, targets[:, None]).sum().item())
    return out


def score_hellaswag(model: GPT, items: list, windows: Tensor, device: torch.device, rank: int = 0,
                    world: int = 1) -> dict:
    """acc, acc_norm and the count over items (this rank's share: every world-th), each ending tokenized with a
    space before it, as GPT-2's BPE writes a word after a space."""
    enc = gpt2_encoding()
    seqs = []
    mine = items[rank::world]
    for ctx, endings, _ in mine:
        context = [BOS_ID, *enc.encode_ordinary(ctx)]
        for ending in endings:
            tokens = enc.encode_ordinary(" " + ending)
            seqs.append((context + tokens, len(tokens)))
    logprobs = ending_logprobs(model, seqs, windows, device) if seqs else []
    right = right_norm = 0
    for i, (_, _, label) in enumerate(mine):
        total = logprobs[4 * i:4 * i + 4]
        lengths = [n for _, n in seqs[4 * i:4 * i + 4]]
        right += max(range(4), key=lambda j: total[j]) == label
        right_norm += max(range(4), key=lambda j: total[j] / lengths[j]) == label
    return {"right": right, "right_norm": right_norm, "count": len(mine)}


def hellaswag_line(counts: dict, path) -> str:
    n = max(counts["count"], 1)
    return log_line(hellaswag_acc=f"{counts['right'] / n:.4f}", acc_norm=f"{counts['right_norm'] / n:.4f}",
                    count=counts["count"], file=path)


def hellaswag(argv) -> str:
    parser = _Parser(description="Score a checkpoint on HellaSwag: acc (highest summed log-likelihood of the "
                                 "ending) and acc_norm (highest per token), over every item of the file.")
    parser.add_argument("--hellaswag", required=True, metavar="CKPT", help="a checkpoint written by --save_every")
    parser.add_argument("--hellaswag_file", default=str(HELLASWAG_FILE),
                        help="a HellaSwag .jsonl (default: the validation split data/hellaswag.py downloads)")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N items (default: 0, all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    mode_help(parser, argv)
    args = parser.parse_args(argv)
    device = device_flag(args.device)
    items = hellaswag_items(args.hellaswag_file)
    if args.limit < 0:
        raise UserError(f"--limit must be 0 (all) or more (it is {args.limit})")
    model, _, windows = model_from_checkpoint(args.hellaswag, device, "score it")
    return hellaswag_line(score_hellaswag(model, items[:args.limit or None], windows, device), args.hellaswag_file)


def eval_hellaswag(trainer: Trainer):
    """--eval_hellaswag after training: the final weights on the file's items, split over the ranks; one log line."""
    cfg, comm = trainer.cfg, trainer.comm
    items = hellaswag_items(cfg.eval_hellaswag)
    trainer.model.eval()
    trainer.set_schedule(cfg.num_steps, final_val=True)
    counts = score_hellaswag(trainer.model, items, trainer.windows, trainer.device, comm.rank, comm.world)
    trainer.model.train()
    totals = comm.all_reduce(torch.tensor([counts["right"], counts["right_norm"], counts["count"]],
                                          device=trainer.device))
    trainer.log(hellaswag_line(dict(zip(("right", "right_norm", "count"), totals.tolist())), cfg.eval_hellaswag))


# ----------------------------------------------------------------------------------------------------------
# main

def gpu_error_message(e: Exception, cfg: Hyperparameters, per_pass: int = 0):
    """One line for the GPU failures that a flag fixes, or None: any other error keeps its traceback. per_pass:
    the sequences a pass the run took (0: not known yet), so that a smaller one is what the line offers."""
    if isinstance(e, torch.OutOfMemoryError):
        doubled = ",".join(str(2 * n) for n in cfg.batch_seqs)
        smaller = [str(b) for b in range(per_pass - 1, 0, -1) if per_pass % b == 0] if per_pass else ["2", "1"]
        than = f" than its {per_pass}" if per_pass else ""
        fewer = (f"run fewer sequences per pass{than} (--micro_batch {', or '.join(smaller)}), or " if smaller else
                 "it ran one sequence per pass: ")
        return (f"out of GPU memory with --seq_len {cfg.seq_len}: {fewer}keep the tokens per step in shorter "
                f"micro-batches, e.g. --seq_len {cfg.seq_len // 2} --batch_seqs {doubled} (README: GPUs and "
                f"memory); in validation, a shorter --val_seq_len")
    if isinstance(e, RuntimeError) and "can't allocate memory" in str(e):  # the CPU allocator
        return (f"out of memory ({first_lines(e, 1)[:120]}): lower --seq_len or --batch_seqs (activations), or the "
                f"model's size")
    if "out of resource" in str(e):  # Triton's OutOfResources, raised directly or inside a compile error
        if cfg.flex_tiles != "small":
            return "FlexAttention's kernels need more shared memory than this GPU has: run with --flex_tiles small"
        return ("FlexAttention's kernels need more shared memory than this GPU has, even with --flex_tiles small: "
                "try --head_dim 64 --num_heads 12, or a GPU of the A100/H100 class")
    return None


def alloc_retries(device: torch.device) -> int:
    """How often the GPU's caching allocator has found no memory left, freed its cached blocks and asked again
    (each time it waits for the GPU), in this process so far; 0 off the GPU."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def memory_lines(peak: int, reserved: int, retries: int) -> list[str]:
    """The log's GPU memory line (peak allocated and reserved bytes, the training's allocator retries), and
    a note where the allocator ran out: the step time then holds its waits, which the GPU's size, not the
    code, caused (under a 24 GiB cap played on an H100 the stage bench's GPU sat idle 99-134 ms a step, in gaps
    that point at the allocator: records/2026-12-07_sm86-caps-h100)."""
    lines = [log_line(peak_memory=f"{peak // 2**20}MiB", reserved_memory=f"{reserved // 2**20}MiB",
                      alloc_retries=retries)]
    if retries:
        lines.append(log_line(note="memory_at_the_limit", why=f"the_allocator_ran_out_{retries}_times_and_freed_"
                                                              f"its_cache,_each_a_wait:_a_smaller_--micro_batch_"
                                                              f"may_train_faster"))
    return lines


def summary_line(trainer: Trainer) -> str:
    """The log's last line: how the run ended (its last and best val, the time to the target, tokens/s,
    peak GPU memory, the log)."""
    cfg, ms = trainer.cfg, trainer.clock.ms
    final = trainer.vals[-1][1] if trainer.vals else float("nan")
    best_step, best = min(trainer.vals, key=lambda v: v[1]) if trainer.vals else (0, float("nan"))
    fields = dict(summary=f"{trainer.step}/{cfg.num_steps}_steps", final_val=f"{final:.4f}", best_val=f"{best:.4f}",
                  best_at_step=best_step, train_time=f"{ms / 1000:.1f}s",
                  target=f"{cfg.target_val_loss}_at_{trainer.target_ms / 1000:.1f}s" if trainer.target_ms is not None
                  else f"{cfg.target_val_loss}_not_reached",
                  tokens_per_s=f"{tokens_before(trainer.step, cfg) / max(ms / 1000, 1e-9):,.0f}".replace(",", "_"))
    if trainer.device.type == "cuda":
        fields["peak_memory"] = f"{torch.cuda.max_memory_allocated() // 2**20}MiB"
    return log_line(**fields, log=trainer.log_path)


class Terminated(BaseException):
    """SIGTERM, raised where the run is, so that it ends as Ctrl-C does: one line, no half-written file."""


def _on_sigterm(signum, frame):
    raise Terminated()


def run(trainer: Trainer):
    """The loop: validate (clock stopped), stop at the last step (or --stop_at's), train a step, log it,
    checkpoint."""
    cfg = trainer.cfg
    trainer.started = True
    retries_before = alloc_retries(trainer.device)
    trainer.clock.start()
    for step in range(trainer.step, cfg.num_steps + 1):
        last_step, pause = step == cfg.num_steps, cfg.stop_at > 0 and step == cfg.stop_at
        if last_step or pause or (cfg.val_every and step % cfg.val_every == 0):
            last_step |= validate(trainer, step) and cfg.stop_at_target
        if last_step or pause:
            break
        with profiled(trainer, step):
            log_train(trainer, train_step(trainer, step))
        if cfg.save_every and trainer.step % cfg.save_every == 0 and trainer.step < cfg.num_steps:
            save_checkpoint(trainer)
    if cfg.save_every or pause:  # judged by the last validation, the loss of the weights it holds
        save_checkpoint(trainer, loss=trainer.vals[-1][1])
    if trainer.device.type == "cuda":
        for line in memory_lines(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(),
                                 alloc_retries(trainer.device) - retries_before):
            trainer.log(line)
    if pause and not last_step:  # no summary: the run goes on from the checkpoint, in this same log
        trainer.log(log_line(stopped_at=f"{step}/{cfg.num_steps}", resume_with=trainer.last_checkpoint))
        if trainer.comm.rank == 0:
            print(f"go on with: {launch_command(trainer.comm.world)} --resume {trainer.last_checkpoint}", flush=True)
        return
    trainer.log(summary_line(trainer))
    if cfg.eval_hellaswag:
        eval_hellaswag(trainer)
    if trainer.comm.rank == 0:
        png = trainer.log_path.with_suffix(".png")
        tool = os.path.relpath(Path(__file__).resolve().parent / "records" / "tool.py")
        print(f"plot it: python {tool} plot {trainer.log_path} -o {png}", flush=True)


def launch_command(world: int) -> str:
    """How this script is launched from the current folder: python, or torchrun for several processes (on
    several nodes with the rendezvous flags this launch had)."""
    script = os.path.relpath(Path(__file__).resolve())
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world == 1:
        return f"python {script}"
    if local == world:
        return f"torchrun --standalone --nproc_per_node={world} {script}"
    return f"torchrun --nnodes={world // local} --nproc_per_node={local} <your rendezvous flags> {script}"


def failure_message(e: BaseException, trainer, cfg: Hyperparameters):
    """The one line that ends a failed run, or None for an error that should keep its traceback (a bug)."""
    if isinstance(e, (KeyboardInterrupt, Terminated)):  # a checkpoint write it cut off left no file behind
        how = "interrupted" if isinstance(e, KeyboardInterrupt) else "terminated (SIGTERM)"
        if trainer is None or not trainer.started:
            return f"{how} before the first step (while starting or compiling): no step was trained"
        if not trainer.last_checkpoint:
            return f"{how} at step {trainer.step}; no checkpoint was written yet (--save_every K writes them)"
        return f"{how} at step {trainer.step}; the newest complete checkpoint is {trainer.last_checkpoint}"
    return str(e) if isinstance(e, UserError) else gpu_error_message(e, cfg, getattr(trainer, "micro_batch", 0))


def end_log(trainer, message: str):
    """A failed run's log ends with its error line; a new run that failed before its first step leaves no log
    (its run_id stays free for the next launch)."""
    if trainer is None or not trainer.log_open or trainer.comm.rank != 0:
        return
    if not trainer.started and not trainer.cfg.resume:
        trainer.log_path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError, UserError):  # a full disk: the line goes to stderr only
        append_line(trainer.log_path, f"error: {message}")


def main(argv=None):
    """Train (returns the log's path), or with --generate sample from a checkpoint, with --hellaswag score one
    (returns the text printed)."""
    argv = sys.argv[1:] if argv is None else argv
    for mode, run_mode in (("--generate", generate), ("--hellaswag", hellaswag)):
        if any(a == mode or a.startswith(f"{mode}=") for a in argv):
            try:
                text = run_mode(argv)
            except UserError as e:
                raise SystemExit(f"error: {e}") from None
            print(text)
            return text
    cfg = parse_args(argv)
    log_dir_existed = os.path.isdir(cfg.log_dir)
    trainer, old_handler = None, signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        trainer = build(cfg)
        warm_up(trainer)
        run(trainer)
        return trainer.log_path
    except (Exception, KeyboardInterrupt, Terminated) as e:
        message = failure_message(e, trainer, cfg)
        if message is None:
            raise
        end_log(trainer, message)
        if not log_dir_existed and int(os.environ.get("RANK", 0)) == 0:  # a failed first launch leaves no empty folder
            with contextlib.suppress(OSError):
                os.rmdir(cfg.log_dir)  # only if empty
        raise SystemExit(f"error: {message}" if int(os.environ.get("RANK", 0)) == 0 else 1) from None
    finally:
        signal.signal(signal.SIGTERM, old_handler)
        if trainer is not None:
            release_lock(trainer.lock)
        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------
# GPU fast paths: hand-written Triton kernels for ops torch.compile does poorly, each behind a function that
# runs the plain-torch rule instead off the GPU (on_gpu); tests/test_training.py checks each kernel against
# its rule. Launch settings come from KernelSettings.

QK_ROWS = 32      # (token, head) rows per program of the QK-norm + rotary kernels: 16 to 64 timed the same
ACC_BLOCK = 4096  # elements per program of the fp32 grad accumulate
ROWS_TILE = (16, 256, 4)  # the embedding grads' row add: rows and columns per program, warps
# the row add's tile for rows in sorted order (runs summed first): the fastest of 6 on an H100 (rowsort-ce-h100)
SORTED_ROWS_TILE = (8, 256, 2)
FP32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default eps for bf16 input, which it normalizes in fp32
# a launch of the fused ReLU^2 matmul: a tile of rows x columns outputs, depth deep; warps; pipeline stages;
# the epilogue's stores in this many column blocks; warp specialization (1) or not (0); persistent programs
# per multiprocessor (2: where two fit in its shared memory, one's epilogue overlaps the other's matmul)
MLP_TILE = ("rows", "columns", "depth", "warps", "stages", "store_split", "warp_specialize", "programs_per_sm")
# forward's and backward's (KernelSettings.mlp_tiles): the fastest of 21 launches each on an H100, the same bits
# as any other (records/2026-12-06_mlptiles-h100, records/bench/mlpbench.py); the backward's two programs per
# multiprocessor fit its shared memory (test_mlp_hopper_tiles_fit_the_shared_memory). The FP8 forward's: the
# record's (2026-05-19_FP8MLPUpProj: 128 x 256 tiles 128 deep, 4 stages, 8 warps), and with post's e4m3 copy
# for the down projection 3 stages (2026-07-17_FP8DownProjection: the copy's staging takes the fourth's memory)
# dc_mix's launches, the fastest of 4 timed by records/bench/dcbench.py (records/2026-12-07_master-h200: a pass's
# forward + backward 2.55 ms, 4.03 with 64 keys, 8 warps and the heads in each program, 3.03 the compiled rule)
DC_KERNEL_TILES = (16, 32, 64)  # dc_mix: queries per forward program; keys per backward program; its query tiles
DC_KV_WARPS = 4                 # dc_mix's key side: warps per program
# the key side's heads in one program each (a grid of key blocks x heads; its compile a sixth of the unrolled
# one's), or all in each program
DC_KV_HEADS_IN_GRID = True
MLP_HOPPER_TILES = ((128, 256, 64, 8, 4, 2, 0, 1), (128, 128, 64, 8, 3, 4, 0, 2), (128, 256, 128, 8, 4, 2, 0, 1),
                    (128, 256, 128, 8, 3, 2, 0, 1))
# a window_attention kernel's launch: its tile, its pipeline, and whether the tiles it walks (keys and values, or
# queries and out grads) come by TMA descriptors
ATTN_TILE = ("queries", "keys", "warps", "stages", "tma")
# forward's, dq's and dk/dv's (KernelSettings.attn_tiles; the dk/dv kernel's queries divide its keys): the
# fastest of three each at stage 3's shapes on an H100 (records/2026-12-07_attn-h100, records/bench/attnbench.py);
# TMA off, not yet timed (records/2026-12-08_ce-sass)
ATTN_HOPPER_TILES = ((64, 64, 4, 3, 0), (64, 64, 4, 2, 0), (64, 64, 4, 2, 0))


def ce_outputs(rows: int, vocab: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """What softcap_ce_rows writes for rows of logits: the fp32 multi-token and next-token losses per row, and
    the e5m2 grad (rows, vocab)."""
    return (torch.empty(rows, device=device), torch.empty(rows, device=device),
            torch.empty(rows, vocab, device=device, dtype=torch.float8_e5m2))


def softcap_ce_rows(z: Tensor, targets: Tensor, weights: Tensor, grad_s: float, launch=(8, 512, 8),
                    approx: bool = True, seq_len: int = 0, out: tuple = None,
                    prefix: Tensor = None, row0: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """For logits z (n, vocab) of the training head, rows row0 .. row0 + n - 1 of the rows targets hold,
    sequences of seq_len rows (0: one): per row, the multi-token loss (weights[k] times the cross-entropy of the
    capped logits against targets[row + k], where row + k lies in the row's sequence) and the next-token loss;
    and the multi-token loss's grad wrt z in units of grad_s, in e5m2 (or out's grad dtype: bf16 for the bf16
    head, which passes z itself). Written into out = (loss, ntp, grad) if given (rows of larger tensors). On GPU
    one kernel reads z twice and writes the grad; launch = its (rows, vocab columns, warps). prefix:
    softcap_ce_parts'."""
    if on_gpu(z):
        return _softcap_ce_cuda(z, targets, weights, grad_s, launch, approx, seq_len or targets.numel(), out, prefix,
                                row0)
    loss, ntp, dz = softcap_ce_parts(z, targets, weights, seq_len, prefix, row0)
    grad_dtype = torch.float8_e5m2 if out is None else out[2].dtype
    made = loss, ntp, (to_fp8(dz, grad_s, grad_dtype) if grad_dtype == torch.float8_e5m2 else
                       dz.div(grad_s).to(grad_dtype))
    if out is None:
        return made
    for o, t in zip(out, made, strict=True):
        o.copy_(t)
    return out


def transposed(t: Tensor, tile=(64, 128)) -> Tensor:
    """t.T.contiguous() for a 2-D 1-byte (fp8) tensor; on GPU by a tiled kernel (torch's copy of a transposed
    1-byte tensor is an uncoalesced elementwise kernel, 12x slower: records/2026-12-03_speed-h200)."""
    if not on_gpu(t):
        return t.T.contiguous()
    R, C = t.shape
    out = torch.empty(C, R, device=t.device, dtype=t.dtype)
    br, bc = tile
    _transpose_bytes_kernel[(triton.cdiv(R, br), triton.cdiv(C, bc))](t.view(torch.uint8), out.view(torch.uint8), R, C,
                                                                      BLOCK_R=br, BLOCK_C=bc, num_warps=8)
    return out


def add_into_fp32(acc: Tensor, g: Tensor, block: int = ACC_BLOCK):
    """acc += g, for a contiguous fp32 acc and a bf16 g of as many elements (a micro-step's grad of a bf16
    parameter into its fp32 sum). Torch's add of bf16 into fp32 runs its unvectorized mixed-dtype kernel,
    about half the bandwidth (records/2026-12-04_speed6-h200)."""
    if on_gpu(acc):
        n = acc.numel()
        _add_into_fp32_kernel[(triton.cdiv(n, block),)](acc, g.contiguous(), n, BLOCK=block, num_warps=8)
    else:
        acc += g


def add_rows_into_fp32(acc: Tensor, ids: Tensor, rows: Tensor, tile=ROWS_TILE, order: tuple = None,
                       sorted_tile=SORTED_ROWS_TILE):
    """acc[ids[i]] += rows[i] for each i (repeated ids add up), acc fp32 (table rows, dim), rows (n, dim) of a
    narrower dtype: an embedding table's micro-step grad into its fp32 sum. On GPU one kernel of fp32 atomics,
    four columns to an instruction, reading rows as they are; index_add_ wants them in fp32 first (a copy) and
    adds an element at a time. order: (ids sorted, where each came from), as torch.sort gives them: then the
    kernel reads the rows in that order and sums each run of equal ids in its block before one atomic add (a
    token id repeats many times in 65,536 tokens)."""
    if not on_gpu(acc):
        acc.index_add_(0, ids, rows.float())
        return
    rows = rows.contiguous()
    if order is not None:
        (n, dim), (br, bd, warps), (sorted_ids, source) = rows.shape, sorted_tile, order
        _add_sorted_rows_into_fp32_kernel[(triton.cdiv(n, br), triton.cdiv(dim, bd))](
            acc, sorted_ids, source, rows, n, dim, BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
        return
    (n, dim), (br, bd, warps) = rows.shape, tile
    _add_rows_into_fp32_kernel[(triton.cdiv(n, br), triton.cdiv(dim, bd))](acc, ids, rows, n, dim,
                                                                           BLOCK_R=br, BLOCK_D=bd, num_warps=warps)


def cautious_step_fused(p: Tensor, update: Tensor, lr: float, decay: float, strict: bool, adam: tuple = None,
                        block: int = ACC_BLOCK):
    """cautious_step of p by update; with adam = (grad, exp_avg_sq, step, betas, eps), update is exp_avg, and
    the step's update is adam_update's direction, made from grad and the moments first. On GPU one kernel for
    a contiguous fp32 p, reading and writing each element once (grad stays as it was); the rules as torch ops
    are 6 passes over the bucket, and 14 with Adam's (the default's Adam buckets hold 463M values)."""
    if not on_gpu(p):
        if adam:
            grad, exp_avg_sq, step, betas, eps = adam
            update = adam_update(grad, update, exp_avg_sq, step, betas, eps)
        return cautious_step(p, update, lr, decay, strict)
    if not adam:  # NorMuon's update of a tall stack comes from polar_express's transposed view
        update = update.contiguous()
    grad, exp_avg_sq, step, (beta1, beta2), eps = adam or (update, update, 0, (1.0, 1.0), 0.0)
    assert all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == p.numel()
               for t in (p, update, grad, exp_avg_sq))
    n = p.numel()
    # the scalars as torch gets them: 1 - beta and the bias corrections made in float64, then given as fp32
    _cautious_step_kernel[(triton.cdiv(n, block),)](p, update, grad, exp_avg_sq, n, lr, decay, 1 - beta1, 1 - beta2,
                                                    beta2, 1 - beta1 ** step, 1 - beta2 ** step, eps,
                                                    ADAM=adam is not None, STRICT=strict, BLOCK=block, num_warps=8)


@torch.library.custom_op("train_gpt::fp8_head_loss", mutates_args=())
def fp8_head_loss(x: Tensor, w: Tensor, x_f8: Tensor, w_f8: Tensor, targets: Tensor, weights: Tensor, seq_len: int,
                  launch: list[int], approx: bool,
                  prefix: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The head's summed multi-token and next-token losses with x @ w.T in FP8: x_f8 and w_f8 are x and w
    divided by their scales and rounded to e4m3 (by the caller, where torch.compile fuses the casts with what
    makes x). x and w are inputs only for autograd, which sends their grads straight through the casts. The
    multi-token loss's logit grad is computed here, with the losses, so backward is two FP8 matmuls; the
    next-token loss carries no grad (it is what the log reports). Returns (losses, and the e5m2 grad row-major
    and transposed, for backward)."""
    T, V = x_f8.size(0), w_f8.size(0)
    loss, ntp, g = ce_outputs(T, V, x.device)
    # the logits one sequence at a time (the targets stay in their sequence): a pass's bf16 logits are never
    # all held, nor beside the transposed grad; at four 16K sequences per pass that was 6.6 GB of the peak
    for rows in (slice(r, r + seq_len) for r in range(0, T, seq_len)):
        softcap_ce_rows(scaled_mm(x_f8[rows], w_f8.T, HEAD_X_SCALE, HEAD_W_SCALE, torch.bfloat16, fast_accum=True),
                        targets[rows], weights, HEAD_GRAD_SCALE, launch[:3], approx, seq_len,
                        out=(loss[rows], ntp[rows], g[rows]), prefix=None if prefix is None else prefix[rows])
    return loss.sum(), ntp.sum(), g, transposed(g, launch[3:5])


@fp8_head_loss.register_fake
def _(x, w, x_f8, w_f8, targets, weights, seq_len, launch, approx, prefix=None):
    T, V = x.size(0), w.size(0)
    scalar = x.new_empty((), dtype=torch.float32)
    e5m2 = torch.float8_e5m2
    return scalar, scalar.clone(), x.new_empty(T, V, dtype=e5m2), x.new_empty(V, T, dtype=e5m2)


@torch.library.custom_op("train_gpt::fp8_mm_backward", mutates_args=())
def fp8_mm_backward(g_f8: Tensor, g_f8_t: Tensor, x_f8: Tensor, w_f8: Tensor,
                    launch: list[int]) -> tuple[Tensor, Tensor]:
    """Grads of x @ w.T (both bf16) from the e5m2 output grad, given twice: row-major for grad_x and transposed
    for grad_w (FP8 matmuls take only K-contiguous operands, and K is the token dim for grad_w)."""
    tile = launch[3:5]
    grad_x = scaled_mm(g_f8, transposed(w_f8, tile).T, HEAD_GRAD_SCALE, HEAD_W_SCALE, torch.bfloat16, fast_accum=False)
    grad_w = scaled_mm(g_f8_t, transposed(x_f8, tile).T, HEAD_GRAD_SCALE, HEAD_X_SCALE, torch.bfloat16,
                       fast_accum=False)
    return grad_x, grad_w


@fp8_mm_backward.register_fake
def _(g_f8, g_f8_t, x_f8, w_f8, launch):
    return x_f8.new_empty(x_f8.shape, dtype=torch.bfloat16), w_f8.new_empty(w_f8.shape, dtype=torch.bfloat16)


def _fp8_head_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3], *output[2:])
    ctx.launch = inputs[7]


def _fp8_head_grad(ctx, grad_loss, *_):
    x_f8, w_f8, g_f8, g_f8_t = ctx.saved_tensors
    grad_x, grad_w = fp8_mm_backward(g_f8, g_f8_t, x_f8, w_f8, ctx.launch)
    return grad_x * grad_loss, grad_w * grad_loss, *[None] * 8  # x_f8 .. prefix take none


fp8_head_loss.register_autograd(_fp8_head_grad, setup_context=_fp8_head_setup)


# The ReLU^2 MLP with its activation in the first matmul's epilogue, each way: compiled, relu(pre)^2 and its grad
# were separate passes over the (tokens, 4 dim) activations, 43 ms of a 24-micro-step step on an H100
# (records/2026-12-05_xsa-h100/profiles). The speedrun fuses it since its record 2026-01-10_FusedLinearReLUSquare.

@torch.library.custom_op("train_gpt::relu_square_mlp", mutates_args=())
def relu_square_mlp(x: Tensor, fc_w: Tensor, proj_w: Tensor, tiles: list[int], x_f8: Optional[Tensor] = None,
                    fc_f8: Optional[Tensor] = None, fp8_scale: Optional[Tensor] = None,
                    proj_f8: Optional[Tensor] = None, act_scale: Optional[Tensor] = None,
                    proj_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """MLP.forward's relu(x @ fc_w.T)^2 @ proj_w for x (..., dim) and weights (4 dim, dim), of one dtype:
    returns (output, post, top), post = relu(x @ fc_w.T)^2, all backward reads of the activations (relu(pre) is
    sqrt(post), so pre is never stored: the speedrun's 2026-06-11 "leaner" kernel). On GPU one kernel makes post
    (relu_square_mm); tiles: KernelSettings.mlp_launch, forward's and backward's MLP_TILE end to end, or [] for
    torch ops. With x_f8 (tokens, dim), fc_f8 and fp8_scale (fp8_input, fp8_weight) x @ fc_w.T is their FP8
    product instead (fp8_mm); with proj_f8 (dim, 4 dim), act_scale and proj_scale too (fp8_down_weight), post @
    proj_w is fp8_post(post, act_scale)'s with proj_f8, times both scales, and top (1,) fp32 is post's largest
    value (else empty). The grads still come from x, fc_w, proj_w and post in bf16."""
    fp8 = None if x_f8 is None else (x_f8, fc_f8, fp8_scale)
    x2 = x.reshape(-1, x.size(-1))
    if proj_f8 is None:
        post = relu_square_mm(x2, fc_w, None, tiles[:len(MLP_TILE)], fp8)
        return mm(post, proj_w).reshape(x.shape), post, x.new_empty(0, dtype=torch.float32)
    post, post_f8, top = relu_square_mm(x2, fc_w, None, tiles[:len(MLP_TILE)], fp8, act_scale)
    # one scale of their product: cuBLAS refused the scales as views of their buffer (CUBLAS_STATUS_NOT_SUPPORTED on
    # an H100, records/2026-12-07_fp8down-h100), which a new tensor is not
    return fp8_mm(post_f8, proj_f8, act_scale * proj_scale).reshape(x.shape), post, top


@relu_square_mlp.register_fake
def _(x, fc_w, proj_w, tiles, x_f8=None, fc_f8=None, fp8_scale=None, proj_f8=None, act_scale=None, proj_scale=None):
    return (x.new_empty(x.shape), x.new_empty(x.numel() // x.size(-1), fc_w.size(0)),
            x.new_empty(0 if proj_f8 is None else 1, dtype=torch.float32))


@torch.library.custom_op("train_gpt::relu_square_grad", mutates_args=())
def relu_square_grad(g: Tensor, proj_w: Tensor, post: Tensor, tile: list[int]) -> Tensor:
    """The grad of pre from g, the output's grad (rows, dim), and the forward's post: 2 sqrt(post) (g @ proj_w.T),
    the matmul rounded to the dtype as a GEMM writes it, the rest in fp32 with one rounding; on GPU in one
    kernel."""
    return relu_square_mm(g, proj_w, post, tile)


@relu_square_grad.register_fake
def _(g, proj_w, post, tile):
    return post.new_empty(post.shape)


def _relu_square_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], output[1])
    ctx.tiles = inputs[3]
    ctx.set_materialize_grads(False)  # post's grad is never used: no zeros made for it
    ctx.mark_non_differentiable(output[2])  # top only sets the next step's scale


def _relu_square_backward(ctx, g, *_):
    x, fc_w, proj_w, post = ctx.saved_tensors
    g2, x2 = g.reshape(-1, g.size(-1)), x.reshape(-1, x.size(-1))
    dpre = relu_square_grad(g2, proj_w, post, ctx.tiles[len(MLP_TILE):])
    return mm(dpre, fc_w).reshape(x.shape), mm(dpre.mT, x2), mm(post.mT, g2), *[None] * 7  # tiles .. proj_scale


relu_square_mlp.register_autograd(_relu_square_backward, setup_context=_relu_square_setup)


def relu_square_mm(a: Tensor, b: Tensor, post, tile, fp8: tuple = None, act_scale: Tensor = None):
    """s = a @ b.T for a (rows, k) and b (n, k), or with fp8 = (a_f8, b_f8, scale) their fp8_mm; then, without
    post: relu(s)^2; with post (rows, n), the forward's relu(pre)^2: 2 sqrt(post) s, the grad of pre. With
    act_scale (the FP8 forward for --fp8_down) returns (relu(s)^2, its fp8_post copy, its largest value (1,)
    fp32). The GPU kernel (given a tile) rounds s to bf16 first, as cuBLAS writes it, and squares or multiplies
    in fp32; its tensor descriptors need rows of a multiple of 16 bytes."""
    if tile and on_gpu(a) and a.dtype == torch.bfloat16 and a.size(1) % (8 if fp8 is None else 16) == 0 \
            and b.size(0) % (8 if act_scale is None else 16) == 0:
        return _relu_square_mm_cuda(a.contiguous(), b.contiguous(), post, tile, fp8, act_scale)
    s = mm(a, b.mT) if fp8 is None else fp8_mm(*fp8)
    # without the kernel on a GPU (an RTX 4090's FP8 MLP), the epilogue compiled: eager inside this op, its
    # passes over the product (9 forward, 6 backward) cost more than the GEMMs (records/2026-12-07_flags-alone-h100)
    return (compiled_relu_square_epilogue() if on_gpu(s) else relu_square_epilogue)(s, post, act_scale)


def relu_square_epilogue(s: Tensor, post: Optional[Tensor], act_scale: Optional[Tensor]):
    """relu_square_mm's rule after its product s: relu(s)^2, with post 2 sqrt(post) s, with act_scale also
    post's fp8_post copy and its largest value; in fp32 (float64 for float64), rounded once to s's dtype."""
    f = torch.promote_types(s.dtype, torch.float32)  # bf16's in fp32, float64's in float64
    if post is not None:
        return (2 * post.to(f).sqrt() * s.to(f)).to(s.dtype)
    post = F.relu(s.to(f)).square().to(s.dtype)
    if act_scale is None:
        return post
    return post, fp8_post(post, act_scale), post.amax().float().reshape(1)


@functools.cache
def compiled_relu_square_epilogue(backend: str = "inductor"):
    """relu_square_epilogue as one compiled graph, a pass or two over the product where eager takes six to nine.
    It runs inside the custom ops, which the model's torch.compile sees only as their fake kernels: compiled apart."""
    return torch.compile(relu_square_epilogue, dynamic=False, fullgraph=True, backend=backend)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _relu_square_mm_cuda(a: Tensor, b: Tensor, post, tile, fp8: tuple = None, act_scale: Tensor = None):
    (M, K), N = a.shape, b.size(0)
    bm, bn, bk, warps, stages, split, ws, per_sm = tile
    out = a.new_empty(M, N)
    programs = min(per_sm * sm_count(a.device.index), triton.cdiv(M, bm) * triton.cdiv(N, bn))
    scale = None
    if fp8 is not None:  # the kernel reads the e4m3 operands and multiplies the sums by the scale
        a, b, scale = fp8[0].contiguous(), fp8[1].contiguous(), fp8[2]
    a_desc, b_desc, out_desc = (TensorDescriptor.from_tensor(t, block) for t, block in
                                ((a, [bm, bk]), (b, [bn, bk]), (out, [bm, bn // split])))
    post_desc = None if post is None else TensorDescriptor.from_tensor(post.contiguous(), [bm, bn // split])
    post_f8 = top = f8_desc = None
    if act_scale is not None:  # post's e4m3 copy beside it, and its largest value (atomic max of non-negatives)
        post_f8, top = out.new_empty(M, N, dtype=torch.float8_e4m3fn), out.new_zeros(1, dtype=torch.float32)
        f8_desc = TensorDescriptor.from_tensor(post_f8, [bm, bn // split])
    _relu_square_mm_kernel[(programs,)](a_desc, b_desc, out_desc, post_desc, scale, f8_desc, act_scale, top, M, N,
                                        K, PROGRAMS=programs, BM=bm, BN=bn, BK=bk, SPLIT=split, WS=bool(ws),
                                        num_warps=warps, num_stages=stages)
    return out if act_scale is None else (out, post_f8, top)


# QK-norm and RoPE of q and k (norm, then rotary) as one op on GPU, a hand-written kernel each way: twice as fast
# as inductor's, which re-read rows and tables (records/2026-12-03_speed4-h200)

@torch.library.custom_op("train_gpt::qk_norm_rotary", mutates_args=())
def qk_norm_rotary(qk: Tensor, cos: Tensor, sin: Tensor, scale: Tensor, paired: bool) -> tuple[Tensor, Tensor]:
    """CUDA and bf16 only (norm_rotary_qk() holds the torch rule): qk (B, T, 2 heads, head_dim), q's heads then
    k's, to q (times scale) and k, each rotary(norm(.)) as (B, T, heads, head_dim); cos, sin: Rotary's tables
    (contiguous rows of head_dim/2 angles); paired: heads at paired_positions."""
    B, T, H2, D = qk.shape
    rows = B * T * H2 // 2
    qk = qk if qk.stride(-1) == 1 else qk.contiguous()
    q, k = (qk.new_empty(B, T, H2 // 2, D) for _ in range(2))
    for x, y, scaled in zip(qk.chunk(2, dim=2), (q, k), (True, False)):
        _qk_norm_rotary_fwd[(triton.cdiv(rows, QK_ROWS),)](x, cos, sin, scale, y, rows, T, *x.stride()[:3], FP32_EPS,
                                                           HEADS=H2 // 2, D=D, BLOCK_R=QK_ROWS, PAIRED=paired,
                                                           SCALED=scaled, num_warps=4)
    return q, k


@qk_norm_rotary.register_fake
def _(qk, cos, sin, scale, paired):
    B, T, H2, D = qk.shape
    return qk.new_empty(B, T, H2 // 2, D), qk.new_empty(B, T, H2 // 2, D)


@torch.library.custom_op("train_gpt::qk_norm_rotary_backward", mutates_args=())
def qk_norm_rotary_backward(qk: Tensor, dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, scale: Tensor,
                            paired: bool) -> Tensor:
    """The grad of qk_norm_rotary's input from those of its outputs (any strides), recomputing the norm."""
    B, T, H2, D = qk.shape
    rows = B * T * H2 // 2
    dqk = qk.new_empty(qk.shape)
    qk, dq, dk = (t if t.stride(-1) == 1 else t.contiguous() for t in (qk, dq, dk))
    for x, g, dx, scaled in zip(qk.chunk(2, dim=2), (dq, dk), dqk.chunk(2, dim=2), (True, False)):
        _qk_norm_rotary_bwd[(triton.cdiv(rows, QK_ROWS),)](x, g, cos, sin, scale, dx, rows, T, *x.stride()[:3],
                                                           *g.stride()[:3], *dx.stride()[:3], FP32_EPS,
                                                           HEADS=H2 // 2, D=D, BLOCK_R=QK_ROWS, PAIRED=paired,
                                                           SCALED=scaled, num_warps=4)
    return dqk


@qk_norm_rotary_backward.register_fake
def _(qk, dq, dk, cos, sin, scale, paired):
    return qk.new_empty(qk.shape)


def _qk_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.paired = inputs[4]


def _qk_grad(ctx, dq, dk):
    qk, cos, sin, scale = ctx.saved_tensors
    return qk_norm_rotary_backward(qk, dq, dk, cos, sin, scale, ctx.paired), None, None, None, None


qk_norm_rotary.register_autograd(_qk_grad, setup_context=_qk_setup)


@torch.library.custom_op("train_gpt::window_attention", mutates_args=())
def window_attention(q: Tensor, k: Tensor, v: Tensor, first: Tensor, tiles: list[int]) -> tuple[Tensor, Tensor]:
    """CUDA only (attention() holds the torch rule, SDPA over dense_attention_mask): softmax attention of q, k, v
    (N, H, D) at unit scale where query n sees the keys first[n]..n (first: (N,) int32, rising, as
    first_visible makes it); returns the output and each (query, head)'s log-sum-exp (N, H) fp32, in base 2,
    which the backward reuses. tiles: KernelSettings.attn_tiles end to end. A program per query tile walks
    the key tiles from its first query's first key to itself: those before its last query's first key and
    its own diagonal masked by mask_rule, the ones between whole (no block tables: first only rises)."""
    N, H, D = q.shape
    n = len(ATTN_TILE)
    fwd, dq, dkdv = (tiles[i * n:(i + 1) * n] for i in range(3))
    assert N % max(*fwd[:2], *dq[:2], *dkdv[:2]) == 0, "whole tiles only: sequences are in 128s"
    # the key ranges step in tiles that the query tile holds whole (forward, dq), and the query ranges in tiles
    # that the key tile holds (dk/dv)
    assert fwd[0] % fwd[1] == 0 and dq[0] % dq[1] == 0 and dkdv[1] % dkdv[0] == 0, tiles
    bm, bn, warps, stages, tma = fwd
    out, lse = torch.empty_like(q), q.new_empty(N, H, dtype=torch.float32)
    k_in, v_in = (_attn_rows(t, bn) for t in (k, v)) if tma else (k, v)
    _attn_fwd_kernel[(N // bm, H)](q, k_in, v_in, first, out, lse, *_attn_strides(q, k, v, out), H=H, D=D, BM=bm,
                                   BN=bn, TMA=bool(tma), num_warps=warps, num_stages=stages)
    return out, lse


@window_attention.register_fake
def _(q, k, v, first, tiles):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("train_gpt::window_attention_backward", mutates_args=())
def window_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, g: Tensor, first: Tensor,
                              tiles: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """The grads of window_attention's q, k, v from its output's g, as FlashAttention-2 finds them: a query-side
    kernel (dq, and each row's sum of out * g, which it stores) over the forward's key tiles, then a key-side
    one (dk, dv) over the query tiles that see its keys, whose ends it reads from first by two searchsorted
    calls. No atomics: the same grads every run."""
    N, H, D = q.shape
    n = len(ATTN_TILE)
    (bm, bn, warps, stages, tma), (bm2, bn2, warps2, stages2, tma2) = tiles[n:2 * n], tiles[2 * n:3 * n]
    g = g.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    k_in, v_in = (_attn_rows(t, bn) for t in (k, v)) if tma else (k, v)
    _attn_dq_kernel[(N // bm, H)](q, k_in, v_in, out, g, first, lse, delta, dq, *_attn_strides(q, k, v, out, g, dq),
                                  H=H, D=D, BM=bm, BN=bn, TMA=bool(tma), num_warps=warps, num_stages=stages)
    # per key tile: the end of the queries that see any of its keys, and of those that see all of them
    last_key = torch.arange(bn2 - 1, N, bn2, device=q.device, dtype=first.dtype)
    q_end = torch.searchsorted(first, last_key, right=True).int()
    q_full = torch.searchsorted(first, last_key - (bn2 - 1), right=True).int()
    q_in, g_in = (_attn_rows(t, bm2) for t in (q, g)) if tma2 else (q, g)
    _attn_dkdv_kernel[(N // bn2, H)](q_in, k, v, g_in, first, lse, delta, q_end, q_full, dk, dv, N,
                                     *_attn_strides(q, k, v, g, dk, dv), H=H, D=D, BM=bm2, BN=bn2, TMA=bool(tma2),
                                     num_warps=warps2, num_stages=stages2)
    return dq, dk, dv


@window_attention_backward.register_fake
def _(q, k, v, out, lse, g, first, tiles):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attn_rows(t: Tensor, rows: int):
    """A TMA descriptor of (N, H, D) t as the (N, H D) matrix of its tokens, in tiles of rows tokens by one head:
    head h of the tokens from n0 is the tile at [n0, h D] (the heads lie D apart, as the model's views have them)."""
    N, H, D = t.shape
    assert t.stride(1) == D and t.stride(2) == 1, t.stride()
    return TensorDescriptor(t, [N, H * D], [t.stride(0), 1], [rows, D])


def _attn_strides(*tensors) -> list:
    """The token and head strides of (N, H, D) tensors whose last dim is contiguous, as the kernels take them."""
    assert all(t.stride(-1) == 1 for t in tensors)
    return [t.stride(0) for t in tensors] + [t.stride(1) for t in tensors]


def _attn_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4], *output)
    ctx.tiles = inputs[4]


def _attn_grad(ctx, g, _):
    q, k, v, first, out, lse = ctx.saved_tensors
    return *window_attention_backward(q, k, v, out, lse, g, first, ctx.tiles), None, None


window_attention.register_autograd(_attn_grad, setup_context=_attn_setup)


@torch.library.custom_op("train_gpt::dc_mix", mutates_args=())
def dc_mix(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, first: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """CUDA and bf16 only (dc_correction holds the torch rule): DC's correction of q, k, v (N, H, D), per query
    and head mixes a (rms-normed) and b (N, H) fp32 and first (N,); and each (query, head)'s log-sum-exp over
    its window (N, H) fp32, which the backward reuses. One program per DC_KERNEL_TILES[0] queries, against
    the keys from window - 1 before them to their last."""
    N, H, D = q.shape
    bm = DC_KERNEL_TILES[0]
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse = q.new_empty(N, H, D), q.new_empty(N, H, dtype=torch.float32)
    _dc_fwd_kernel[(N // bm,)](q, k, v, a.contiguous(), b.contiguous(), first.contiguous(), out, lse, H=H, D=D,
                              BM=bm, BK=triton.next_power_of_2(bm + window - 1), num_warps=4)
    return out, lse


@dc_mix.register_fake
def _(q, k, v, a, b, first, window):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("train_gpt::dc_mix_backward", mutates_args=())
def dc_mix_backward(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, first: Tensor, lse: Tensor, g: Tensor,
                    window: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The grads of dc_mix's q, k, v, a and b from its output's g. A query-side pass (one program per
    DC_KERNEL_TILES[0] queries) finds q's, a's and b's and stores the mixed weights and their grads per
    (query, distance back); a key-side pass (one per DC_KERNEL_TILES[1] keys, and head with DC_KV_HEADS_IN_GRID,
    over the query tiles that see them) sums k's and v's: no atomics, so the same grads every run."""
    N, H, D = q.shape
    bm, bn, bq = DC_KERNEL_TILES
    q, k, v, a, b, g = (t.contiguous() for t in (q, k, v, a, b, g))
    dq, dk, dv = (q.new_empty(N, H, D) for _ in range(3))
    da, db = (a.new_empty(N, H) for _ in range(2))
    mixed, dmixed = (a.new_empty(N, window) for _ in range(2))
    _dc_bwd_q_kernel[(N // bm,)](q, k, v, a, b, first, lse, g, dq, da, db, mixed, dmixed, H=H, D=D, BM=bm,
                                 BK=triton.next_power_of_2(bm + window - 1), W=window, num_warps=4)
    grid = (triton.cdiv(N, bn), H if DC_KV_HEADS_IN_GRID else 1)
    _dc_bwd_kv_kernel[grid](q, k, a, b, first, lse, g, da, mixed, dmixed, dk, dv, N, H=H, D=D, BN=bn, BQ=bq,
                            NQ=triton.cdiv(bn + window - 1, bq), W=window, HEADS_IN_GRID=DC_KV_HEADS_IN_GRID,
                            num_warps=DC_KV_WARPS)
    return dq, dk, dv, da, db


@dc_mix_backward.register_fake
def _(q, k, v, a, b, first, lse, g, window):
    return (*(q.new_empty(q.shape) for _ in range(3)), *(a.new_empty(a.shape) for _ in range(2)))


def _dc_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6], output[1])
    ctx.window = inputs[6]


def _dc_grad(ctx, g, _):
    q, k, v, a, b, first, lse = ctx.saved_tensors
    return *dc_mix_backward(q, k, v, a, b, first, lse, g, ctx.window), None, None


dc_mix.register_autograd(_dc_grad, setup_context=_dc_setup)


def _softcap_ce_cuda(z: Tensor, targets: Tensor, weights: Tensor, grad_s: float, launch, approx: bool,
                     seq_len: int, out: tuple = None, prefix: Tensor = None, row0: int = 0):
    T, V = z.shape
    loss, ntp, g = out or ce_outputs(T, V, z.device)
    block_t, block_v, warps = launch
    assert weights.numel() == MTP_TOKENS + (prefix is not None) and weights.dtype == torch.float32
    assert all(t.is_contiguous() for t in (loss, ntp, g, targets)) and g.shape == z.shape
    top = E5M2_MAX if g.dtype == torch.float8_e5m2 else torch.finfo(g.dtype).max  # e5m2 saturates, not NaN
    _softcap_ce_kernel[(triton.cdiv(T, block_t),)](z, targets, weights.contiguous(), loss, ntp, g, T, targets.numel(),
                                                   row0, seq_len, 1 / grad_s,
                                                   targets if prefix is None else prefix.contiguous(),
                                                   V=V, CAP=SOFTCAP, SHIFT=SOFTCAP_SHIFT, DIV=SOFTCAP_DIV,
                                                   TOP=top, BLOCK_T=block_t, BLOCK_V=block_v, APPROX=approx,
                                                   PREFIX=prefix is not None, WHOLE_ROWS=T % block_t == 0,
                                                   num_warps=warps)
    return loss, ntp, g


def rehearse_kernels(trainer: "Trainer"):
    """Launch each of the model's hand-written kernels once, on zeros shaped as one micro-step's tensors (scratch:
    none of the model's state), so that Triton compiles them here, on KernelRehearsal's thread, while the main
    thread traces the first step; the compiled graphs' first run then finds them built. On the warm-up's path
    their compiles took 3.9-6.6 s, now 0.7-1.0 s (records/2026-12-06_rehearsal-h100-h200). Triton specializes
    a kernel on its ints' divisibility and its pointers' alignment: a launch the training makes otherwise just
    compiles there, as it would without this. The optimizer's kernels compile at its first step."""
    cfg, model, settings, device = trainer.cfg, trainer.model, trainer.kernels, trainer.device
    torch.cuda.set_device(device)  # a new thread starts on device 0
    B, T, dim, V, rot = trainer.micro_batch, cfg.seq_len, cfg.model_dim, cfg.vocab_size, model.rotary
    zeros = partial(torch.zeros, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        if model.dc_window:  # first: its key side's compile is the longest (35 s, records/2026-12-07_muddgate-dc-h100)
            N, H, D = B * T, cfg.num_heads, cfg.head_dim
            q, a = zeros(N, H, D), torch.zeros(N, H, device=device)
            first = first_visible(torch.zeros(N, dtype=torch.long, device=device), model.dc_window - 1)
            _, lse = dc_mix(q, q, q, a, a, first, model.dc_window)
            dc_mix_backward(q, q, q, a, a, first, lse, q, model.dc_window)
        if settings.attn_tiles:  # paired heads attend over twice the tokens, with half the heads
            tiles, N, H = list(settings.attn_launch()), B * T, cfg.num_heads
            for n, h in {(2 * N, H // 2) if b.paired else (N, H) for b in model.blocks if b.attn is not None}:
                q, first = zeros(n, h, cfg.head_dim), torch.zeros(n, dtype=torch.int32, device=device)
                out, lse = window_attention(q, q, q, first, tiles)
                window_attention_backward(q, q, q, out, lse, q, first, tiles)
        qk = zeros(B, T, 2 * cfg.num_heads, cfg.head_dim)  # as Attention.forward's matmul makes it
        for paired in {block.paired for block in model.blocks if block.attn is not None}:
            q, k = qk_norm_rotary(qk, rot.cos, rot.sin, rot.scale, paired)
            qk_norm_rotary_backward(qk, q, k, rot.cos, rot.sin, rot.scale, paired)
        if settings.mlp_tiles:
            tiles, x, w = settings.mlp_launch(), zeros(B, T, dim), zeros(4 * dim, dim)
            _, post, _ = relu_square_mlp(x, w, w, tiles)
            relu_square_grad(x.view(-1, dim), w, post, tiles[len(MLP_TILE):])  # as the op's backward reads them
            if cfg.fp8_mlp:  # the training's forward; validation's is the bf16 one above
                f8 = partial(torch.zeros, device=device, dtype=torch.float8_e4m3fn)
                one = torch.ones(1, device=device)
                down = (f8(dim, 4 * dim), one, one) if model.fp8_down_scales is not None else ()
                relu_square_mlp(x, w, w, settings.mlp_launch(fp8=True, down=bool(down)), f8(B * T, dim),
                                f8(4 * dim, dim), one, *down)
        if model.fp8_head:  # one sequence: the CE kernel's launches are a sequence's at any B, and a pass's grads
            # (6.6 GB at four 16K sequences) beside the first step raised the peak (records/2026-12-06_peak-h100)
            x, w = zeros(T, dim), zeros(V, dim)
            x_f8, w_f8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            targets = torch.zeros(T, dtype=torch.long, device=device)
            launch = list(settings.head_launch())
            prefix = targets if model.prefix_table is not None else None  # the training's variant of the CE kernel
            weights = torch.zeros(MTP_TOKENS + (prefix is not None), device=device)
            *_, g, g_t = fp8_head_loss(x, w, x_f8, w_f8, targets, weights, T, launch, settings.ce_tanh_approx, prefix)
            fp8_mm_backward(g, g_t, x_f8, w_f8, launch)
        else:  # the bf16 head's variant of the CE kernel (bf16 grad), on one chunk of rows (softcap_head_chunks)
            rows = min(HEAD_CHUNK_ROWS, B * T)
            z, per_row = zeros(rows, V), torch.zeros(2, rows, device=device)
            targets = torch.zeros(B * T, dtype=torch.long, device=device)
            prefix = targets if model.prefix_table is not None else None
            weights = torch.zeros(MTP_TOKENS + (prefix is not None), device=device)
            _softcap_ce_cuda(z, targets, weights, 1.0, settings.head_launch()[:3], settings.ce_tanh_approx, T,
                             (*per_row, z), prefix)


class KernelRehearsal(threading.Thread):
    """rehearse_kernels on a thread of its own, started before the warm-up's first step. Triton's compiles
    overlap the trace where they leave the GIL (LLVM's passes, ptxas in a subprocess)."""

    def __init__(self, trainer: "Trainer"):
        super().__init__(name="kernel_rehearsal", daemon=True)
        self.trainer, self.error = trainer, None
        self.start()

    def run(self):
        try:
            rehearse_kernels(self.trainer)
        except Exception as e:  # the training's own launch meets the same failure, in its step, with its traceback
            self.error = e

    def finish(self):
        self.join()
        if self.error is not None:
            self.trainer.log(log_line(note="kernel_rehearsal_failed", why=type(self.error).__name__))


if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): the kernels' exponentials are base 2 (exp2)

    @triton.jit
    def _tanh(x, APPROX: tl.constexpr):
        """tanh in one special-function-unit op (tanh.approx, max relative error 2^-10.99) or, exactly, in two."""
        if APPROX:
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return 2.0 / (1.0 + tl.exp2(x * (-2.0 * LOG2E))) - 1.0  # 2 sigmoid(2x) - 1

    @triton.jit
    def _cap_tanh(z, SHIFT: tl.constexpr, DIV: tl.constexpr, APPROX: tl.constexpr):
        """tanh((z + SHIFT) / (2 DIV)), its argument in one fused multiply-add: the capped logit is
        (tanh + 1) CAP/2."""
        return _tanh(z * (0.5 / DIV) + SHIFT * (0.5 / DIV), APPROX)

    @triton.jit
    def _capped_tanh(z_ptr, rows, t, live, V: tl.constexpr, SHIFT: tl.constexpr, DIV: tl.constexpr,
                     APPROX: tl.constexpr):
        """_cap_tanh at column t of each row."""
        return _cap_tanh(tl.load(z_ptr + rows * V + t, mask=live, other=0.0).to(tl.float32), SHIFT, DIV, APPROX)

    @triton.jit
    def _softcap_ce_tile(z_ptr, at, v0, V: tl.constexpr, BLOCK_V: tl.constexpr, TAIL: tl.constexpr):
        """Rows at's columns v0 .. v0 + BLOCK_V of z in fp32, and where they lie in the vocab (TAIL: the last
        tile, masked at the vocab's end; else all columns are inside and nothing is masked)."""
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        inside = (cols < V)[None, :]
        if TAIL:
            z = tl.load(z_ptr + at[:, None] * V + cols[None, :], mask=inside, other=0.0)
        else:
            z = tl.load(z_ptr + at[:, None] * V + cols[None, :])
        return z.to(tl.float32), cols, inside

    @triton.jit
    def _softcap_ce_exp(z_ptr, at, v0, V: tl.constexpr, SHIFT: tl.constexpr, DIV: tl.constexpr,
                        HALF_CAP2: tl.constexpr, BLOCK_V: tl.constexpr, APPROX: tl.constexpr, TAIL: tl.constexpr):
        """exp(c - CAP) over one tile of columns (0 past the vocab's end)."""
        z, cols, inside = _softcap_ce_tile(z_ptr, at, v0, V, BLOCK_V, TAIL)
        e = tl.exp2(_cap_tanh(z, SHIFT, DIV, APPROX) * HALF_CAP2 - HALF_CAP2)
        if TAIL:
            e = tl.where(inside, e, 0.0)
        return e

    @triton.jit
    def _softcap_ce_grad(z_ptr, g_ptr, rows, at, live, v0, row_scale, row_shift, V: tl.constexpr, SHIFT: tl.constexpr,
                         DIV: tl.constexpr, HALF_CAP2: tl.constexpr, TOP: tl.constexpr, BLOCK_V: tl.constexpr,
                         APPROX: tl.constexpr, TAIL: tl.constexpr, WHOLE_ROWS: tl.constexpr):
        """One tile of the grad as if none of its columns were a target (the kernel writes those again):
        softmax(c) (1 - t^2) = exp2(t HALF_CAP2 + row_shift) (1 - t^2) times row_scale, the row's weight sum in
        the grad's units."""
        z, cols, inside = _softcap_ce_tile(z_ptr, at, v0, V, BLOCK_V, TAIL)
        th = _cap_tanh(z, SHIFT, DIV, APPROX)
        g = tl.exp2(th * HALF_CAP2 + row_shift[:, None]) * (1.0 - th * th) * row_scale[:, None]
        g = tl.minimum(tl.maximum(g, -TOP), TOP).to(g_ptr.dtype.element_ty)
        at_g = g_ptr + rows[:, None] * V + cols[None, :]
        if WHOLE_ROWS:
            if TAIL:
                tl.store(at_g, g, mask=inside)
            else:
                tl.store(at_g, g)
        else:
            if TAIL:
                tl.store(at_g, g, mask=live[:, None] & inside)
            else:
                tl.store(at_g, g, mask=live[:, None])

    @triton.jit
    def _softcap_ce_target_grad(g_ptr, rows, t, th, live, terms, V: tl.constexpr, HALF_CAP2: tl.constexpr,
                                TOP: tl.constexpr, PREFIX: tl.constexpr):
        """The grad at each row's target column t (where live) with the terms of every target that is t: the
        same value whichever of them writes it. terms: the rows' weight sum, the grad's units (dc/dz's constant
        with them), the tiles' row_shift, then each target and its weight."""
        weight_sum, scale, row_shift, t0, w0, t1, w1, t2, w2, tp, wp = terms
        dc = weight_sum * tl.exp2(th * HALF_CAP2 + row_shift)
        dc -= tl.where(t0 == t, w0, 0.0)
        dc -= tl.where(t1 == t, w1, 0.0)
        dc -= tl.where(t2 == t, w2, 0.0)
        if PREFIX:
            dc -= tl.where(tp == t, wp, 0.0)
        g = dc * (1.0 - th * th) * scale
        tl.store(g_ptr + rows * V + t, tl.minimum(tl.maximum(g, -TOP), TOP).to(g_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _softcap_ce_kernel(z_ptr, targets_ptr, weights_ptr, loss_ptr, ntp_ptr, g_ptr, T, N, row0, S, inv_grad_s,
                           prefix_ptr,
                           V: tl.constexpr, CAP: tl.constexpr, SHIFT: tl.constexpr, DIV: tl.constexpr,
                           TOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, APPROX: tl.constexpr,
                           PREFIX: tl.constexpr, WHOLE_ROWS: tl.constexpr):
        """Rows [pid*BLOCK_T, +BLOCK_T) of softcap_ce_rows: a pass over the vocab for the log-sum-exp, a second
        that writes each (BLOCK_T x BLOCK_V) tile of the grad (e5m2 or bf16: g's dtype) as if no column were a
        target, then each row's target columns again, with their terms. Row r of z's T rows is row row0 + r of
        the N rows that targets (and prefix) hold, sequences of S rows end to end. The cap is written with
        tanh, sigmoid(u) = (1 + tanh(u/2)) / 2, so c - CAP = CAP/2 (t - 1) and dc/dz = CAP/(4 DIV) (1 - t^2).
        Exponentials are base 2 with log2(e) folded into the constants, and no running max is kept: the capped
        logits lie in (0, CAP), so exp(c - CAP) lies in (e^-CAP, 1] and a sum of them cannot overflow fp32. The
        next 3 tokens' targets (k = 0, 1, 2, those in the row's sequence of S rows) carry weights[k]; with
        PREFIX, each row's prefix token (prefix_ptr, -1 for none) weights[3]. Only the vocab's last tile is
        masked, and rows past T (none where WHOLE_ROWS: BLOCK_T divides T) read row T - 1 and store nothing:
        per element, the targets' compares and the masks were about half of the second pass's instructions."""
        HALF_CAP2: tl.constexpr = 0.5 * CAP * LOG2E  # c - CAP in base-2 units, per unit of (t - 1)
        V_WHOLE: tl.constexpr = V // BLOCK_V * BLOCK_V  # the columns of whole tiles
        rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # offsets pass 2^31
        live = rows < T
        at = tl.minimum(rows, T - 1)  # the row each reads
        pos = rows + row0  # the row's index into targets, and so its place in its sequence
        s = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)  # summed across the row once, after the loop
        for v0 in range(0, V_WHOLE, BLOCK_V):
            s += _softcap_ce_exp(z_ptr, at, v0, V, SHIFT, DIV, HALF_CAP2, BLOCK_V, APPROX, False)
        if V_WHOLE < V:
            s += _softcap_ce_exp(z_ptr, at, V_WHOLE, V, SHIFT, DIV, HALF_CAP2, BLOCK_V, APPROX, True)
        lse2 = CAP * LOG2E + tl.log2(tl.sum(s, axis=1))  # log2 of sum(exp(c))
        live1 = live & (pos % S + 1 < S) & (pos + 1 < N)
        live2 = live & (pos % S + 2 < S) & (pos + 2 < N)
        t0 = tl.load(targets_ptr + pos, mask=live, other=0).to(tl.int64)
        t1 = tl.load(targets_ptr + pos + 1, mask=live1, other=-1).to(tl.int64)
        t2 = tl.load(targets_ptr + pos + 2, mask=live2, other=-1).to(tl.int64)
        w0 = tl.load(weights_ptr)
        w1 = tl.where(live1, tl.load(weights_ptr + 1), 0.0)
        w2 = tl.where(live2, tl.load(weights_ptr + 2), 0.0)
        th0 = _capped_tanh(z_ptr, rows, t0, live, V, SHIFT, DIV, APPROX)
        th1 = _capped_tanh(z_ptr, rows, t1, live1, V, SHIFT, DIV, APPROX)
        th2 = _capped_tanh(z_ptr, rows, t2, live2, V, SHIFT, DIV, APPROX)
        c0 = (th0 + 1.0) * HALF_CAP2  # capped logits in base-2 units
        tl.store(ntp_ptr + rows, (lse2 - c0) / LOG2E, mask=live)
        loss = w0 * (lse2 - c0) + w1 * (lse2 - (th1 + 1.0) * HALF_CAP2) + w2 * (lse2 - (th2 + 1.0) * HALF_CAP2)
        weight_sum = w0 + w1 + w2
        tp = tl.full((BLOCK_T,), -1, tl.int64)  # no prefix token, no weight: the target fixes' terms, unless PREFIX
        wp = tl.zeros((BLOCK_T,), tl.float32)
        thp = wp
        if PREFIX:
            tp = tl.load(prefix_ptr + pos, mask=live, other=-1).to(tl.int64)
            livep = live & (tp >= 0)
            wp = tl.where(livep, tl.load(weights_ptr + 3), 0.0)
            thp = _capped_tanh(z_ptr, rows, tp, livep, V, SHIFT, DIV, APPROX)
            loss += wp * (lse2 - (thp + 1.0) * HALF_CAP2)
            weight_sum += wp
        tl.store(loss_ptr + rows, loss / LOG2E, mask=live)
        scale = inv_grad_s * CAP / (4.0 * DIV)  # dc/dz = CAP/(4 DIV) (1 - t^2), in the grad's units
        row_scale = weight_sum * scale
        row_shift = -lse2 + HALF_CAP2  # c - lse in base 2 is t HALF_CAP2 + row_shift
        for v0 in range(0, V_WHOLE, BLOCK_V):
            _softcap_ce_grad(z_ptr, g_ptr, rows, at, live, v0, row_scale, row_shift, V, SHIFT, DIV, HALF_CAP2, TOP,
                             BLOCK_V, APPROX, False, WHOLE_ROWS)
        if V_WHOLE < V:
            _softcap_ce_grad(z_ptr, g_ptr, rows, at, live, V_WHOLE, row_scale, row_shift, V, SHIFT, DIV, HALF_CAP2,
                             TOP, BLOCK_V, APPROX, True, WHOLE_ROWS)
        tl.debug_barrier()  # the tiles' stores, by whichever of the program's threads, land before these
        terms = (weight_sum, scale, row_shift, t0, w0, t1, w1, t2, w2, tp, wp)
        _softcap_ce_target_grad(g_ptr, rows, t0, th0, live, terms, V, HALF_CAP2, TOP, PREFIX)
        _softcap_ce_target_grad(g_ptr, rows, t1, th1, live1, terms, V, HALF_CAP2, TOP, PREFIX)
        _softcap_ce_target_grad(g_ptr, rows, t2, th2, live2, terms, V, HALF_CAP2, TOP, PREFIX)
        if PREFIX:
            _softcap_ce_target_grad(g_ptr, rows, tp, thp, livep, terms, V, HALF_CAP2, TOP, PREFIX)

    @triton.jit
    def _relu_square_mm_kernel(a_desc, b_desc, c_desc, post_desc, scale_ptr, f8_desc, act_scale_ptr, top_ptr, M, N,
                               K, PROGRAMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                               SPLIT: tl.constexpr, WS: tl.constexpr):
        """Persistent: program p makes output tiles p, p + PROGRAMS, ... (row-major over the tile grid, so the
        programs at work share b's tiles in L2) of s = a @ b.T, a (M, K) and b (N, K) through tensor
        descriptors (bf16, or e4m3 with the sums times the fp32 at scale_ptr), and stores each in SPLIT (1, 2
        or 4) blocks of columns (less registers and staging memory at once): c = relu(s)^2 without post_desc
        (forward), else c = 2 sqrt(post) s. With f8_desc (forward) also c's e4m3 copy, min(c / act scale,
        448), and c's largest value atomically maxed into top_ptr's fp32 (c >= 0: max is order-free)."""
        tiles_n = tl.cdiv(N, BN)
        inv = 0.0
        if f8_desc is not None:
            inv = tl.div_rn(1.0, tl.load(act_scale_ptr))  # rounded as torch's reciprocal (fp8_post)
        top = 0.0
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, PROGRAMS, flatten=True, warp_specialize=WS):
            row, col = (tile // tiles_n) * BM, (tile % tiles_n) * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K, BK):
                acc = tl.dot(a_desc.load([row, k]), b_desc.load([col, k]).T, acc)
            if scale_ptr is not None:
                acc = acc * tl.load(scale_ptr)
            if SPLIT == 1:
                top = tl.maximum(top, _relu_square_epilogue(acc, c_desc, post_desc, f8_desc, inv, row, col))
            else:
                left, right = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
                if SPLIT == 2:
                    top = tl.maximum(top, _relu_square_epilogue(left, c_desc, post_desc, f8_desc, inv, row, col))
                    top = tl.maximum(top, _relu_square_epilogue(right, c_desc, post_desc, f8_desc, inv, row,
                                                                 col + BN // 2))
                else:
                    q0, q1 = tl.split(tl.permute(tl.reshape(left, (BM, 2, BN // 4)), (0, 2, 1)))
                    q2, q3 = tl.split(tl.permute(tl.reshape(right, (BM, 2, BN // 4)), (0, 2, 1)))
                    top = tl.maximum(top, _relu_square_epilogue(q0, c_desc, post_desc, f8_desc, inv, row, col))
                    top = tl.maximum(top, _relu_square_epilogue(q1, c_desc, post_desc, f8_desc, inv, row,
                                                                 col + BN // 4))
                    top = tl.maximum(top, _relu_square_epilogue(q2, c_desc, post_desc, f8_desc, inv, row,
                                                                 col + BN // 2))
                    top = tl.maximum(top, _relu_square_epilogue(q3, c_desc, post_desc, f8_desc, inv, row,
                                                                 col + 3 * BN // 4))
        if f8_desc is not None:
            tl.atomic_max(top_ptr, top)

    @triton.jit
    def _relu_square_epilogue(acc, c_desc, post_desc, f8_desc, inv, row, col):
        """Stores a column block of the tile (see _relu_square_mm_kernel); returns its largest c with f8_desc,
        else 0."""
        s = acc.to(tl.bfloat16).to(tl.float32)  # what a bf16 GEMM writes
        if post_desc is None:
            r = tl.maximum(s, 0.0)
            c = r * r
        else:  # Triton's fast square root: its error is far inside bf16's rounding
            c = 2.0 * tl.sqrt(post_desc.load([row, col]).to(tl.float32)) * s
        c = c.to(tl.bfloat16)
        c_desc.store([row, col], c)
        top = 0.0
        if f8_desc is not None:  # from c as stored, as fp8_post makes it from post
            c = c.to(tl.float32)
            f8_desc.store([row, col], tl.minimum(c * inv, 448.0).to(tl.float8e4nv))
            top = tl.max(tl.max(c, axis=1), axis=0)
        return top

    @triton.jit
    def _transpose_bytes_kernel(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """dst (C x R) = src (R x C) transposed, for 1-byte elements: a tile is read in rows and written in
        columns."""
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
        inside = (r[:, None] < R) & (c[None, :] < C)
        tile = tl.load(src_ptr + r[:, None] * C + c[None, :], mask=inside)
        tl.store(dst_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=tl.trans(inside))

    @triton.jit
    def _add_into_fp32_kernel(acc_ptr, g_ptr, n, BLOCK: tl.constexpr):
        """acc[i] += g[i] for fp32 acc and a narrower g, in one pass over both."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        acc = tl.load(acc_ptr + i, mask=live)
        tl.store(acc_ptr + i, acc + tl.load(g_ptr + i, mask=live).to(tl.float32), mask=live)

    @triton.jit
    def _add_rows_into_fp32_kernel(acc_ptr, ids_ptr, rows_ptr, n, dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """acc[ids[i], :] += rows[i, :] for this program's block of rows i and columns: relaxed atomics (the
        adds' order is free, as index_add_'s), which Triton issues four fp32 columns at a time on Hopper."""
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = (i < n)[:, None] & (d < dim)[None, :]
        dst = tl.load(ids_ptr + i, mask=i < n).to(tl.int64)
        g = tl.load(rows_ptr + i[:, None].to(tl.int64) * dim + d[None, :], mask=live).to(tl.float32)
        tl.atomic_add(acc_ptr + dst[:, None] * dim + d[None, :], g, mask=live, sem="relaxed")

    @triton.jit
    def _run_sum(f1, v1, f2, v2):
        """A segmented sum's step: v2 starts a new run where its flag is set."""
        return f1 | f2, tl.where(f2 != 0, v2, v1 + v2)

    @triton.jit
    def _add_sorted_rows_into_fp32_kernel(acc_ptr, sorted_ptr, source_ptr, rows_ptr, n, dim, BLOCK_R: tl.constexpr,
                                          BLOCK_D: tl.constexpr):
        """acc[sorted[j], :] += rows[source[j], :] for this program's block of sorted positions j and columns:
        each run of equal ids within the block summed in fp32 (a segmented scan), then one relaxed atomic add
        per run (a run that crosses blocks adds once from each)."""
        first = tl.program_id(0) * BLOCK_R
        j = first + tl.arange(0, BLOCK_R)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        inside = j < n
        live = inside[:, None] & (d < dim)[None, :]
        ids = tl.load(sorted_ptr + j, mask=inside, other=-1).to(tl.int64)
        before = tl.load(sorted_ptr + j - 1, mask=inside & (j > first), other=-2).to(tl.int64)
        after = tl.load(sorted_ptr + j + 1, mask=(j + 1 < n) & (j + 1 < first + BLOCK_R), other=-3).to(tl.int64)
        src = tl.load(source_ptr + j, mask=inside, other=0).to(tl.int64)
        g = tl.load(rows_ptr + src[:, None] * dim + d[None, :], mask=live, other=0.0).to(tl.float32)
        starts = tl.broadcast_to((ids != before).to(tl.int32)[:, None], (BLOCK_R, BLOCK_D))
        _, sums = tl.associative_scan((starts, g), 0, _run_sum)
        tl.atomic_add(acc_ptr + ids[:, None] * dim + d[None, :], sums, mask=live & (ids != after)[:, None],
                      sem="relaxed")

    @triton.jit
    def _cautious_step_kernel(p_ptr, m_ptr, g_ptr, v_ptr, n, lr, decay, w1, w2, beta2, bias1, bias2, eps,
                              ADAM: tl.constexpr, STRICT: tl.constexpr, BLOCK: tl.constexpr):
        """cautious_step_fused for this program's elements: the update is read from m_ptr, or, with ADAM, m_ptr
        and v_ptr are Adam's moments, which take in g, and the update is their direction, as torch's ops compute
        each (lerp's two formulas; a division by a scalar is a multiplication by its fp32 reciprocal)."""
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        p = tl.load(p_ptr + i, mask=live)
        u = tl.load(m_ptr + i, mask=live)
        if ADAM:
            g = tl.load(g_ptr + i, mask=live)
            v = tl.load(v_ptr + i, mask=live)
            m = tl.where(w1 < 0.5, u + w1 * (g - u), g - (g - u) * (1.0 - w1))
            v = v * beta2 + w2 * (g * g)
            tl.store(m_ptr + i, m, mask=live)
            tl.store(v_ptr + i, v, mask=live)
            u = tl.div_rn(m, tl.sqrt_rn(v * tl.div_rn(1.0, bias2)) + eps) * tl.div_rn(1.0, bias1)
        agree = u * p > 0.0 if STRICT else u * p >= 0.0
        tl.store(p_ptr + i, p - (tl.where(agree, p, 0.0) * decay + u * lr), mask=live)

    @triton.jit
    def _dc_probs(q_ptr, k_ptr, lse_ptr, q_pos, k_pos, valid, live, h, H: tl.constexpr, D: tl.constexpr):
        """Head h's softmax over each query's window (rows q_pos, columns k_pos), from its stored log-sum-exp:
        fp32 scores of the bf16 q and k, 0 outside `valid`."""
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q_pos[:, None] * H + h) * D + d[None, :], mask=live[:, None], other=0.0)
        k = tl.load(k_ptr + (k_pos[:, None] * H + h) * D + d[None, :], mask=(k_pos >= 0)[:, None], other=0.0)
        lse = tl.load(lse_ptr + q_pos * H + h, mask=live, other=0.0)
        return tl.where(valid, tl.exp(tl.dot(q, tl.trans(k)) - lse[:, None]), 0.0), q, k

    @triton.jit
    def _dc_window(first_ptr, q_pos, k_pos, live):
        """Which (query, key) pairs DC mixes: mask_rule with first, for the queries that exist."""
        first = tl.load(first_ptr + q_pos, mask=live, other=0)
        return live[:, None] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= first[:, None])

    @triton.jit
    def _dc_query_tile(first_ptr, BM: tl.constexpr, BK: tl.constexpr):
        """This program's BM queries, the BK keys up to their last, and which pairs DC mixes."""
        q_pos = tl.program_id(0) * BM + tl.arange(0, BM)
        k_pos = tl.program_id(0) * BM + BM - BK + tl.arange(0, BK)
        live = q_pos >= 0
        return q_pos, k_pos, live, _dc_window(first_ptr, q_pos, k_pos, live)

    @triton.jit
    def _dc_fwd_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, first_ptr, out_ptr, lse_ptr, H: tl.constexpr,
                       D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
        """BM queries' DC correction: each head's softmax over the window (its log-sum-exp stored), mixed over
        the heads by a; then per head b times the mix @ v. Keys from BK - BM before the first query."""
        q_pos, k_pos, live, valid = _dc_query_tile(first_ptr, BM, BK)
        d = tl.arange(0, D)
        mixed = tl.zeros((BM, BK), dtype=tl.float32)
        for h in tl.static_range(H):
            q = tl.load(q_ptr + (q_pos[:, None] * H + h) * D + d[None, :])
            k = tl.load(k_ptr + (k_pos[:, None] * H + h) * D + d[None, :], mask=(k_pos >= 0)[:, None], other=0.0)
            s = tl.where(valid, tl.dot(q, tl.trans(k)), float("-inf"))
            top = tl.max(s, axis=1)  # every query sees itself: finite
            e = tl.exp(s - top[:, None])
            total = tl.sum(e, axis=1)
            tl.store(lse_ptr + q_pos * H + h, top + tl.log(total))
            mixed += (tl.load(a_ptr + q_pos * H + h) / total)[:, None] * e
        for h in tl.static_range(H):
            v = tl.load(v_ptr + (k_pos[:, None] * H + h) * D + d[None, :], mask=(k_pos >= 0)[:, None], other=0.0)
            b = tl.load(b_ptr + q_pos * H + h)
            out = tl.dot(mixed.to(v.dtype), v) * b[:, None]  # weights rounded to v's dtype, as the record's
            tl.store(out_ptr + (q_pos[:, None] * H + h) * D + d[None, :], out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _dc_bwd_q_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, first_ptr, lse_ptr, g_ptr, dq_ptr, da_ptr, db_ptr,
                         mixed_ptr, dmixed_ptr, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                         BK: tl.constexpr, W: tl.constexpr):
        """The query side of dc_mix's backward for BM queries: with A = sum_h a_h P_h and G_h = g_h v_h^T,
        db_h = rowsum(A G_h), dA = sum_h b_h G_h, da_h = rowsum(dA P_h), dS_h = a_h P_h (dA - da_h) and
        dq_h = dS_h k_h. Stores A and dA by distance back (W columns) for the key side."""
        q_pos, k_pos, live, valid = _dc_query_tile(first_ptr, BM, BK)
        d = tl.arange(0, D)
        mixed = tl.zeros((BM, BK), dtype=tl.float32)
        for h in tl.static_range(H):
            p, _, _ = _dc_probs(q_ptr, k_ptr, lse_ptr, q_pos, k_pos, valid, live, h, H, D)
            mixed += tl.load(a_ptr + q_pos * H + h)[:, None] * p
        dmixed = tl.zeros((BM, BK), dtype=tl.float32)
        for h in tl.static_range(H):
            g = tl.load(g_ptr + (q_pos[:, None] * H + h) * D + d[None, :])
            v = tl.load(v_ptr + (k_pos[:, None] * H + h) * D + d[None, :], mask=(k_pos >= 0)[:, None], other=0.0)
            gv = tl.where(valid, tl.dot(g, tl.trans(v)), 0.0)
            tl.store(db_ptr + q_pos * H + h, tl.sum(mixed * gv, axis=1))
            dmixed += tl.load(b_ptr + q_pos * H + h)[:, None] * gv
        for h in tl.static_range(H):
            p, _, k = _dc_probs(q_ptr, k_ptr, lse_ptr, q_pos, k_pos, valid, live, h, H, D)
            da = tl.sum(dmixed * p, axis=1)
            tl.store(da_ptr + q_pos * H + h, da)
            ds = tl.load(a_ptr + q_pos * H + h)[:, None] * p * (dmixed - da[:, None])
            dq = tl.dot(ds.to(k.dtype), k)
            tl.store(dq_ptr + (q_pos[:, None] * H + h) * D + d[None, :], dq.to(dq_ptr.dtype.element_ty))
        back = q_pos[:, None] - k_pos[None, :]
        tl.store(mixed_ptr + q_pos[:, None] * W + back, mixed, mask=valid)
        tl.store(dmixed_ptr + q_pos[:, None] * W + back, dmixed, mask=valid)

    @triton.jit
    def _dc_bwd_kv_head(q_ptr, k_ptr, a_ptr, b_ptr, first_ptr, lse_ptr, g_ptr, da_ptr, mixed_ptr, dmixed_ptr, dk_ptr,
                        dv_ptr, N, h, H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                        NQ: tl.constexpr, W: tl.constexpr):
        """Head h's key side of dc_mix's backward for this program's BN keys, over the NQ tiles of BQ queries
        that can see them: dv_h = (b_h A)^T g_h and dk_h = dS_h^T q_h, from the query side's A, dA and da."""
        k_pos = tl.program_id(0) * BN + tl.arange(0, BN)
        d = tl.arange(0, D)
        dk = tl.zeros((BN, D), dtype=tl.float32)
        dv = tl.zeros((BN, D), dtype=tl.float32)
        for i in tl.static_range(NQ):
            q_pos = tl.program_id(0) * BN + i * BQ + tl.arange(0, BQ)
            live = q_pos < N
            valid = _dc_window(first_ptr, q_pos, k_pos, live) & (k_pos < N)[None, :]
            p, q, _ = _dc_probs(q_ptr, k_ptr, lse_ptr, q_pos, k_pos, valid, live, h, H, D)
            back = q_pos[:, None] * W + q_pos[:, None] - k_pos[None, :]
            mixed = tl.load(mixed_ptr + back, mask=valid, other=0.0)
            dmixed = tl.load(dmixed_ptr + back, mask=valid, other=0.0)
            g = tl.load(g_ptr + (q_pos[:, None] * H + h) * D + d[None, :], mask=live[:, None], other=0.0)
            b = tl.load(b_ptr + q_pos * H + h, mask=live, other=0.0)
            dv += tl.dot(tl.trans(b[:, None] * mixed).to(g.dtype), g)
            a = tl.load(a_ptr + q_pos * H + h, mask=live, other=0.0)
            da = tl.load(da_ptr + q_pos * H + h, mask=live, other=0.0)
            ds = a[:, None] * p * (dmixed - da[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        rows = (k_pos[:, None] * H + h) * D + d[None, :]
        tl.store(dk_ptr + rows, dk.to(dk_ptr.dtype.element_ty), mask=(k_pos < N)[:, None])
        tl.store(dv_ptr + rows, dv.to(dv_ptr.dtype.element_ty), mask=(k_pos < N)[:, None])

    @triton.jit
    def _dc_bwd_kv_kernel(q_ptr, k_ptr, a_ptr, b_ptr, first_ptr, lse_ptr, g_ptr, da_ptr, mixed_ptr, dmixed_ptr,
                          dk_ptr, dv_ptr, N, H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                          NQ: tl.constexpr, W: tl.constexpr, HEADS_IN_GRID: tl.constexpr):
        """The key side of dc_mix's backward: head program_id(1) (HEADS_IN_GRID), or each head in turn."""
        if HEADS_IN_GRID:
            _dc_bwd_kv_head(q_ptr, k_ptr, a_ptr, b_ptr, first_ptr, lse_ptr, g_ptr, da_ptr, mixed_ptr, dmixed_ptr,
                            dk_ptr, dv_ptr, N, tl.program_id(1), H, D, BN, BQ, NQ, W)
        else:
            for h in tl.static_range(H):
                _dc_bwd_kv_head(q_ptr, k_ptr, a_ptr, b_ptr, first_ptr, lse_ptr, g_ptr, da_ptr, mixed_ptr,
                                dmixed_ptr, dk_ptr, dv_ptr, N, h, H, D, BN, BQ, NQ, W)

    @triton.jit
    def _qk_rows(x_ptr, cos_ptr, sin_ptr, R, T, sx_b, sx_t, sx_h, eps, HEADS: tl.constexpr, D: tl.constexpr,
                 BLOCK_R: tl.constexpr, PAIRED: tl.constexpr):
        """What both QK-norm + rotary kernels start with, for this program's rows r = (b, t, head) of x
        (B, T, HEADS, D): each row's two halves in fp32 and its rms_norm factor, its position's cos and sin
        (position t, or 2t + head % 2 for paired heads), and where the rows are."""
        HALF: tl.constexpr = D // 2
        r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        live = (r < R)[:, None]
        tok, head = r // HEADS, r % HEADS
        b, t = tok // T, tok % T
        if PAIRED:
            pos = 2 * t + head % 2
        else:
            pos = t
        j = tl.arange(0, HALF)[None, :]
        at_x = x_ptr + (b * sx_b + t * sx_t + head * sx_h)[:, None] + j
        x1 = tl.load(at_x, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(at_x + HALF, mask=live, other=0.0).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
        c = tl.load(cos_ptr + pos[:, None] * HALF + j, mask=live, other=0.0)
        s = tl.load(sin_ptr + pos[:, None] * HALF + j, mask=live, other=0.0)
        return x1, x2, rstd, c, s, r, b, t, head, live, j

    @triton.jit
    def _qk_norm_rotary_fwd(x_ptr, cos_ptr, sin_ptr, scale_ptr, y_ptr, R, T, sx_b, sx_t, sx_h, eps,
                            HEADS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, PAIRED: tl.constexpr,
                            SCALED: tl.constexpr):
        """Rows r = (b, t, head) of x (B, T, HEADS, D), strides (sx_b, sx_t, sx_h, 1), into y (B, T, HEADS, D)
        contiguous: y = rotary(rms_norm(x)) (times the scale if SCALED), the normed row rounded to bf16 before
        it is turned, as norm() hands it to rotary(). Each row is read once, as its two halves."""
        x1, x2, rstd, c, s, r, _, _, _, live, j = _qk_rows(x_ptr, cos_ptr, sin_ptr, R, T, sx_b, sx_t, sx_h, eps,
                                                           HEADS, D, BLOCK_R, PAIRED)
        n1 = (x1 * rstd).to(tl.bfloat16).to(tl.float32)
        n2 = (x2 * rstd).to(tl.bfloat16).to(tl.float32)
        y1, y2 = n1 * c + n2 * s, n2 * c - n1 * s
        if SCALED:
            scale = tl.load(scale_ptr)
            y1, y2 = y1 * scale, y2 * scale
        dst = y_ptr + r[:, None] * D + j
        tl.store(dst, y1.to(tl.bfloat16), mask=live)
        tl.store(dst + D // 2, y2.to(tl.bfloat16), mask=live)

    @triton.jit
    def _qk_norm_rotary_bwd(x_ptr, g_ptr, cos_ptr, sin_ptr, scale_ptr, dx_ptr, R, T, sx_b, sx_t, sx_h, sg_b, sg_t,
                            sg_h, sd_b, sd_t, sd_h, eps, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                            PAIRED: tl.constexpr, SCALED: tl.constexpr):
        """dx (strides sd_*) for the rows of _qk_norm_rotary_fwd, given g = dL/dy (strides sg_*). As autograd
        computes it: the scale and the rotary's transpose in fp32, rounded to bf16 (the grad of norm()'s bf16
        output), then rms_norm's backward dx = rstd (gn - n mean(gn n)), n = x rstd unrounded."""
        HALF: tl.constexpr = D // 2
        x1, x2, rstd, c, s, _, b, t, head, live, j = _qk_rows(x_ptr, cos_ptr, sin_ptr, R, T, sx_b, sx_t, sx_h, eps,
                                                              HEADS, D, BLOCK_R, PAIRED)
        at_g = g_ptr + (b * sg_b + t * sg_t + head * sg_h)[:, None] + j
        at_d = dx_ptr + (b * sd_b + t * sd_t + head * sd_h)[:, None] + j
        g1 = tl.load(at_g, mask=live, other=0.0).to(tl.float32)
        g2 = tl.load(at_g + HALF, mask=live, other=0.0).to(tl.float32)
        if SCALED:
            scale = tl.load(scale_ptr)
            g1, g2 = g1 * scale, g2 * scale
        gn1 = (g1 * c - g2 * s).to(tl.bfloat16).to(tl.float32)
        gn2 = (g1 * s + g2 * c).to(tl.bfloat16).to(tl.float32)
        n1, n2 = x1 * rstd, x2 * rstd
        dot = ((tl.sum(gn1 * n1, 1) + tl.sum(gn2 * n2, 1)) / D)[:, None]
        tl.store(at_d, (rstd * (gn1 - n1 * dot)).to(tl.bfloat16), mask=live)
        tl.store(at_d + HALF, (rstd * (gn2 - n2 * dot)).to(tl.bfloat16), mask=live)

    # ---- window_attention: the attention mask's tiles from first alone (query n sees first[n]..n, first rising)

    @triton.jit
    def _attn_visible(q_pos, k_pos, first):
        """mask_rule in the kernels: query q_pos sees key k_pos from its first key to itself (broadcast shapes)."""
        return (k_pos <= q_pos) & (k_pos >= first)

    @triton.jit
    def _attn_tile(ptr, n0, h, stride, D: tl.constexpr, B: tl.constexpr, TMA: tl.constexpr):
        """Head h's B tokens from n0 of an (N, H, D) tensor: by its TMA descriptor (TMA: _attn_rows'), else by
        pointers from ptr, which points at head h already (stride: the tokens')."""
        if TMA:
            tile = ptr.load([n0, h * D])
        else:
            rows = n0 + tl.arange(0, B)
            tile = tl.load(ptr + rows[:, None] * stride + tl.arange(0, D)[None, :])
        return tile

    @triton.jit
    def _attn_fwd_tiles(acc, l_i, m_i, q, rows, f, k_ptr, v_ptr, sk, sv, h, start, end, D: tl.constexpr,
                        BN: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
        """Online softmax over the key tiles start..end (BN apart) for one query tile: scores in base 2, the
        running max m_i starts finite so that a row with no key yet in a masked tile adds zeros, not NaN."""
        for n0 in range(start, end, BN):
            cols = n0 + tl.arange(0, BN)
            k = _attn_tile(k_ptr, n0, h, sk, D, BN, TMA)
            v = _attn_tile(v_ptr, n0, h, sv, D, BN, TMA)
            s = tl.dot(q, tl.trans(k)) * LOG2E  # exp2 below
            if MASKED:
                s = tl.where(_attn_visible(rows[:, None], cols[None, :], f[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_key_range(first_ptr, m0, BM: tl.constexpr, BN: tl.constexpr):
        """A query tile's key tiles: from its first query's first key's tile, the masked ones up to front_end
        (some query's first key falls inside them), whole ones to m0, then its masked diagonal m0..m0 + BM."""
        start = (tl.load(first_ptr + m0) // BN) * BN
        front_end = tl.minimum(tl.cdiv(tl.load(first_ptr + m0 + BM - 1), BN) * BN, m0)
        return start, front_end

    @triton.jit
    def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, first_ptr, o_ptr, lse_ptr, sq, sk, sv, so, hq, hk, hv, ho,
                         H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
        """One tile of BM queries of one head: its output and base-2 log-sum-exp (TMA: k and v are _attn_rows'
        descriptors)."""
        m0, h = tl.program_id(0) * BM, tl.program_id(1)
        rows, d = m0 + tl.arange(0, BM), tl.arange(0, D)
        q = tl.load(q_ptr + h * hq + rows[:, None] * sq + d[None, :])
        f = tl.load(first_ptr + rows)
        start, front_end = _attn_key_range(first_ptr, m0, BM, BN)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        m_i = tl.full([BM], -1e30, dtype=tl.float32)
        if not TMA:
            k_ptr, v_ptr = k_ptr + h * hk, v_ptr + h * hv
        acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, rows, f, k_ptr, v_ptr, sk, sv, h, start, front_end, D, BN,
                                        True, TMA)
        acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, rows, f, k_ptr, v_ptr, sk, sv, h, front_end, m0, D, BN,
                                        False, TMA)
        acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, rows, f, k_ptr, v_ptr, sk, sv, h, m0, m0 + BM, D, BN, True,
                                        TMA)
        tl.store(o_ptr + h * ho + rows[:, None] * so + d[None, :], (acc / l_i[:, None]).to(o_ptr.dtype.element_ty))
        tl.store(lse_ptr + rows * H + h, m_i + tl.math.log2(l_i))

    @triton.jit
    def _attn_dq_tiles(dq, q, g, lse, delta, rows, f, k_ptr, v_ptr, sk, sv, h, start, end, D: tl.constexpr,
                       BN: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
        """dq += dS k over the key tiles start..end, P recomputed from the stored log-sum-exp."""
        for n0 in range(start, end, BN):
            cols = n0 + tl.arange(0, BN)
            k = _attn_tile(k_ptr, n0, h, sk, D, BN, TMA)
            v = _attn_tile(v_ptr, n0, h, sv, D, BN, TMA)
            p = tl.math.exp2(tl.dot(q, tl.trans(k)) * LOG2E - lse[:, None])
            if MASKED:
                p = tl.where(_attn_visible(rows[:, None], cols[None, :], f[:, None]), p, 0.0)
            ds = p * (tl.dot(g, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        return dq

    @triton.jit
    def _attn_dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, g_ptr, first_ptr, lse_ptr, delta_ptr, dq_ptr, sq, sk, sv, so,
                        sg, sdq, hq, hk, hv, ho, hg, hdq, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, TMA: tl.constexpr):
        """One tile of BM queries of one head: delta = rowsum(out * g) (stored for the key side), then dq (TMA: k
        and v are _attn_rows' descriptors)."""
        m0, h = tl.program_id(0) * BM, tl.program_id(1)
        rows, d = m0 + tl.arange(0, BM), tl.arange(0, D)
        q = tl.load(q_ptr + h * hq + rows[:, None] * sq + d[None, :])
        g = tl.load(g_ptr + h * hg + rows[:, None] * sg + d[None, :])
        o = tl.load(o_ptr + h * ho + rows[:, None] * so + d[None, :])
        delta = tl.sum(o.to(tl.float32) * g.to(tl.float32), 1)
        tl.store(delta_ptr + rows * H + h, delta)
        lse = tl.load(lse_ptr + rows * H + h)
        f = tl.load(first_ptr + rows)
        start, front_end = _attn_key_range(first_ptr, m0, BM, BN)
        dq = tl.zeros([BM, D], dtype=tl.float32)
        if not TMA:
            k_ptr, v_ptr = k_ptr + h * hk, v_ptr + h * hv
        dq = _attn_dq_tiles(dq, q, g, lse, delta, rows, f, k_ptr, v_ptr, sk, sv, h, start, front_end, D, BN, True, TMA)
        dq = _attn_dq_tiles(dq, q, g, lse, delta, rows, f, k_ptr, v_ptr, sk, sv, h, front_end, m0, D, BN, False, TMA)
        dq = _attn_dq_tiles(dq, q, g, lse, delta, rows, f, k_ptr, v_ptr, sk, sv, h, m0, m0 + BM, D, BN, True, TMA)
        tl.store(dq_ptr + h * hdq + rows[:, None] * sdq + d[None, :], dq.to(dq_ptr.dtype.element_ty))

    @triton.jit
    def _attn_dkdv_tiles(dk, dv, k, v, cols, q_ptr, g_ptr, first_ptr, lse_ptr, delta_ptr, sq, sg, h, start, end,
                         H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, MASKED: tl.constexpr,
                         TMA: tl.constexpr):
        """dv += P^T g and dk += dS^T q over the query tiles start..end (BM apart), transposed: keys by queries."""
        for m0 in range(start, end, BM):
            rows = m0 + tl.arange(0, BM)
            q = _attn_tile(q_ptr, m0, h, sq, D, BM, TMA)
            g = _attn_tile(g_ptr, m0, h, sg, D, BM, TMA)
            lse = tl.load(lse_ptr + rows * H + h)
            delta = tl.load(delta_ptr + rows * H + h)
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * LOG2E - lse[None, :])
            if MASKED:
                f = tl.load(first_ptr + rows)
                p_t = tl.where(_attn_visible(rows[None, :], cols[:, None], f[None, :]), p_t, 0.0)
            dv += tl.dot(p_t.to(g.dtype), g)
            ds_t = p_t * (tl.dot(v, tl.trans(g)) - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
        return dk, dv

    @triton.jit
    def _attn_dkdv_kernel(q_ptr, k_ptr, v_ptr, g_ptr, first_ptr, lse_ptr, delta_ptr, q_end_ptr, q_full_ptr, dk_ptr,
                          dv_ptr, N, sq, sk, sv, sg, sdk, sdv, hq, hk, hv, hg, hdk, hdv, H: tl.constexpr,
                          D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr):
        """One tile of BN keys of one head: its masked diagonal's query tiles, then the whole ones (every query
        sees every key: before q_full), then the masked ones to q_end (the last query that sees one of them).
        TMA: q and g are _attn_rows' descriptors."""
        kb, h = tl.program_id(0), tl.program_id(1)
        n0 = kb * BN
        cols, d = n0 + tl.arange(0, BN), tl.arange(0, D)
        k = tl.load(k_ptr + h * hk + cols[:, None] * sk + d[None, :])
        v = tl.load(v_ptr + h * hv + cols[:, None] * sv + d[None, :])
        q_end = tl.minimum(tl.cdiv(tl.load(q_end_ptr + kb), BM) * BM, N)
        full_end = tl.minimum(tl.maximum((tl.load(q_full_ptr + kb) // BM) * BM, n0 + BN), q_end)
        dk = tl.zeros([BN, D], dtype=tl.float32)
        dv = tl.zeros([BN, D], dtype=tl.float32)
        if not TMA:
            q_ptr, g_ptr = q_ptr + h * hq, g_ptr + h * hg
        dk, dv = _attn_dkdv_tiles(dk, dv, k, v, cols, q_ptr, g_ptr, first_ptr, lse_ptr, delta_ptr, sq, sg, h, n0,
                                  tl.minimum(n0 + BN, q_end), H, D, BM, True, TMA)
        dk, dv = _attn_dkdv_tiles(dk, dv, k, v, cols, q_ptr, g_ptr, first_ptr, lse_ptr, delta_ptr, sq, sg, h,
                                  n0 + BN, full_end, H, D, BM, False, TMA)
        dk, dv = _attn_dkdv_tiles(dk, dv, k, v, cols, q_ptr, g_ptr, first_ptr, lse_ptr, delta_ptr, sq, sg, h,
                                  tl.maximum(full_end, n0 + BN), q_end, H, D, BM, True, TMA)
        tl.store(dk_ptr + h * hdk + cols[:, None] * sdk + d[None, :], dk.to(dk_ptr.dtype.element_ty))
        tl.store(dv_ptr + h * hdv + cols[:, None] * sdv + d[None, :], dv.to(dv_ptr.dtype.element_ty))


release_held_signals(_held_signals)  # the module has loaded: a Ctrl-C or SIGTERM from here on is main()'s to handle
if __name__ == "__main__":
    main()
