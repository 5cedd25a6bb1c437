"""Join the process group the way every rank does: the backend ``auto`` resolves to,
the torch thread count, the rank's device. Shared by pipeline ranks (``executor.worker``)
and measuring ranks (``executor.spawn``)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def resolve_backend(requested: str) -> str:
    """``auto`` means NCCL where CUDA is available, gloo everywhere else."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_rank(backend: str, threads: int, timeout: float = 60.0) -> tuple[int, int, torch.device, str]:
    """Join the process group as a pipeline rank would: one torch thread per rank on CPU
    (what ``pipesim run`` uses), the rank's own GPU with NCCL. Returns rank, world
    size, device and the backend in use."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(threads)
    backend = resolve_backend(backend)
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                                device_id=device if backend == "nccl" else None)
    return rank, world, device, backend


def check_devices(backend: str, ranks: int) -> None:
    """Refuse, before any process starts, more local NCCL ranks than visible GPUs: rank
    r takes ``cuda:r``, and NCCL refuses two ranks on one GPU ("Duplicate GPU detected"),
    so such a run could only die in start-up."""
    if resolve_backend(backend) != "nccl":
        return
    from executor.config import ConfigError  # noqa: PLC0415

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ConfigError(
            f"{ranks} ranks on this node need {ranks} GPUs with NCCL (one GPU per rank), but "
            f"{visible} {'is' if visible == 1 else 'are'} visible{where}; run fewer ranks, or add "
            f"--backend gloo to run on CPU"
        )
