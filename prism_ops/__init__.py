"""
The Triton kernels behind prism_kernel.py, one file per stage or op family, each stating its
maths at the top. prism_kernel.py is the entry point: the argument checks, the autograd and the
torch.library custom ops that compose these stages.

    tiles.py      what the chunk stages share: tile helpers (masked tile pointers, chunk and
                  sequence coordinates, int64 offsets, the dot's precision rule), the launch
                  table (launch_config, smem_estimate, OVERRIDES), packed-sequence tables
    chunk_fwd.py  the chunk forward: the in-chunk solve, W, U', R, the state pass, the output
    chunk_bwd.py  the chunk backward: dU, the reverse state pass, the injected rows' and the
                  chunk-local gradients
    l2norm.py     F.normalize in Triton: q and k inside the chunk op, rows in registers
    conv.py       the causal depthwise short conv (+ SiLU), forward and backward
    solver.py     PRISM's solver chain, forward and backward
    decode.py     decoding against a cache: conv_step, recurrent_prism_step, the fused norms,
                  silu_mul, rope_kv_write, decode_attention

The modules import one another relatively and nothing else of the repo, so a copy of this
folder beside a copy of prism_kernel.py (the directory export_hf.py writes) runs on its own.
"""
