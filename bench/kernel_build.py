"""Another build of the kernels beside the repo's (bench_kernel.py --kernel, kernel_sweep.py
--kernel, bench_conv.py --compare, kernel_split_ptx.py): a prism_kernel.py file, and the
prism_ops/ folder beside it where the build has one."""
import importlib.util
import itertools
import os
import sys

_builds = itertools.count()


def load_build(path):
    """The module of the prism_kernel.py at `path`, imported as a submodule of a package of its
    own (the file's folder), so that its `from .prism_ops import ...` loads the prism_ops/ beside
    it and never the repo's, and its custom ops register under a namespace of their own. A build
    in one file (no prism_ops/) loads the same way."""
    path = os.path.abspath(path)
    pkg = f"_kernel_build_{next(_builds)}"
    spec = importlib.util.spec_from_loader(pkg, loader=None, is_package=True)
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [os.path.dirname(path)]
    sys.modules[pkg] = package
    name = f"{pkg}.{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
