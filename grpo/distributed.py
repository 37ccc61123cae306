"""Data parallelism under torchrun: N ranks, each with its own prompts and engine, one set of adapters.

`torchrun --nproc-per-node N train.py ...` starts N copies of the run. Each rank samples its own
prompts with its own engine; the ranks meet only where the loop needs the whole batch:

    world = init_world()                          # from torchrun's env; no process group without it
    table = world.gather_rows(per_completion)     # (N*P*G, C) every rank's rows, in rank order
    n_tok = world.sum(local_tokens)               # the global token count (loss norm "token")
    nonfinite = world.sum_grads_(params, nonfinite)  # adapter gradients summed; one bad rank skips all
    world.barrier()                               # rank 0 writes, the others wait

Built on torch.distributed (NCCL on GPUs, gloo on CPU). Deliberately not DistributedDataParallel:
the trainable parameters are the LoRA adapters (tens of MB at most), so one flat all-reduce per
optimizer step costs what DDP's buckets would, and the loop stays free of DDP's hooks (no `no_sync`
around micro-batches, no static-graph care with gradient checkpointing, and rank 0 may sample alone
for evaluation). Not here either: tensor or pipeline parallelism, or any launcher of its own.

Without WORLD_SIZE > 1 in the environment (a plain `python train.py`) no process group is made and
every method is the identity or a no-op.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off unless the user says otherwise: it buys nothing for an all-reduce
# of a few MB of adapter gradients, and on a shared host a program using it can take the GPUs out of
# service for everyone.
NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Rank 0 evaluates and saves while the others wait in their next collective; NCCL's default of 10
# minutes would kill a run whose held-out evaluation takes longer.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


def nccl_env_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL settings to add to `environ`: those of NCCL_ENV_DEFAULTS that the user did not set."""
    return {k: v for k, v in NCCL_ENV_DEFAULTS.items() if k not in environ}


@dataclass(frozen=True)
class World:
    """This process's place among the ranks, and the few collectives the trainer uses."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where collectives run
    owns_group: bool = False  # init_world made the process group (not the caller's own), so close() ends it

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, logs, evaluates and saves."""
        return self.rank == 0

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over ranks (a new tensor on value's device; the input is left as it is)."""
        if self.size == 1:
            return value

        total = value.detach().to(self.device, copy=True)
        dist.all_reduce(total)
        return total.to(value.device)

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, ...) on every rank -> (size*n, ...): all ranks' rows, rank 0's first. Shapes must match."""
        if self.size == 1:
            return rows

        mine = rows.detach().to(self.device).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine)
        return torch.cat(parts).to(rows.device)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        if self.size == 1:
            return [obj]

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def reduce_stats(self, stats: Mapping[str, float]) -> dict[str, float]:
        """Sum each statistic over ranks; keys ending in `_min` / `_max` take the min / max instead.

        Every rank must hold the same keys (values already weighted by the rank's share of the batch).
        """
        if self.size == 1:
            return dict(stats)
        keys = sorted(stats)
        table = self.gather_rows(torch.tensor([[float(stats[k]) for k in keys]], dtype=torch.float64))  # (size, K)
        out = {}
        for j, k in enumerate(keys):
            column = table[:, j]
            out[k] = float(column.min() if k.endswith("_min") else column.max() if k.endswith("_max")
                           else column.sum())
        return out

    def sum_grads_(self, params: Sequence[torch.nn.Parameter], nonfinite: bool) -> bool:
        """Sum the gradients of `params` over ranks, in place, in one flat all-reduce; returns whether any
        rank saw a non-finite loss.

        A rank that stopped its micro-batches early (non-finite loss) still joins, so none waits forever;
        the flag travelling in the same buffer then makes every rank skip the step. Parameters without a
        gradient are sent as zeros and keep no gradient, as in a one-process run.
        """
        if self.size == 1:
            return nonfinite

        flag = torch.tensor([float(nonfinite)], device=self.device)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params] + [flag])  # (n_params + 1,) fp32 whatever the grads' dtype
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return bool(flat[-1] > 0)

    @torch.no_grad()
    def broadcast_(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Overwrite `params` with rank 0's values, so every rank starts from the same adapters."""
        if self.size == 1:
            return

        for p in params:
            dist.broadcast(p.data, src=0)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def close(self) -> None:
        """Destroy the process group if init_world made it; one the caller made stays theirs."""
        if self.owns_group:
            if dist.is_initialized():
                dist.destroy_process_group()


def init_world() -> World:
    """The World that torchrun's environment describes; a one-process World without WORLD_SIZE > 1.

    On CUDA each rank takes cuda:LOCAL_RANK and talks NCCL (with NVLink multicast off unless the user
    set NCCL_ENV_DEFAULTS' variables); on CPU the ranks talk gloo.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={size} but {', '.join(missing)} unset; fix: launch with "
                         f"`torchrun --nproc-per-node {size} train.py ...`")

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPUs are visible; fix: "
                             f"torchrun --nproc-per-node {torch.cuda.device_count()} or fewer")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        os.environ.update(nccl_env_defaults(os.environ))  # read by NCCL when the group is made
    else:
        device = torch.device("cpu")
    owns_group = not dist.is_initialized()
    if owns_group:
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    return World(rank=rank, size=dist.get_world_size(), local_rank=local_rank, device=device, owns_group=owns_group)
