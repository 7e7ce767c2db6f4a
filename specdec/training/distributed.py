"""The ranks of a data-parallel training run under ``torchrun`` (torch.distributed), and the one rank of a
run without it.

    ranks = init_ranks("cuda")      # torchrun's RANK / WORLD_SIZE / LOCAL_RANK; NCCL on GPUs, gloo on CPUs
    train_head3(target, data, out, config, ranks=ranks)
    close_ranks(ranks)

W ranks, r this rank. Conversation i belongs to rank i % W: it answers, stores and reads that shard's
features, and every rank knows every conversation's ids (``eagle_data.ShardedData``). A step's global
batch is a pure function of (seed, step) over all conversations, whatever W; each rank computes the
losses of the batch's conversations it holds, divided by the whole batch's position counts (one small
all-reduce), so the summed gradient is one process's gradient for the same global batch, up to the
order of fp32 sums. Why DDP and not FSDP, and what a checkpoint holds: docs/decisions/022-distributed-training.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# the collective backend per device type: NCCL between GPUs, gloo between CPU processes
BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class Ranks:
    rank: int = 0  # this process's rank r
    world: int = 1  # ranks W (1: no process group, no collective)
    device: torch.device = torch.device("cpu")  # where this rank's target, head and batches live

    @property
    def lead(self) -> bool:
        """Rank 0 writes the checkpoints and the head, and logs."""
        return self.rank == 0

    def owns(self, conv: int) -> bool:
        """Conversation ``conv`` is in this rank's shard."""
        return conv % self.world == self.rank

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (in place; itself with one rank). A host sync where it is read."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on one (a time budget read from each rank's own clock)."""
        if self.world == 1:
            return flag  # no device tensor, no host sync
        return bool(self.sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


SOLO = Ranks()


def init_ranks(device: str = "cpu") -> Ranks:
    """This process's rank: of the process group already made (by the caller), else of the one torchrun's
    environment describes (made here: its backend follows the device, BACKENDS), else the only rank.
    Rank r of a GPU run uses its machine's GPU LOCAL_RANK."""
    dev = torch.device(device)
    if not dist.is_initialized():
        if not dist.is_torchelastic_launched():
            return Ranks(0, 1, dev)
        if dev.type not in BACKENDS:
            raise ValueError(f"training under torchrun needs a device of type {' or '.join(BACKENDS)}, not {device!r}")
        dist.init_process_group(BACKENDS[dev.type])  # RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    if dev.type == "cuda":
        dev = torch.device("cuda", dist.get_node_local_rank(fallback_rank=rank % torch.cuda.device_count()))
        torch.cuda.set_device(dev)  # one GPU per rank on each machine
    return Ranks(rank, world, dev)


def close_ranks(ranks: Ranks) -> None:
    """Leave the process group (torchrun's, or the caller's), if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()
