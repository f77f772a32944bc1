# Gated DeltaNet, 130M class: 768 wide x 12 layers, tied Mistral vocab (32000).
# Training defaults for ~2B tokens on one node. Sources for the numbers:
#  - batch ~0.5M tokens (2048 x 256 sequences), AdamW betas (0.9, 0.95), weight decay 0.1,
#    grad clip 1.0, cosine decay to 10% of peak: the GPT-3 small-model recipe (Brown et al. 2020,
#    Table 2.1) as used by Gated DeltaNet/fla's flame configs (340M: 0.5M-token batches,
#    betas (0.9, 0.95), wd 0.1, clip 1.0, cosine to 10%).
#  - peak lr 3e-3: Mamba (Gu & Dao 2023, App. E.2) trains its 125M-class models at 5x GPT-3's
#    6e-4; fla's 340M GDN recipe uses 4e-4 for a 15B-token run. A 2B-token run is short,
#    so the higher, small-model value; lower it (e.g. 1e-3) if the loss spikes.
#  - warmup 100 iters = 52M tokens (2.6% of the run; nanoGPT/GPT-3 warm up for ~0.2-1%
#    of long runs, fla for 1024 steps of 0.5M): short because the run is short.
# 2e9 / (16 * 16 * 2048) = 3814.7 -> 3815 iters. On N GPUs the same file gives the same global
# batch (gradient_accumulation_steps is global: each GPU does 16 / N micro-steps).
out_dir = "out/gdn_130m"
dataset = "slimpajama"

mixer = "gdn"
n_layer = 12
n_embd = 768
n_head = 6
head_dim = 128
expand_v = 2.0
vocab_size = 32000
block_size = 2048
tie_embeddings = True

batch_size = 16
gradient_accumulation_steps = 16
max_iters = 3815
lr_decay_iters = 3815
warmup_iters = 100
learning_rate = 3e-3
min_lr = 3e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
# torch.compile fuses the layers' elementwise work around the Triton kernels (which it leaves
# alone): +36% tokens/s for GDN, +41% for PRISM L=3 on the H200 (bench.py, BENCHMARKS.md), for
# about a minute of compiling at the start. --compile=False for eager mode.
compile = True
eval_interval = 250
eval_iters = 20
log_interval = 10
