"""Where a tensor-parallel engine's ranks run, and how their group talks (workers/tp_group.py).

Devices. Rank r of an engine on `cuda:b` (`cuda` is `cuda:0`) runs on `cuda:b+r`: the GPUs are
counted among those this process sees, so under Ray, which gives a worker actor of N ranks N
GPUs and sets its CUDA_VISIBLE_DEVICES to them, rank r takes the r-th of them; the followers
are processes rank 0 starts and inherit that variable. On CPU every rank is `cpu`.

Backends. One default group an engine, with two backends: gloo for CPU tensors (the plan and
each step's inputs, which rank 0 builds on the host) and, on GPUs, NCCL for CUDA tensors (the
model's all-reduces and the logits' gather, and the memory plan's figures stay on gloo). torch
dispatches each collective by its tensor's device ("cpu:gloo,cuda:nccl"). On one CPU node the
model's collectives go through shared memory instead (workers/model/shm_collectives.py).

NOT RUN ON A GPU YET: no machine with more than one GPU has been lent (docs/tensor-parallel.md).
"""

from __future__ import annotations

import torch

GLOO = "gloo"
GLOO_AND_NCCL = "cpu:gloo,cuda:nccl"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device rank `rank` runs on, for an engine (rank 0) on `device`."""
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tensor_parallel_size: ranks run on cpu or cuda, not {device.type}")
    return torch.device("cuda", (device.index or 0) + rank)


def check_rank_devices(device: torch.device, size: int, device_count: int) -> None:
    """ValueError unless the `size` ranks of an engine on `device` each find their GPU among the
    `device_count` this process sees."""
    if device.type != "cuda":
        return
    first = device.index or 0
    if first + size > device_count:
        raise ValueError(f"tensor_parallel_size: {size} ranks from cuda:{first} need GPUs cuda:{first}.."
                         f"cuda:{first + size - 1}, and this process sees {device_count} (under Ray a worker "
                         "gets as many GPUs as it has ranks; offline, CUDA_VISIBLE_DEVICES lists them)")


def group_backend(device: torch.device) -> str:
    """torch.distributed's backend string for a group whose ranks run on `device`'s type."""
    return GLOO_AND_NCCL if device.type == "cuda" else GLOO
