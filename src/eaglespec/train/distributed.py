"""Several training processes under torchrun: the process group (nccl on GPU, gloo on CPU), each process's
device, DistributedDataParallel, and the sums that make logged figures cover the whole global batch.
One process (no WORLD_SIZE) skips all of it."""

from __future__ import annotations

import os

import torch


def init_processes(device: str) -> tuple[int, int]:
    """(rank, world) and initialise torch.distributed when launched by torchrun (nccl on GPU, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), world


def process_device(device: str, rank: int) -> torch.device:
    """`device`, with "cuda" meaning this process's own GPU."""
    gpu = f"cuda:{rank % max(1, torch.cuda.device_count())}"
    return torch.device(gpu if device == "cuda" else device)


def data_parallel(model: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """`model` wrapped in DistributedDataParallel when there are several processes, else `model` itself."""
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = None if device.type == "cpu" else [device]
    return DistributedDataParallel(model, device_ids=ids)


def sum_over_ranks(loss: float, stats: list[dict]) -> tuple[float, list[dict]]:
    """The step's loss and per-TTT-step counts summed over all processes."""
    import torch.distributed as dist

    flat = torch.tensor([loss] + [float(v) for s in stats for v in (s["correct"], s["count"])], dtype=torch.float64)
    dist.all_reduce(flat)
    vals = flat.tolist()
    return vals[0], [{"correct": int(vals[1 + 2 * k]), "count": int(vals[2 + 2 * k])} for k in range(len(stats))]


def barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
