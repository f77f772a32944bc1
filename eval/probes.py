"""
Synthetic mechanistic probes (the PRISM paper's Table 4), small models trained from scratch.

    python eval/probes.py --setting paper --seeds 0 1 2 --device cuda --ensemble 9 --streams 27 \\
        --out probes.json                                      # the full grid, one CUDA GPU
    python eval/probes.py --tasks parity mux --models paper-probe-LA paper-probe-PRISM prism \\
        --seeds 0 --steps 2000 --device cpu                    # a small CPU look

Every task is one sequence of T tokens: noise tokens everywhere, a short pattern (P tokens) at a
uniformly random position, and a query block at the very end. Only the last position is
supervised (cross-entropy on its next-token logits over the whole vocabulary) and accuracy is
measured on it alone, over 8000 fresh test sequences.

Token layout (vocab V >= 32; the paper's script uses V = 32):

    0..15   data symbols. Memory tasks split them: keys 0..7, values 8..15
    16 QRY  start of the query block          17 ON / 18 OFF  gate states (silence gate)
    19 NULL "nothing stored" answer           20 SEL0 / 21 SEL1  selectors (MUX, poly-recall)
    22..V-1 noise (never used by a pattern, so the pattern is unambiguous; its position is not)

The tasks (P = pattern length, Q = query block, y = label; chance = best input-blind accuracy):

  mqar         4 key-value pairs  k1 v1 .. k4 v4  (distinct keys from 0..7, values from 8..15);
               Q = QRY k_j for a uniform j; y = v_j.  Multi-query in the sense that any of the
               four may be asked; one query per sequence (the paper supervises the last token).
               P=8, chance 1/8.
  poly_recall  3 keys, each bound to two values  k a b  (distinct keys, values from 8..15);
               Q = QRY k_j SEL_s; y = a_j if s == 0 else b_j.  P=9, chance 1/8.
  var_track    two assignment chains of 3 distinct variables (6 distinct keys):  x0 <- value,
               x1 <- x0, x2 <- x1, written as token pairs (x0 val) (x1 x0) (x2 x1); the two
               chains' pairs are interleaved in a random order that keeps each chain's order;
               the two values differ. Q = QRY x2 of one chain (uniform); y = that chain's
               value (two hops). P=12, chance 1/8 (1/2 if guessing among the values present).
  parity       3 bits b1 b2 b3 (tokens 0/1); Q = QRY; y = b1 xor b2 xor b3.  P=3, chance 1/2.
  local_xor    two adjacent data symbols a b (0..15); Q = QRY;
               y = (popcount(a) + popcount(b)) mod 2, as token 0/1.  P=2, chance 1/2.
  mod_add      two adjacent data symbols a b; Q = QRY; y = (a + b) mod 16.  P=2, chance 1/16.
  palindrome   four data symbols a b c d; Q = QRY; y = 1 if a == c or a == d else 0 (token
               0/1). Drawn so that y is 1 with probability 1/2: for y=1 one of c, d (uniform)
               copies a and the other is uniform; for y=0 both c, d are uniform over the 15
               symbols != a.  P=4, chance 1/2.
  mux          SEL_s a b with a, b data symbols; Q = QRY; y = a if s == 0 else b.  P=3,
               chance 1/16.
  silence      two gated pairs  g1 k1 v1 g2 k2 v2  (g in {ON, OFF} each with prob. 1/2,
               distinct keys from 0..7, values from 8..15); Q = QRY k_j (j uniform);
               y = v_j if g_j == ON else NULL (the trigger decides whether the pair counts).
               P=6, chance 1/2 (always answering NULL).

Data is deterministic given (seed, task, split): train and test streams come from different
seed material (numpy SeedSequence([seed, task id, split])), the model init from torch.manual_seed
(seed) on CPU. Training batches are generated in blocks of steps on the run's device (CPU and
CUDA generators differ, so the exact samples depend on the device; the distribution does not).

Models (names for --models):

  our Model from model.py at probe scale (n_layer 2, n_head 1, head_dim = width, value width =
  width, SwiGLU width 4*width, RMSNorm, solver rank = width/2, chunk backend):
    gdn, prism (L=2), prism-L1 (= GDN), prism-no-nonlin, prism-no-anchor, prism-no-gain
    (each ablation with L=2 and one switch off), attention (softmax, RoPE)
  the authors' simplified probe layers (PRISM_SPEC.md §6; NOT our LM layer), in
  LayerNorm pre-norm blocks with a GELU MLP (4*width), untied head, no position embedding:
    paper-probe-LA     elu+1 linear attention after a width-4 causal depthwise conv:
                       a = silu(conv(x)); q, k = elu(W a)+1; v = W_v a;
                       o_t = sum_{s<=t} (q_t.k_s) v_s / (q_t . sum_{s<=t} k_s)
    paper-probe-PRISM  no decay, no delta rule: u = a = silu(conv(x)), v = W_v x,
                       k_l = l2norm(low-rank(a)), p_l = low-rank(a) (rank width/2), L=2,
                       S_t = sum_{s<=t} sum_l lambda_l GELU(p_l,s * (v_s - u_s)) k_l,s^T,
                       o_t = S_t (q_t / sqrt(width)), q = W_q a; lambda_l learned (init 1).
                       Every step uses the same residual v - u (as described for their script;
                       our LM layer subtracts greedily instead).

Settings: --setting paper = the authors' script facts (PRISM_SPEC.md §6): vocab 32; width 16
and length 128, except width 128 and length 64 for mqar/poly_recall/var_track; 2 layers, 1 head,
batch 32, 10k steps, AdamW (lr 1e-3, weight decay 1e-4 on all parameters, constant lr),
gradient clipping 5.0, 8000 test samples. --setting paper_text = what the paper's text says
instead (vocab 64, width 16 and length 128 for every task). Flags override steps/batch etc.

How it runs fast (tiny models are launch-bound on a GPU). Each run keeps data and losses on
the device and reads nothing back until the end (accuracy at the end and at --eval_every
checkpoints). --ensemble E trains up to E (task, seed) members of one model kind and shape as
one stacked model (torch.func.vmap): every kernel serves all of them. On CUDA the whole
training step (forward, backward, per-member clipping, fused AdamW) is captured once as a CUDA
graph and replayed (--no_graph turns it off; a failed capture falls back to eager mode and the
row says so). --streams K steps K such jobs in turn in one process, each on its own CUDA
stream, so their kernels overlap; --workers N runs N such processes. Rows are written to --out
(atomically) after every finished group; --resume skips (task, model, seed, steps, setting)
rows already there; --budget_s stops everything at a wall-clock budget and records how far
each run got (such rows are kept out of the main table), so a grid can be run in pieces.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from model import Model, ModelConfig, ShortConv  # noqa: E402
from cli import HelpFormatter  # noqa: E402
from fileio import atomic_write  # noqa: E402

# ----------------------------------------------------------------------------------------------
# token layout

N_DATA = 16
KEYS = (0, 8)        # [lo, hi)
VALS = (8, 16)
QRY, ON, OFF, NULL, SEL0, SEL1 = 16, 17, 18, 19, 20, 21
NOISE_LO = 22
MIN_VOCAB = 32

# task -> (pattern length, query length, is memory task, chance accuracy)
TASKS = {
    "mqar":        (8, 2, True, 1 / 8),
    "poly_recall": (9, 3, True, 1 / 8),
    "var_track":   (12, 2, True, 1 / 8),
    "parity":      (3, 1, False, 1 / 2),
    "local_xor":   (2, 1, False, 1 / 2),
    "mod_add":     (2, 1, False, 1 / 16),
    "palindrome":  (4, 1, False, 1 / 2),
    "mux":         (3, 1, False, 1 / 16),
    "silence":     (6, 2, False, 1 / 2),
}
TASK_IDS = {name: i for i, name in enumerate(TASKS)}
SPLITS = {"train": 0, "test": 1}
POPCOUNT = torch.tensor([bin(i).count("1") for i in range(N_DATA)])


def _distinct(n, k, lo, hi, gen, device):
    """n rows of k distinct integers from [lo, hi) (a random prefix of a random permutation)."""
    return torch.rand(n, hi - lo, generator=gen, device=device).argsort(1)[:, :k] + lo


def _pattern(task, n, gen, device):
    """Returns pattern [n,P], query block [n,Q], label [n] (all long) for one task."""
    ri = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=gen, device=device)
    col = lambda *xs: torch.stack(xs, 1)
    if task == "mqar":
        k = _distinct(n, 4, *KEYS, gen, device)
        v = ri(*VALS, n, 4)
        j = ri(0, 4, n, 1)
        pat = torch.stack([k, v], 2).flatten(1)
        return pat, torch.cat([torch.full_like(j, QRY), k.gather(1, j)], 1), v.gather(1, j)[:, 0]
    if task == "poly_recall":
        k = _distinct(n, 3, *KEYS, gen, device)
        ab = ri(*VALS, n, 3, 2)
        j, s = ri(0, 3, n, 1), ri(0, 2, n, 1)
        pat = torch.cat([k[..., None], ab], 2).flatten(1)
        y = ab.gather(1, j[..., None].expand(n, 1, 2))[:, 0].gather(1, s)[:, 0]
        return pat, torch.cat([torch.full_like(j, QRY), k.gather(1, j), SEL0 + s], 1), y
    if task == "var_track":
        x = _distinct(n, 6, *KEYS, gen, device).view(n, 2, 3)      # chain c: x[c,0..2]
        val = _distinct(n, 2, *VALS, gen, device)                   # two different values
        src = torch.stack([val, x[:, :, 0], x[:, :, 1]], 2)         # what x[c,i] is assigned
        pairs = torch.stack([x, src], 3).view(n, 6, 2)              # chain-major pair list
        # random interleave keeping in-chain order: chain 0 takes 3 sorted slots out of 6
        slots0 = torch.rand(n, 6, generator=gen, device=device).argsort(1)[:, :3].sort(1).values
        taken = torch.zeros(n, 6, dtype=torch.bool, device=device).scatter_(1, slots0, True)
        slots1 = (~taken).nonzero()[:, 1].view(n, 3)                # already in increasing order
        slot = torch.cat([slots0, slots1], 1)                       # pair i goes to slot[i]
        pat = torch.empty_like(pairs).scatter_(1, slot[..., None].expand(n, 6, 2), pairs)
        c = ri(0, 2, n)
        ar = torch.arange(n, device=device)
        q = torch.stack([torch.full_like(c, QRY), x[ar, c, 2]], 1)
        return pat.flatten(1), q, val[ar, c]
    qb = torch.full((n, 1), QRY, dtype=torch.long, device=device)
    if task == "parity":
        b = ri(0, 2, n, 3)
        return b, qb, b.sum(1) % 2
    if task in ("local_xor", "mod_add"):
        ab = ri(0, N_DATA, n, 2)
        if task == "mod_add":
            return ab, qb, ab.sum(1) % N_DATA
        return ab, qb, POPCOUNT.to(device)[ab].sum(1) % 2
    if task == "palindrome":
        a, b = ri(0, N_DATA, n), ri(0, N_DATA, n)
        y, which = ri(0, 2, n), ri(0, 2, n)
        not_a = lambda: (a + 1 + ri(0, N_DATA - 1, n)) % N_DATA    # uniform over symbols != a
        anything = ri(0, N_DATA, n)
        c = torch.where(y == 1, torch.where(which == 0, a, anything), not_a())
        d = torch.where(y == 1, torch.where(which == 0, anything, a), not_a())
        return col(a, b, c, d), qb, y
    if task == "mux":
        s, a, b = ri(0, 2, n), ri(0, N_DATA, n), ri(0, N_DATA, n)
        return col(SEL0 + s, a, b), qb, torch.where(s == 0, a, b)
    if task == "silence":
        g = ri(0, 2, n, 2)                                          # 1 = ON
        k = _distinct(n, 2, *KEYS, gen, device)
        v = ri(*VALS, n, 2)
        pat = torch.stack([torch.where(g == 1, ON, OFF), k, v], 2).flatten(1)
        j = ri(0, 2, n, 1)
        y = torch.where(g.gather(1, j) == 1, v.gather(1, j), NULL)[:, 0]
        return pat, torch.cat([torch.full_like(j, QRY), k.gather(1, j)], 1), y
    raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")


def make_batch(task, n, T, vocab, gen, device="cpu"):
    """n sequences [n,T] and labels [n] for `task`: noise, the pattern at a uniform random start
    in [0, T-Q-P], the query block in the last Q positions. Returns (x, y, start)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab must be >= {MIN_VOCAB} (the token layout uses ids 0..{NOISE_LO}); got {vocab}")
    P, Q = TASKS[task][:2]
    if T < P + Q:
        raise ValueError(f"task {task!r} needs length >= {P + Q}; got {T}")
    x = torch.randint(NOISE_LO, vocab, (n, T), generator=gen, device=device)
    pat, qb, y = _pattern(task, n, gen, device)
    start = torch.randint(0, T - Q - P + 1, (n,), generator=gen, device=device)
    x.scatter_(1, start[:, None] + torch.arange(P, device=device), pat)
    x[:, T - Q:] = qb
    return x, y, start


def data_seed(seed, task, split):
    """Seed for one (seed, task, split) stream; train and test never share seed material."""
    st = np.random.SeedSequence([int(seed), TASK_IDS[task], SPLITS[split]]).generate_state(2, np.uint32)
    return int(st[0]) << 31 | int(st[1]) >> 1


def make_generator(seed, task, split, device):
    return torch.Generator(device=device).manual_seed(data_seed(seed, task, split))


# ----------------------------------------------------------------------------------------------
# the authors' simplified probe layers (PRISM_SPEC.md §6), not our LM layer

class PaperProbeMixer(nn.Module):
    def __init__(self, kind, D, L=2, rank=None):
        super().__init__()
        self.kind, self.D, self.L = kind, D, L
        r = rank or max(D // 2, 1)
        self.conv = ShortConv(D, 4)
        self.q = nn.Linear(D, D)
        self.v = nn.Linear(D, D)
        self.o = nn.Linear(D, D)
        if kind == "la":
            self.k = nn.Linear(D, D)
        elif kind == "prism":
            self.k_low = nn.ModuleList(nn.Sequential(nn.Linear(D, r, bias=False), nn.Linear(r, D))
                                       for _ in range(L))
            self.p_low = nn.ModuleList(nn.Sequential(nn.Linear(D, r, bias=False), nn.Linear(r, D))
                                       for _ in range(L))
            self.lam = nn.Parameter(torch.ones(L))
        else:
            raise ValueError(f"unknown paper-probe kind {kind!r}")

    def forward(self, x):  # [B,T,D]
        T = x.shape[1]
        a = self.conv(x)  # conv + SiLU
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if self.kind == "la":
            q, k = F.elu(self.q(a)) + 1, F.elu(self.k(a)) + 1
            A = (q @ k.transpose(1, 2)).masked_fill(~causal, 0.0)
            o = (A @ self.v(a)) / (A.sum(-1, keepdim=True) + 1e-6)
        else:
            q = self.q(a) * self.D ** -0.5
            res = self.v(x) - a                                   # v - u, u = the anchor
            o = 0
            for l in range(self.L):
                k = F.normalize(self.k_low[l](a), dim=-1)
                d = F.gelu(self.p_low[l](a) * res)
                A = (q @ k.transpose(1, 2)).masked_fill(~causal, 0.0)
                o = o + self.lam[l] * (A @ d)                     # running sum, no decay
        return self.o(o)


class PaperProbeNet(nn.Module):
    """Embedding, n_layer LayerNorm pre-norm blocks (mixer + GELU MLP), final LayerNorm, head."""

    def __init__(self, kind, vocab, D, n_layer=2, L=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList()
        for _ in range(n_layer):
            self.blocks.append(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(D), mix=PaperProbeMixer(kind, D, L),
                ln2=nn.LayerNorm(D), mlp=nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)))))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab)

    def forward(self, idx):  # -> logits at the last position [B,V]
        x = self.wte(idx)
        for b in self.blocks:
            x = x + b["mix"](b["ln1"](x))
            x = x + b["mlp"](b["ln2"](x))
        return self.head(self.ln_f(x[:, -1]))


class OurProbeNet(nn.Module):
    """model.py's Model, run only up to the last position's logits. Calls the Model's parts
    directly to skip its per-call vocab check (a host sync); make_batch guarantees the range."""

    def __init__(self, cfg, backend="chunk"):
        super().__init__()
        self.model = Model(cfg, backend=backend)
        # the ensembles run under torch.func.vmap, which cannot replay a checkpointed region in
        # the backward; at these widths there is nothing to save by recomputing
        self.model.recompute_solver = False

    def forward(self, idx):
        m = self.model
        x = m.wte(idx)
        for block in m.blocks:
            x = block(x)
        return m.lm_head(m.norm_f(x[:, -1]))


OUR_MODELS = {
    "gdn": dict(mixer="gdn"),
    "prism": dict(mixer="prism", solver_steps=2),
    "prism-L1": dict(mixer="prism", solver_steps=1),
    "prism-no-nonlin": dict(mixer="prism", solver_steps=2, solver_nonlinear=False),
    "prism-no-anchor": dict(mixer="prism", solver_steps=2, solver_anchor=False),
    "prism-no-gain": dict(mixer="prism", solver_steps=2, solver_gain=False),
    "attention": dict(mixer="attention"),
}
PAPER_MODELS = {"paper-probe-PRISM": "prism", "paper-probe-LA": "la"}
MODELS = list(PAPER_MODELS) + list(OUR_MODELS)


def build_model(name, vocab, width, length, n_layer=2, backend="chunk"):
    if name in PAPER_MODELS:
        return PaperProbeNet(PAPER_MODELS[name], vocab, width, n_layer)
    if name in OUR_MODELS:
        cfg = ModelConfig(vocab_size=vocab, block_size=length, n_layer=n_layer, n_head=1,
                          n_embd=width, head_dim=width, expand_v=1.0, mlp_hidden=4 * width,
                          solver_rank=max(width // 2, 1), **OUR_MODELS[name])
        return OurProbeNet(cfg, backend)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# ----------------------------------------------------------------------------------------------
# settings and one run

SETTINGS = {
    # the authors' public probe script (PRISM_SPEC.md §6)
    "paper": dict(vocab=32, width=16, length=128, mem_width=128, mem_length=64, n_layer=2,
                  batch=32, steps=10000, lr=1e-3, weight_decay=1e-4, grad_clip=5.0, n_test=8000),
    # what the paper's text says instead (vocab 64, width 16, length 128 for every task)
    "paper_text": dict(vocab=64, width=16, length=128, mem_width=16, mem_length=128, n_layer=2,
                       batch=32, steps=10000, lr=1e-3, weight_decay=1e-4, grad_clip=5.0, n_test=8000),
}


def task_shape(task, s):
    """(width, length) of `task` in setting dict s."""
    return (s["mem_width"], s["mem_length"]) if TASKS[task][2] else (s["width"], s["length"])


class Run:
    """Training of one model kind on one or more (task, seed) members of the same shape.

    One member: a plain module. Several: an ensemble, the members' weights stacked and the
    model applied with torch.func.vmap, so each kernel serves every member (tiny models are
    launch-bound; this divides the launches by the ensemble size). Each member keeps its own
    init (torch.manual_seed(seed)), data stream, test set, per-member gradient clipping and
    AdamW state (AdamW is elementwise, so stacking changes nothing but float rounding).

    Stepped from outside so that several runs can share a process, each on its own CUDA
    stream. On CUDA with graph=True the whole training step (forward, backward, clipping, AdamW)
    is captured once as a CUDA graph and replayed: one launch per step. The first `warmup` steps
    run eagerly (real steps on real batches; capture needs them to settle the allocator)."""

    def __init__(self, members, model_name, s, device="cpu", eval_every=0, backend="chunk",
                 graph=False, block_steps=250, warmup=3):
        self.t0 = time.time()
        self.members, self.model_name, self.s = list(members), model_name, s
        shapes = {task_shape(t, s) for t, _ in self.members}
        if len(shapes) != 1:
            raise ValueError(f"ensemble members must share width and length; got {self.members}")
        (self.D, self.T), self.S = shapes.pop(), len(self.members)
        self.device = device = torch.device(device)
        self.eval_every, self.block_steps, self.warmup = eval_every, block_steps, warmup
        self.graph = graph and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        nets = []
        for _, seed in self.members:
            torch.manual_seed(seed)               # model init on CPU: the same on every device
            nets.append(build_model(model_name, s["vocab"], self.D, self.T, s["n_layer"], backend))
        self.n_params = sum(p.numel() for p in nets[0].parameters())
        if self.S == 1:
            self.net = nets[0].to(device)
            self.params = list(self.net.parameters())
            self.fwd = self.net
        else:
            from torch.func import functional_call, stack_module_state, vmap
            stacked, buffers = stack_module_state(nets)
            self.stacked = {k: v.detach().to(device).requires_grad_() for k, v in stacked.items()}
            buffers = {k: v.to(device) for k, v in buffers.items()}
            self.net = nets[0].to(device)         # the structure; its own weights are not used
            one = lambda p, x: functional_call(self.net, (p, buffers), (x,))
            self.fwd = vmap(one, in_dims=(0, 0))  # (stacked weights, x [S,B,T]) -> [S,B,V]
            self.params = list(self.stacked.values())
        extra = dict(fused=True, capturable=self.graph) if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.params, lr=s["lr"], weight_decay=s["weight_decay"], **extra)
        if self.stream is not None:  # the weights were copied on the default stream
            self.stream.wait_stream(torch.cuda.current_stream(device))
        with self._on_stream():
            xt, yt = [], []
            for task, seed in self.members:
                x, y, _ = make_batch(task, s["n_test"], self.T, s["vocab"],
                                     make_generator(seed, task, "test", device), device)
                xt.append(x), yt.append(y)
            self.xt, self.yt = torch.stack(xt), torch.stack(yt)   # [S, n_test, T], [S, n_test]
            self.g_train = [make_generator(seed, task, "train", device) for task, seed in self.members]
        self.it, self.losses, self.curve = 0, [], []
        self.xs = self.ys = None
        self.cuda_graph, self.graph_error = None, None

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext()

    def _logits(self, x):  # x [S,B,T] -> [S,B,V]
        # math attention: at T=128 it costs nothing, and the fused SDPA backwards reject the
        # strides vmap gives them on CUDA ("LSE is not correctly aligned", seen on the H200)
        with sdpa_kernel([SDPBackend.MATH]):
            return self.fwd(x[0])[None] if self.S == 1 else self.fwd(self.stacked, x)

    def _train_step(self, x, y):
        logits = self._logits(x).float()
        S, B, V = logits.shape
        loss = F.cross_entropy(logits.reshape(S * B, V), y.reshape(S * B), reduction="none")
        loss = loss.view(S, B).mean(1)                        # per member
        loss.sum().backward()                                 # each member gets its own gradient
        if self.S == 1:
            torch.nn.utils.clip_grad_norm_(self.params, self.s["grad_clip"], foreach=True)
        else:  # clip_grad_norm_ per member: its own total norm over all its parameters
            norm = sum(p.grad.float().pow(2).flatten(1).sum(1) for p in self.params).sqrt()
            coef = (self.s["grad_clip"] / (norm + 1e-6)).clamp(max=1.0)
            for p in self.params:
                p.grad.mul_(coef.view(-1, *[1] * (p.dim() - 1)).to(p.grad.dtype))
        self.opt.step()
        return loss.detach()

    def step(self):
        """One training step (no host sync)."""
        s, B, it = self.s, self.s["batch"], self.it
        with self._on_stream():
            j = it % self.block_steps
            if j == 0:  # one generator call per block of steps (fewer tiny launches)
                n = min(self.block_steps, s["steps"] - it)
                xs, ys = [], []
                for (task, _), g in zip(self.members, self.g_train):
                    x, y, _ = make_batch(task, n * B, self.T, s["vocab"], g, self.device)
                    xs.append(x.view(n, B, self.T)), ys.append(y.view(n, B))
                self.xs, self.ys = torch.stack(xs, 1), torch.stack(ys, 1)  # [n,S,B,T], [n,S,B]
            if self.graph and it >= self.warmup and self.cuda_graph is None:
                self._capture()
            if self.cuda_graph:
                self.static_x.copy_(self.xs[j])
                self.static_y.copy_(self.ys[j])
                self.cuda_graph.replay()
                loss = self.static_loss
            else:  # eager: CPU, warm-up steps, or a failed capture (noted in the row)
                self.opt.zero_grad(set_to_none=True)
                loss = self._train_step(self.xs[j], self.ys[j])
            if j == 0 or it == s["steps"] - 1:
                self.losses.append(loss.clone())
            self.it += 1
            if self.eval_every and self.it % self.eval_every == 0 and self.it < s["steps"]:
                self.curve.append((self.it, self.evaluate()))

    def _capture(self):
        # PyTorch's whole-network capture recipe: grads set to None before capture, so the
        # captured backward writes them afresh on every replay
        self.static_x = torch.zeros_like(self.xs[0])
        self.static_y = torch.zeros_like(self.ys[0])
        torch.cuda.current_stream().synchronize()
        self.opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.static_loss = self._train_step(self.static_x, self.static_y)
            self.cuda_graph = graph
        except Exception as e:  # e.g. an op that copies from host memory inside the model
            self.cuda_graph, self.graph_error = False, f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()

    @torch.no_grad()
    def evaluate(self, bs=None):
        """Test accuracy per member, a device tensor [S] (no host sync)."""
        bs = bs or max(100, 8000 // self.S)   # bounds the memory of a big ensemble's forward
        self.net.eval()
        correct = sum((self._logits(self.xt[:, i:i + bs]).argmax(-1) == self.yt[:, i:i + bs]).sum(1)
                      for i in range(0, self.xt.shape[1], bs))
        self.net.train()
        return correct.float() / self.xt.shape[1]

    def finish(self):
        with self._on_stream():
            acc = self.evaluate().tolist()
            final = (self.losses[-1] if self.losses else torch.full((self.S,), float("nan"))).tolist()
            curve = [(k, v.tolist()) for k, v in self.curve]
        s, rows = self.s, []
        for i, (task, seed) in enumerate(self.members):
            row = dict(task=task, model=self.model_name, seed=seed, steps=self.it,
                       test_acc=acc[i], final_train_loss=final[i], chance=TASKS[task][3],
                       width=self.D, length=self.T, vocab=s["vocab"], batch=s["batch"],
                       n_test=s["n_test"], params=self.n_params,
                       curve=[(k, v[i]) for k, v in curve], device=str(self.device),
                       ensemble=self.S, cuda_graph=bool(self.cuda_graph),
                       wall_s=round(time.time() - self.t0, 2))
            if self.graph_error:
                row["note"] = "CUDA graph capture failed, ran eagerly: " + self.graph_error
            if not math.isfinite(row["final_train_loss"]):
                row["note"] = "non-finite training loss"
            rows.append(row)
        return rows


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_one(task, model_name, seed, s, device="cpu", **kw):
    """Train one model on one task; return its result row. s = a settings dict (SETTINGS)."""
    return run_ensemble([(task, seed)], model_name, s, device, **kw)[0]


def run_ensemble(members, model_name, s, device="cpu", **kw):
    """Train one model kind on several (task, seed) members of one shape at once; one row each."""
    return run_group([(model_name, members)], s, device, **kw)


def run_group(jobs, s, device="cpu", deadline=None, **kw):
    """Several runs (model_name, [(task, seed), ...]) in one process, stepped in turn, each on
    its own CUDA stream so that their kernels overlap on the GPU. Returns their rows. Past
    `deadline` (a time.time() value) the runs stop early and their rows say so."""
    runs = [Run(members, m, s, device, **kw) for m, members in jobs]
    t0, steps = time.time(), s["steps"]
    for it in range(steps):
        if deadline and it % 50 == 0 and time.time() > deadline:
            break
        for r in runs:
            r.step()
        if (it + 1) % max(steps // 10, 1) == 0 and time.time() - t0 > 60:  # long runs: progress
            el = time.time() - t0
            print(f"  [pid {os.getpid()}] step {it + 1}/{steps} of {len(runs)} run(s), "
                  f"{(it + 1) / el:.1f} it/s, ETA {el / (it + 1) * (steps - it - 1):.0f}s", flush=True)
    rows = [row for r in runs for row in r.finish()]
    for row in rows:  # wall time is shared by the group; say so
        row["group_size"] = len(runs)
        if row["steps"] < steps:
            row["note"] = f"stopped early by the time budget at step {row['steps']} of {steps}"
    return rows


def make_jobs(tasks, models, seeds, s, ensemble=1):
    """(model, members) jobs: members of one job share a model kind and a shape. Seeds stay
    outermost where possible, so a partial grid still covers every (task, model) cell."""
    jobs = []
    for m in models:
        for shape in sorted({task_shape(t, s) for t in tasks}):
            members = [(t, sd) for sd in seeds for t in tasks if task_shape(t, s) == shape]
            jobs += [(m, members[i:i + ensemble]) for i in range(0, len(members), ensemble)]
    # interleave so that the first jobs cover the first seed of every model
    return sorted(jobs, key=lambda j: (seeds.index(j[1][0][1]), models.index(j[0])))


def _worker(group, s, opts):
    """One process: a group of runs, interleaved on CUDA streams if more than one."""
    torch.set_num_threads(opts["threads"])
    rows = run_group(group, s, opts["device"], deadline=opts["deadline"], eval_every=opts["eval_every"],
                     backend=opts["backend"], graph=opts["graph"])
    for row in rows:
        row["setting"] = opts["setting"]
    return rows


def save_rows(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(rows, indent=1).encode())


def load_rows(path):
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            rows = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); move it away or pick another --out")
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON list of result rows")
    return rows


def table(rows, models=None):
    """Markdown: one line per task, one column per model, mean ± std over seeds (n)."""
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    models = models or [m for m in MODELS if any(r["model"] == m for r in rows)]
    lines = ["| task | chance | " + " | ".join(models) + " |",
             "|---|---|" + "---|" * len(models)]
    for t in tasks:
        cells = []
        for m in models:
            a = np.array([r["test_acc"] for r in rows if r["task"] == t and r["model"] == m])
            cells.append("–" if len(a) == 0 else
                         f"{a.mean():.2f} ± {a.std(ddof=1) if len(a) > 1 else 0:.2f} ({len(a)})")
        lines.append(f"| {t} | {TASKS[t][3]:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + "\n\nThe full grid wants a CUDA GPU "
                                "(--device cuda); small grids run on the CPU. Writes --out.",
                                formatter_class=HelpFormatter)
    p.add_argument("--setting", default="paper", choices=sorted(SETTINGS),
                   help="paper: the authors' probe script; paper_text: what the paper's text says")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), help="tasks to run")
    p.add_argument("--models", nargs="+", default=MODELS, help="model kinds to train")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one run per seed")
    p.add_argument("--steps", type=int, help="override the setting's training steps")
    p.add_argument("--batch", type=int, help="override the setting's batch size")
    p.add_argument("--n_test", type=int, help="override the number of test samples")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--workers", type=int, default=1,
                   help="concurrent processes, each running --streams jobs at a time")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument("--eval_every", type=int, default=0, help="also record test acc every N steps (0: only at the end)")
    p.add_argument("--backend", default="chunk", choices=["chunk", "naive", "triton"],
                   help="recurrence backend for our GDN/PRISM models")
    p.add_argument("--ensemble", type=int, default=1,
                   help="train up to N (task, seed) members of one model kind and shape at once "
                        "(stacked weights, torch.func.vmap)")
    p.add_argument("--streams", type=int, default=1,
                   help="runs per process, interleaved on their own CUDA streams (CUDA only)")
    p.add_argument("--no_graph", action="store_true",
                   help="on CUDA, do not capture the training step as a CUDA graph")
    p.add_argument("--budget_s", type=float, default=0,
                   help="wall budget in seconds (0 = none): no group starts after it, and running "
                        "groups stop there and record how far they got")
    p.add_argument("--out", default="bench/results/probes.json", help="results JSON, rewritten after every group")
    p.add_argument("--resume", action="store_true", help="skip runs already in --out")
    args = p.parse_args(argv)
    bad = [t for t in args.tasks if t not in TASKS] + [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"unknown task/model {bad}; tasks: {list(TASKS)}; models: {MODELS}")
    if args.streams > 1 and not args.device.startswith("cuda"):
        p.error("--streams > 1 needs a CUDA device")
    s = dict(SETTINGS[args.setting])
    for k in ("steps", "batch", "n_test"):
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    opts = dict(device=args.device, threads=args.threads, eval_every=args.eval_every,
                backend=args.backend, setting=args.setting, graph=not args.no_graph)
    if args.streams > 1:  # more hardware queues, so that the streams really run side by side
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(min(32, args.streams)))
    rows = load_rows(args.out) if args.resume else []
    done = {(r["task"], r["model"], r["seed"], r["steps"], r.get("setting")) for r in rows}
    jobs = []
    for m, members in make_jobs(args.tasks, args.models, args.seeds, s, args.ensemble):
        members = [(t, sd) for t, sd in members if (t, m, sd, s["steps"], args.setting) not in done]
        if members:
            jobs.append((m, members))
    n_runs = sum(len(j[1]) for j in jobs)
    groups = [jobs[i:i + args.streams] for i in range(0, len(jobs), args.streams)]
    print(f"{n_runs} runs as {len(jobs)} jobs (ensembles of <= {args.ensemble}) in {len(groups)} "
          f"groups ({len(done)} runs already in {args.out}); {args.workers} workers x "
          f"{args.streams} streams, device {args.device}, steps {s['steps']}", flush=True)
    t0, n_done = time.time(), 0
    opts["deadline"] = t0 + args.budget_s if args.budget_s else None

    def finished(new_rows):
        nonlocal n_done
        rows.extend(new_rows)
        save_rows(args.out, rows)
        el = time.time() - t0
        for row in new_rows:
            n_done += 1
            print(f"[{n_done}/{n_runs}] {row['task']:<11} {row['model']:<18} seed {row['seed']} "
                  f"acc {row['test_acc']:.3f} ({row['wall_s']:.0f}s)  elapsed {el:.0f}s "
                  f"ETA {el / n_done * (n_runs - n_done):.0f}s", flush=True)

    over = lambda: args.budget_s and time.time() - t0 > args.budget_s
    if args.workers <= 1:
        for g in groups:
            if over():
                break
            finished(_worker(g, s, opts))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
            futs = [ex.submit(_worker, g, s, opts) for g in groups]
            for fut in cf.as_completed(futs):
                finished(fut.result())
                if over():
                    for f in futs:
                        f.cancel()  # only those not started yet; running ones finish
    n_short = sum(r["steps"] < s["steps"] for r in rows[len(rows) - n_done:])
    if n_done < n_runs or n_short:
        print(f"time budget of {args.budget_s:.0f}s reached: {n_done - n_short}/{n_runs} runs "
              f"complete, {n_short} stopped early; rerun with --resume to redo the rest")
    print()
    print(f"setting {args.setting}, steps {s['steps']}, batch {s['batch']}, device {args.device}")
    mine = [r for r in rows if r.get("setting") == args.setting]
    print(table([r for r in mine if r["steps"] == s["steps"]], args.models))
    short = [r for r in mine if r["steps"] < s["steps"]]
    if short:
        print(f"\nruns stopped early (steps {min(r['steps'] for r in short)}-"
              f"{max(r['steps'] for r in short)} of {s['steps']}):")
        print(table(short, args.models))
    return rows


if __name__ == "__main__":
    main()
