# Llama-style baseline: causal softmax attention + RoPE in every layer, pre-RMSNorm, SwiGLU,
# tied embeddings; 768 wide x 12 layers x 6 heads of 128 (same width/depth as the others).
# Same training recipe as config/gdn_130m.py (see the sources there).
import os
exec(open(os.path.join(os.path.dirname(__file__), "gdn_130m.py")).read())

out_dir = "out/transformer_130m"
mixer = "attention"
