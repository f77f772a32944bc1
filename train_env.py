"""
Where a training process runs, for train.py: setup(cfg) joins the process group under torchrun
(DDP, or FSDP on any number of ranks, a process group of one included), picks the device and the
precision, and returns an Env, which the loop asks for its rank, its device, bf16 autocast, a
sum over the ranks, and a log line printed by rank 0 alone.
"""
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from settings import UserError


@dataclass
class Env:
    """Where this process runs: its rank among `world` ranks, its device and its precision."""
    ddp: bool   # in a process group (DDP, or FSDP on any number of ranks)
    rank: int
    world: int
    device: torch.device
    dtype: str  # "float32" | "bfloat16" (autocast)
    fsdp: bool = False  # weights, gradients and optimizer state sharded over the ranks

    @property
    def master(self):
        return self.rank == 0

    def log(self, *args, **kw):
        if self.master:  # rank 0 alone prints
            print(*args, **kw, flush=True)

    def autocast(self):
        if self.dtype == "float32":
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def all_sum(self, t):
        if self.ddp:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t


def setup(cfg):
    """Join the process group (under torchrun), pick the device and the precision."""
    fsdp = cfg["fsdp"]
    torchrun = int(os.environ.get("RANK", -1)) != -1
    ddp = torchrun and (int(os.environ.get("WORLD_SIZE", 1)) > 1 or fsdp)
    world = int(os.environ["WORLD_SIZE"]) if ddp else 1
    G = cfg["gradient_accumulation_steps"]
    if G % world:
        raise UserError(f"gradient_accumulation_steps={G} (global) is not divisible by the "
                        f"world size {world}; pick a multiple of {world}")
    if cfg["cpu_threads"] > 0:
        torch.set_num_threads(cfg["cpu_threads"])
    want_cuda = cfg["device"].startswith("cuda") or (cfg["device"] == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise UserError(f"device={cfg['device']!r} but this torch ({torch.__version__}) sees no CUDA GPU; "
                        f"use --device=cpu (and a small config, e.g. config/tiny_cpu.py)")
    rank = 0
    if ddp:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = torch.device(f"cuda:{local_rank}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    elif fsdp:  # `python train.py --fsdp=True`: FSDP over a process group of one
        ddp = True
        device = torch.device(("cuda" if want_cuda else "cpu") if cfg["device"] == "auto" else cfg["device"])
        if device.type == "cuda":
            device = torch.device("cuda", device.index or 0)
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    else:
        device = torch.device("cuda" if cfg["device"] == "auto" and want_cuda else
                              "cpu" if cfg["device"] == "auto" else cfg["device"])
    dtype = cfg["dtype"] if cfg["dtype"] != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Env(ddp, rank, world, device, dtype, fsdp)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
