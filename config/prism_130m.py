# PRISM, 130M class: the GDN-130M model (config/gdn_130m.py, same training recipe and the
# sources for it) with the rank-L anchored solver write, L = 3 (PRISM_SPEC.md §2.3 defaults).
import os
exec(open(os.path.join(os.path.dirname(__file__), "gdn_130m.py")).read())

out_dir = "out/prism_130m"
mixer = "prism"
solver_steps = 3
solver_rank = 64
