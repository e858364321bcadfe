"""torch.distributed helpers for the CoCurve sweep (gloo on CPU, NCCL on GPUs).

Work is split by blocks of sequences: block ``b`` runs on rank ``b % world``. The reduction is done in
block order on every rank: for each block one ``all_reduce(SUM)`` of a tensor that is non-zero on the
owning rank only (``x + 0 = x`` exactly), then a local running sum in block order. The floating-point
summation order is therefore the same for any world size, and ``H`` is bit-identical for 1 and 2
processes (given the same per-block kernels).

Launch: ``torchrun --nproc_per_node 2 script.py`` (env init) or :func:`spawn_gloo` (tests, benches).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as tdist


def rank_world() -> tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def ordered_block_sum(local: dict[int, torch.Tensor], n_blocks: int, shape: tuple[int, ...],
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``sum_b block_b`` in block order, the blocks being spread over the ranks (``local``: this rank's)."""
    _, world = rank_world()
    out = torch.zeros(shape, dtype=dtype)
    for b in range(n_blocks):
        t = local[b].to(dtype).clone() if b in local else torch.zeros(shape, dtype=dtype)
        if world > 1:
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        out += t
    return out


def sum_floats(values: list[float]) -> list[float]:
    """Sum a few scalars over the ranks (timings, counters)."""
    t = torch.tensor(values, dtype=torch.float64)
    if rank_world()[1] > 1:
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t.tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        tdist.barrier()
        tdist.destroy_process_group()


def spawn_gloo(fn: Callable, world: int, args: tuple = (), threads: int = 1) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo process group.

    ``fn`` must be importable (a module-level function); results travel through files."""
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, free_port(), fn, args, threads), nprocs=world, join=True)
