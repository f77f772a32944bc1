import os

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. The switch must precede the first
# `import triton` anywhere in the test run (torch.compile / dynamo import it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes gain nothing from threads, and OpenMP threads on a busy 2-core box can make
    each op 50x slower (spin-waits). Restored afterwards for the other test files."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
