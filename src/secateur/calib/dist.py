"""torch.distributed helpers: the CoCurve sweep, and every run split over processes (gloo on CPU, NCCL on GPUs).

Work is split by blocks of sequences: block ``b`` runs on rank ``b % world``. The reduction is done in
block order on every rank: for each block one ``all_reduce(SUM)`` of a tensor that is non-zero on the
owning rank only (``x + 0 = x`` exactly), then a local running sum in block order. The floating-point
summation order is therefore the same for any world size, and ``H`` is bit-identical for 1 and 2
processes (given the same per-block kernels).

A pruning run over ``N`` processes (``secateur prune --procs N`` or ``torchrun``; the run's
:class:`secateur.models.blocks.Shard`) uses the same idea for every statistic: chunk ``c`` of calibration windows is
computed on rank ``c % N`` into a fresh accumulator, whose state :func:`broadcast` sends to every rank, where it is
merged into the running statistic in chunk order (:func:`ordered_merge`): the summation order is the single
process's, and so are the bits. Evaluation windows travel back the same way (:func:`gather_ordered`).

Decisions that solve (SparseGPT's OBS per projection, the LS / RCPU / COEC / CORP / FLAP-bias compensation per
projection, CORP Q/K per head) go through :func:`owned_map`: the run's solves are numbered in the single process's
order, solve ``k`` runs on rank ``k % N`` only (its owner, :class:`Owners`), and its result (every tensor of it)
is broadcast bit for bit to every rank, which applies it in the single process's order: the solves of one call
proceed in parallel, and the answer is the one process's.

Launch: ``torchrun --nproc_per_node 2 script.py`` (env init: :func:`init_from_env`) or :func:`spawn_gloo` (tests,
benches).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist

from secateur.errors import SecateurError
from secateur.models.blocks import Shard

#: seconds a rank waits for the others in one collective (``SECATEUR_DIST_TIMEOUT`` overrides it)
DEFAULT_TIMEOUT_S = 600.0
#: seconds the ranks wait to meet at the rendezvous (``SECATEUR_JOIN_TIMEOUT`` overrides it)
DEFAULT_JOIN_TIMEOUT_S = 120.0


#: overrides the backend :func:`init_from_env` picks (gloo, nccl): e.g. gloo for several ranks on one GPU, which
#: NCCL refuses ("Duplicate GPU detected", NCCL >= 2.5)
BACKEND_ENV = "SECATEUR_DIST_BACKEND"


def rank_world() -> tuple[int, int]:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def ordered_block_sum(local: dict[int, torch.Tensor], n_blocks: int, shape: tuple[int, ...],
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``sum_b block_b`` in block order, the blocks being spread over the ranks (``local``: this rank's, on any
    device); on the CPU."""
    _, world = rank_world()
    comm = _comm_device() if world > 1 else torch.device("cpu")  # the blocks may be on the GPU; the sum is not
    out = torch.zeros(shape, dtype=dtype)
    for b in range(n_blocks):
        t = local[b].to(comm, dtype).clone() if b in local else torch.zeros(shape, dtype=dtype, device=comm)
        if world > 1:
            tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
        out += t.cpu()
    return out


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    try:
        t = float(raw) if raw else default
    except ValueError:
        raise SecateurError(f"{name}={raw!r} is not a number of seconds; set e.g. {default:g}") from None
    if not t > 0 or t == float("inf"):
        raise SecateurError(f"{name} must be a positive number of seconds, got {raw}; set e.g. {default:g}")
    return t


def timeout_s() -> float:
    """Seconds a rank waits for the others in one collective (``SECATEUR_DIST_TIMEOUT``, default 600)."""
    return _seconds("SECATEUR_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)


def join_timeout_s() -> float:
    """Seconds the ranks wait for each other to meet at ``MASTER_ADDR:MASTER_PORT`` (``SECATEUR_JOIN_TIMEOUT``;
    default the smaller of 120 s and :func:`timeout_s`). Separate from the collective timeout: every rank joins
    right after its options are checked, before any model is loaded, so the ranks meet within seconds of each
    other; an address where nobody listens (rank 0 not started, a wrong host, a firewalled port) is reported
    after this bound instead of after the collective timeout's ten minutes."""
    return _seconds("SECATEUR_JOIN_TIMEOUT", min(DEFAULT_JOIN_TIMEOUT_S, timeout_s()))


def env_world() -> tuple[int, int, int]:
    """``(rank, world, local rank)`` from the environment torchrun (and ``--procs``) set; ``(0, 1, 0)`` outside."""
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", None)):
        raw = os.environ.get(name, default if default is not None else str(values.get("RANK", 0)))
        try:
            values[name] = int(raw)
        except ValueError:
            raise SecateurError(f"{name}={raw[:40]!r} is not an integer; unset it, or let torchrun set WORLD_SIZE, "
                                "RANK and LOCAL_RANK") from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world:
        raise SecateurError(f"RANK {rank} is not in [0, WORLD_SIZE {world}); set RANK from 0 to WORLD_SIZE - 1, or "
                            "let torchrun set them")
    return rank, world, local


def rendezvous() -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` checked before joining: both set, the port a port number, the address one
    this machine resolves. torch's own rendezvous retries an address that does not resolve until its timeout, with
    a warning every few seconds (300 s of them, no secateur line); here it is one line at once."""
    addr, raw = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    fix = "torchrun sets them; set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port, or use --procs N"
    if not addr or not raw:
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", raw)) if not v]
        raise SecateurError(f"WORLD_SIZE > 1 but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                            f"set; {fix}")
    try:
        port = int(raw)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise SecateurError(f"MASTER_PORT={raw[:40]!r} is not a port number (1 to 65535); {fix}") from None
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise SecateurError(f"MASTER_ADDR {addr[:80]!r} (port {port}) does not resolve ({why}); {fix}") from None
    return addr, port


def init_from_env(device: str = "cpu") -> bool:
    """Join the process group the environment describes (``WORLD_SIZE`` > 1: torchrun, ``--procs``): gloo on CPU,
    NCCL when ``device`` is CUDA (each rank on its ``LOCAL_RANK``'s GPU); every collective waits at most
    :func:`timeout_s`. Returns False (nothing to join) with one process or a group already initialized."""
    rank, world, local = env_world()
    if world == 1 or tdist.is_initialized():
        return False
    cuda = str(device).startswith("cuda")
    backend = os.environ.get(BACKEND_ENV) or ("nccl" if cuda else "gloo")
    if backend not in ("gloo", "nccl"):
        raise SecateurError(f"{BACKEND_ENV}={backend!r}: choose gloo or nccl, or unset it")
    if cuda:
        if not torch.cuda.is_available():
            raise SecateurError("--device cuda but no CUDA device is visible to this process")
        gpus = torch.cuda.device_count()
        if backend == "nccl" and local >= gpus:  # before joining: NCCL's own refusal comes as a lost peer, late
            raise SecateurError(
                f"LOCAL_RANK {local} but this machine shows {gpus} GPU(s), and NCCL takes one GPU per "
                f"process (two on one GPU: 'Duplicate GPU detected'); start at most {gpus} process(es) per machine, "
                f"or set {BACKEND_ENV}=gloo to share the GPUs")
        torch.cuda.set_device(local % gpus)  # gloo may share a GPU between processes
    addr, port = rendezvous()
    join, collective = join_timeout_s(), timeout_s()
    try:
        # the store first, bounded by the join timeout (rank 0 serves it and waits for every other rank to
        # connect; the others connect to it), then the group on it with the collectives' own timeout
        store = tdist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timedelta(seconds=join),
                               wait_for_workers=True, multi_tenant=True)
        store.set_timeout(timedelta(seconds=collective))
        tdist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                 timeout=timedelta(seconds=collective))
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError: nobody answered at the address
        first = (str(e).strip().splitlines() or [""])[0][:160]
        who = (f"the other {world - 1} process(es) did not connect to this one (rank 0)" if rank == 0 else
               "rank 0 did not answer")
        raise SecateurError(f"could not join the other processes at MASTER_ADDR {addr}, MASTER_PORT {port}: {who} "
                            f"within SECATEUR_JOIN_TIMEOUT={join:g} s ({type(e).__name__}: {first}); check that "
                            "every rank runs with the same MASTER_ADDR/MASTER_PORT and the port is reachable") from None
    return True


def finish() -> None:
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in a broadcast object (it travels by ``tdist.broadcast``, not by pickle)."""

    i: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class _Record:
    """A dataclass instance in a broadcast object: its class and its (stripped) init fields."""

    cls: type
    fields: dict


def _strip(obj, tensors: list[torch.Tensor]):
    if torch.is_tensor(obj):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _Record(type(obj), {f.name: _strip(getattr(obj, f.name), tensors)
                                   for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _slots(obj) -> Iterable[_Slot]:
    if isinstance(obj, _Slot):
        yield obj
    elif isinstance(obj, _Record):
        yield from _slots(obj.fields)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _slots(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _slots(v)


def _fill(obj, tensors: dict[int, torch.Tensor]):
    if isinstance(obj, _Slot):
        return tensors[obj.i]
    if isinstance(obj, _Record):
        return obj.cls(**_fill(obj.fields, tensors))
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def broadcast(obj, src: int):
    """``obj`` (dicts / lists / tuples / dataclasses of tensors and plain values; a dataclass is rebuilt from its
    init fields) from rank ``src`` to every rank, bit for bit: the structure by pickle, each tensor by
    ``tdist.broadcast`` (on the GPU with NCCL), on every rank on the device kind it has on ``src``."""
    rank, world = rank_world()
    if world == 1:
        return obj
    tensors: list[torch.Tensor] = []
    box = [_strip(obj, tensors) if rank == src else None]
    tdist.broadcast_object_list(box, src=src)
    skeleton, dev = box[0], _comm_device()
    got: dict[int, torch.Tensor] = {}
    for slot in _slots(skeleton):
        if rank == src:
            buf = tensors[slot.i].detach().contiguous().to(dev)
        else:
            buf = torch.empty(slot.shape, dtype=slot.dtype, device=dev)
        if buf.numel():
            tdist.broadcast(buf, src=src)
        got[slot.i] = tensors[slot.i] if rank == src else buf if buf.device.type == slot.device else buf.to(slot.device)
    return _fill(skeleton, got)


def shard() -> Shard:
    """This process's share when ``torch.distributed`` is initialized with several processes (else the whole run)."""
    rank, world = rank_world()
    return Shard(rank, world)


def ordered_merge(accs: dict, contribution: dict | None, owner: int) -> None:
    """Merge one chunk's contribution (``{name: fresh accumulator updated with the chunk}`` on its ``owner`` rank,
    or ``{"error": message}`` when the chunk failed a check there; None elsewhere) into ``accs`` on every rank.
    Called for each chunk in chunk order, so every rank's ``accs`` end as the single process's, bit for bit."""
    rank, _ = rank_world()
    payload = None
    if rank == owner:
        payload = contribution if "error" in contribution else {k: a.state() for k, a in contribution.items()}
    payload = broadcast(payload, owner)
    if "error" in payload:
        raise SecateurError(payload["error"])
    for k, a in accs.items():
        a.merge(a.with_state(payload[k]))


#: solves run by this process, by kind (:func:`owned_map`'s ``kind``): what the tests read to see them split
SOLVES: Counter = Counter()


def owned_map(items: Sequence, fn: Callable, first: int = 0, kind: str = "solve", workers: int = 1) -> list:
    """``[fn(x) for x in items]`` on every rank, each ``fn(items[j])`` run once, on rank ``(first + j) % N`` (its
    owner), its result (tensors bit for bit, :func:`broadcast`) sent to every rank; in item order. With one process
    it is the plain list. Every rank calls it with the same items in the same order. A solve that fails on its
    owner ends every rank: the owner with its own error, the others with the owner's line. ``workers > 1``: this
    rank's solves run side by side on that many Python threads (``fn`` must be thread-safe, and the caller pins
    torch to one thread per solve so the result does not depend on ``workers``); failures are reported in item
    order as in the sequential loop."""
    rank, world = rank_world()
    mine = [j for j in range(len(items)) if (first + j) % world == rank]
    out: list = [None] * len(items)
    failed: dict[int, Exception] = {}
    for j, res, err in _run_mine(items, mine, fn, workers):  # in parallel with the other ranks' solves
        SOLVES[kind] += 1
        if err is not None and world == 1:
            raise err
        if err is not None:  # the others wait for this result: tell them, then end here with the cause
            failed[j] = err
            line = (str(err) if isinstance(err, SecateurError)
                    else f"rank {rank}: {type(err).__name__}: {str(err)[:200]}")
            out[j] = {_FAILED: line}
            break  # nothing after it is needed: every rank stops at this item
        out[j] = res
    if world == 1:
        return out
    for j in range(len(items)):
        owner = (first + j) % world
        got = broadcast(out[j] if owner == rank else None, owner)
        if isinstance(got, dict) and _FAILED in got:
            if j in failed:
                raise failed[j]
            raise SecateurError(got[_FAILED])
        out[j] = got
    return out


def _run_mine(items: Sequence, mine: list[int], fn: Callable,
              workers: int) -> Iterator[tuple[int, object, Exception | None]]:
    """``(j, fn(items[j]) or None, its exception or None)`` for this rank's items in order: one after another (a
    failure ends the loop before the next solve starts), or all submitted to ``workers`` threads at once."""
    if workers <= 1 or len(mine) <= 1:
        for j in mine:
            try:
                yield j, fn(items[j]), None
            except Exception as e:  # noqa: BLE001 - handed to owned_map, which raises or reports it
                yield j, None, e
                return
        return
    with cf.ThreadPoolExecutor(min(workers, len(mine))) as ex:
        futures = [(j, ex.submit(fn, items[j])) for j in mine]
        for j, f in futures:
            err = f.exception()
            yield j, (None if err else f.result()), err


_FAILED = "__secateur_solve_failed__"


class Owners:
    """The round-robin owners of a run's solves: the ``k``-th solve of the run, counted in the single process's
    order, is owned by rank ``k % N`` (:func:`owned_map`). One per handler, called in the same order on every rank."""

    def __init__(self, kind: str = "solve") -> None:
        self.kind = kind
        self.count = 0

    def map(self, items: Sequence, fn: Callable, workers: int = 1) -> list:
        items = list(items)
        out = owned_map(items, fn, self.count, self.kind, workers)
        self.count += len(items)
        return out


def gather_ordered(local: dict[int, object], n: int) -> list:
    """Items ``0 .. n-1`` spread over the ranks (``local``: this rank's, by index), on every rank, in index order."""
    if rank_world()[1] == 1:
        return [local[i] for i in range(n)]
    parts: list[dict | None] = [None] * rank_world()[1]
    tdist.all_gather_object(parts, local)
    merged = {i: v for p in parts for i, v in p.items()}
    return [merged[i] for i in range(n)]


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (``[obj]`` in one process)."""
    _, world = rank_world()
    if world == 1:
        return [obj]
    parts: list = [None] * world
    tdist.all_gather_object(parts, obj)
    return parts


def barrier() -> None:
    """Every rank waits here for the others (nothing in one process): e.g. files one rank wrote are complete before
    another reads or deletes them."""
    if rank_world()[1] > 1:
        tdist.barrier()


def agree(error: str | None) -> None:
    """Every rank ends with the first rank's error (in rank order) when any rank has one: a check some ranks may fail
    (a file only some of them see, a memory plan that fits on one machine only) fails on every rank in one line."""
    errors = [e for e in gather_objects(error) if e]
    if errors:
        raise SecateurError(errors[0])


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
