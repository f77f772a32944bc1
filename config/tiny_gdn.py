# tiny_cpu.py with the GDN mixer (PRISM's baseline at the same size).
import os
exec(open(os.path.join(os.path.dirname(__file__), "tiny_cpu.py")).read())
out_dir = "out/tiny_gdn"
mixer = "gdn"
