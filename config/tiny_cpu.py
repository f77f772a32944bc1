# Tiny PRISM for demos on a CPU: runs end to end in about a minute, no model hub.
# Data: any small text through the data script, e.g. the English docs that ship with Python:
#   python -c "from pydoc_data.topics import topics; open('pydoc.txt','w').write('\n\n'.join(topics.values()))"
#   python data/prepare_slimpajama.py --data_files pydoc.txt --tokens all --val_tokens all --val_fraction 0.05 --out_dir data/tiny
#   python train.py config/tiny_cpu.py
# Mistral vocab (32000) so that the prepared data fits; the token table is most of the 2.2M weights.
out_dir = "out/tiny_cpu"
dataset = "tiny"

mixer = "prism"
n_layer = 2
n_embd = 64
n_head = 2
head_dim = 32
expand_v = 2.0
solver_steps = 3
solver_rank = 16
vocab_size = 32000
block_size = 64
chunk_size = 16

device = "cpu"
dtype = "float32"
cpu_threads = 1   # tiny matmuls gain little from threads, and OpenMP threads stall badly when
                  # another process shares the cores (measured 25x slower with 2 on a busy 2-core box)
batch_size = 4
gradient_accumulation_steps = 2
max_iters = 150
lr_decay_iters = 150
warmup_iters = 10
learning_rate = 3e-3
min_lr = 3e-4
eval_interval = 50
eval_iters = 4
log_interval = 10
keep_checkpoints = 2
