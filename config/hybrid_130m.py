# Hybrid: PRISM-130M with causal softmax attention (RoPE) at layers 5 and 11.
# Why these two: one attention layer after every five recurrent ones (a 5:1 interleave, sparser
# than the 3:1 of recent linear/full hybrids so the model stays mostly recurrent and its KV
# cache sits in 2 of 12 layers); the middle one gives exact retrieval to the upper half, the
# last one right before the head. Same width, depth and training recipe as config/gdn_130m.py.
import os
exec(open(os.path.join(os.path.dirname(__file__), "prism_130m.py")).read())

out_dir = "out/hybrid_130m"
attn_layers = [5, 11]
