"""Training across processes on torch.distributed: the launch, the process group, DDP or FSDP2.

A run launched by `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK in the environment) trains one model on
W = WORLD_SIZE processes. Rank r of W with a per-process batch b reads rows r·b .. (r+1)·b − 1 of the
global micro-batch `get_batch(split, i, W·b)`, so micro-batch i holds the same rows at every world
size. Each rank's loss ℓ_r is the mean over its rows; the gradients are averaged over ranks once per
optimizer step,

    g = (1/W) Σ_r ∇ℓ_r = ∇ (mean over the W·b rows)        (rows of equal weight, as in an LM batch)

which equals one process with batch W·b. Reported losses are the same mean over ranks, computed as
SUM / W (gloo's AVG reduction has been reported to sum: pytorch issue 162338).

`parallel`:
  "ddp"   DistributedDataParallel: every rank holds the whole model and optimizer; gradients are
          all-reduced during the backward of the last micro-batch (`no_sync` before it).
  "fsdp"  FSDP2 (`fully_shard` per block, then the root): parameters, gradients and optimizer state
          are sharded W ways along dim 0 and all-gathered block by block for compute.
  "none"  one process (the only choice when W = 1).
  "auto"  "ddp" when W > 1, else "none".

Checkpoints keep the single-process format: the full state dicts gathered to rank 0, which alone
writes them, plus every rank's RNG state.

A rank that ends before the others (killed, crashed) fails their next collective; within
`process_group` that failure becomes `RankLost`, one line naming the ranks whose processes ended; a
collective that waits past the timeout for a rank still alive becomes `CollectiveTimeout`, one line too.
torchrun's agent stops the surviving ranks with SIGTERM, which there raises SystemExit, so that they
leave through their `finally`s (the run lock's file removed, a half-written checkpoint cleaned up).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _checks
from ..errors import UserError
from ..launch import Launch, current_launch, launch_from_env
from ..nn.dtypes import at_least_float32
from .config import PARALLEL
from .optim import MuonWithAdamW

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "PLAINFORMER_DIST_TIMEOUT"  # seconds a collective may wait for a peer before failing
#: Seconds a rank whose collective failed waits for the peer that caused it to be seen ended: its sockets
#: close as the kernel tears it down, a moment before it becomes a zombie.
LOST_RANK_PATIENCE_S = 2.0
#: The same when gloo says the peer closed the connection: a rank that failed closes its sockets as it leaves
#: the process group, then spends seconds in the interpreter's teardown (more on a loaded machine), and torchrun's
#: agent gives a rank 30 s after SIGTERM before it kills it.
CLOSED_BY_PEER_PATIENCE_S = 30.0


class RankLost(UserError):
    """Ranks of the launch ended (killed, crashed) while this one still needed them: what `process_group`
    raises on the others in place of the failed collective's error. `reporting`: this is the lowest rank
    still running, the one that says so."""

    def __init__(self, lost: Sequence[int], world_size: int, rank: int, reporting: bool):
        ranks = f"rank {lost[0]}" if len(lost) == 1 else "ranks " + ", ".join(map(str, lost))
        its = "its process has" if len(lost) == 1 else "their processes have"
        super().__init__(f"{ranks} of the {world_size} stopped ({its} ended), so rank {rank} stopped too")
        self.lost, self.reporting = list(lost), reporting


class CollectiveTimeout(UserError):
    """A collective waited past the process group's timeout for a peer that is alive (stuck, or far slower):
    what `process_group` raises in place of gloo's error. Every rank it happens to says so (`reporting`)."""

    reporting = True

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        super().__init__(f"rank {rank} of the {world_size} waited {timeout_s:g} s for the others in a collective and "
                         f"stopped (one is stuck, or far slower); {TIMEOUT_ENV}=SECONDS waits longer")


def _timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


@contextlib.contextmanager
def process_group(timeout_s: float | None = None) -> Iterator[Launch]:
    """Join the job described by the environment for the duration of the block.

    Initialises the default process group when WORLD_SIZE > 1 and none exists yet — gloo for CPU
    tensors, NCCL for CUDA tensors with this process on cuda:LOCAL_RANK — and destroys it on every way
    out of the block (return, exception, Ctrl-C). A collective that waits longer than `timeout_s`
    (default $PLAINFORMER_DIST_TIMEOUT, else 600 s) for a peer, a rank that died, fails instead of hanging.

    An error that leaves the block once another rank's process on this machine has ended becomes
    `RankLost` naming it (after that, this process ignores SIGTERM: it is ending). Within the block,
    SIGTERM raises SystemExit(128 + SIGTERM) (see the module docstring).
    """
    launch = launch_from_env()
    if launch.world_size == 1 or dist.is_initialized():
        yield current_launch()
        return
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else _timeout_s())
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout,
                                device_id=torch.device("cuda", launch.local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        processes: list[Any] = [None] * launch.world_size
        dist.all_gather_object(processes, _this_process())
        with _sigterm_exits():
            try:
                yield launch
            except BaseException as error:
                lost = _lost_ranks(processes, launch.rank, error)
                if not lost and _says(error, "Timed out"):
                    raise CollectiveTimeout(launch.rank, launch.world_size, timeout.total_seconds()) from error
                if not lost:
                    raise
                reporting = min(set(range(launch.world_size)) - set(lost)) == launch.rank
                raise RankLost(lost, launch.world_size, launch.rank, reporting) from error
    finally:
        dist.destroy_process_group()


def _this_process() -> tuple[str, int]:
    """(this machine, this process's pid): the machine is its host name and its pid namespace, in which
    the pid means this process."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()} {namespace}", os.getpid()


def _lost_ranks(processes: Sequence[tuple[str, int]], rank: int, error: BaseException) -> list[int]:
    """The ranks, other than `rank`, whose processes on this machine have ended, when `error`, which left
    the process group's block, is what a lost rank causes: a collective's failure (a RuntimeError) or the
    agent's SIGTERM (SystemExit); waits up to LOST_RANK_PATIENCE_S for one to be seen ended. Any other
    error is this rank's own (a user error every rank raises, Ctrl-C): none. While looking, SIGTERM is
    ignored; it stays so when ranks were lost."""
    if not isinstance(error, (RuntimeError, SystemExit)):
        return []
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if _in_main_thread() else None
    here = _this_process()[0]
    closed = _says(error, "closed by peer") or _says(error, "reset by peer")
    deadline = time.monotonic() + (CLOSED_BY_PEER_PATIENCE_S if closed else LOST_RANK_PATIENCE_S)
    while True:
        lost = [r for r, (machine, pid) in enumerate(processes)
                if r != rank and machine == here and _has_ended(pid)]
        if lost or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if previous is not None and not lost:
        signal.signal(signal.SIGTERM, previous)
    return lost


def _says(error: BaseException, words: str) -> bool:
    """Whether `error` is a RuntimeError of torch.distributed's backend whose message holds `words` (gloo's
    errors have no type of their own)."""
    return isinstance(error, RuntimeError) and words in str(error)


def _has_ended(pid: int) -> bool:
    """Whether process `pid` of this machine has ended (a zombie has: only its exit status is left)."""
    if not os.path.exists("/proc/self/stat"):  # no /proc: ask the kernel (a zombie counts as running)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # the state follows the command name, which is in parentheses
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Within (in the main thread, where Python runs signal handlers): SIGTERM raises SystemExit(128 + SIGTERM)."""
    if not _in_main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is stop:  # not once a lost rank made this process ignore it
            signal.signal(signal.SIGTERM, previous)


def resolve_parallel(parallel: str, world_size: int) -> str:
    """"auto" -> "ddp" when world_size > 1; any choice -> "none" in one process."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if world_size == 1:
        return "none"
    if parallel == "none":
        raise ValueError(f"parallel='none' cannot train one model on {world_size} processes; use "
                         "'ddp' or 'fsdp', or launch a single process")
    return "ddp" if parallel == "auto" else parallel


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated layers: the elements of every outermost nn.ModuleList (GPT.blocks, the encoder's
    and decoder's layers, ...); lists nested inside them, such as MoE experts, stay in their block."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            blocks.extend(module)
            inside.update(id(m) for m in module.modules())
    return blocks


class Distributed:
    """The trainer's view of the job: wraps the model, slices batches, reduces scalars, gathers state.

    In one process (world_size 1, parallel "none") every method is the identity or the plain
    single-process operation, so the trainer has one code path.
    """

    def __init__(self, parallel: str = "auto"):
        self.launch = current_launch()
        if self.launch.world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"WORLD_SIZE={self.launch.world_size} but no process group is initialised; "
                               "enter plainformer.training.distributed.process_group() first")
        self.parallel = resolve_parallel(parallel, self.launch.world_size)
        self.module: nn.Module | None = None
        # The module to call: the model itself, its DistributedDataParallel or its FSDP module.
        self.wrapped: Any = None

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        return self.launch.is_main

    # ------------------------------------------------------------------------- the model

    @property
    def model(self) -> nn.Module:
        """The model given to `wrap` (sharded in place under FSDP)."""
        if self.module is None:
            raise RuntimeError("Distributed.wrap(model) must be called first")
        return self.module

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to call for forward and backward. A CUDA model moves to cuda:LOCAL_RANK first.
        DDP copies rank 0's weights to every rank; for FSDP they are broadcast before sharding, so
        the ranks need not have been seeded alike. FSDP shards `model` in place."""
        if self.parallel != "none" and next(model.parameters()).device.type == "cuda":
            model.to(torch.device("cuda", self.launch.local_rank))
        self.module = model
        if self.parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            on_cuda = next(model.parameters()).device.type == "cuda"
            self.wrapped = DistributedDataParallel(
                model, device_ids=[self.launch.local_rank] if on_cuda else None)
        elif self.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor, src=0)
            for block in _blocks(model):
                fully_shard(block)
            self.wrapped = fully_shard(model)
        else:
            self.wrapped = model
        return self.wrapped

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Around the forward and backward of one micro-batch: gradients are reduced over ranks only
        when `sync` (the last micro-batch of an optimizer step); before that they accumulate locally."""
        if self.parallel == "ddp" and not sync:
            return self.wrapped.no_sync()
        if self.parallel == "fsdp":
            self.wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------- data and scalars

    def global_batch_size(self, batch_size: int) -> int:
        return batch_size * self.world_size

    def rows(self, batch: Mapping[str, Tensor], batch_size: int) -> dict[str, Tensor]:
        """This rank's rows r·b .. (r+1)·b − 1 of a global batch whose tensors are (W·b, ...)."""
        if self.world_size == 1:
            return dict(batch)
        start = self.rank * batch_size
        return {name: tensor[start:start + batch_size] for name, tensor in batch.items()}

    def mean(self, value: Tensor) -> Tensor:
        """The mean of a scalar tensor over ranks (SUM / W; every rank gets it)."""
        if self.world_size == 1:
            return value
        total = at_least_float32(value.detach()).clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on one, so that all ranks leave a loop together."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)])  # a CPU tensor: gloo carries it under either backend
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    @staticmethod
    def local(value: Tensor) -> Tensor:
        """A plain tensor for a DTensor (FSDP's gradient norm), else `value` itself."""
        full_tensor = getattr(value, "full_tensor", None)
        return full_tensor() if callable(full_tensor) else value

    # ------------------------------------------------------------------------- checkpoints

    def model_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded state dict of the model, on CPU; complete on rank 0 (FSDP: empty on
        the others). Every rank must call it."""
        if self.parallel != "fsdp":
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _tied(self.model, cast(dict[str, Tensor], state))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state dict in `torch.optim` layout (state keyed by parameter index in
        param_groups order), whatever the sharding; complete on rank 0. Every rank must call it."""
        if self.parallel != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        by_name: dict[str, Any] = get_optimizer_state_dict(self.model, _torch_optimizers(optimizer),
                                                           options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))
        if not by_name:
            return {}
        index: dict[str, int] = {}
        groups = []
        for group in by_name["param_groups"]:
            params = []
            for name in group["params"]:
                index[name] = len(index)
                params.append(index[name])
            groups.append({**group, "params": params})
        state = {index[name]: value for name, value in by_name["state"].items()}
        return {"state": state, "param_groups": groups}

    def load_model_state_dict(self, state_dict: Mapping[str, Tensor], *, strict: bool = True) -> None:
        """Load a full state dict (every rank holds it) into the model, sharding it under FSDP; not
        `strict`: part of one (a LoRA run's adapter)."""
        if self.parallel != "fsdp":
            self.model.load_state_dict(state_dict, strict=strict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        set_model_state_dict(self.model, dict(state_dict),
                             options=StateDictOptions(full_state_dict=True, strict=strict))

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a full optimizer state dict in `torch.optim` layout (every rank holds it)."""
        if self.parallel != "fsdp":
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        names = {id(p): name for name, p in self.model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name: dict[str, Any] = {"state": {order[i]: value for i, value in state["state"].items()},
                   "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                                    for group in state["param_groups"]]}
        set_optimizer_state_dict(self.model, _torch_optimizers(optimizer), by_name,
                                 options=StateDictOptions(full_state_dict=True))

    def from_main(self, compute: Callable[[], T]) -> T:
        """compute() on rank 0, its value on every rank (any picklable value): what rank 0 alone decides,
        every rank calling this at the same point."""
        if self.world_size == 1:
            return compute()
        value = [compute() if self.is_main else None]
        dist.broadcast_object_list(value, src=0)
        return cast(T, value[0])

    def gather(self, value: Any) -> list[Any]:
        """[value of rank 0, ..., value of rank W−1] on every rank (any picklable value)."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def _tied(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` with every name of one shared parameter (a tied output projection) holding the first
    name's tensor, as `nn.Module.state_dict` gives them. FSDP's gathered full state dict holds a copy per
    name, which a checkpoint would store twice; the ties are read from the model's own parameters, which
    sharding keeps shared."""
    first: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(parameter), name)
        if owner != name and owner in state and name in state:
            state[name] = state[owner]
    return state


def torchrun_command(nproc: int, argv: Sequence[str]) -> list[str]:
    """The torchrun command that runs `plainformer ARGV` on `nproc` processes of this machine."""
    if not _checks.is_int(nproc) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    return [sys.executable, "-m", "plainformer.training.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "plainformer", *argv]


def run_torchrun(nproc: int, argv: Sequence[str]) -> int:
    """Run `plainformer ARGV` on `nproc` local processes under torchrun's launcher; its exit status
    (non-zero when a rank failed), or 130 after Ctrl-C.

    Ctrl-C in the terminal reaches torchrun, which passes one SIGINT to each rank (they run in
    sessions of their own): the ranks finish the step, save last/ once and exit 130. Meanwhile this
    process only waits, so that the launcher is never killed under its ranks."""
    command = torchrun_command(nproc, argv)
    interrupted = False

    def note(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True

    previous = signal.signal(signal.SIGINT, note)  # a Python handler is not inherited by exec
    try:
        status = subprocess.Popen(command).wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130 if interrupted else status


def _torch_optimizers(optimizer: torch.optim.Optimizer | MuonWithAdamW) -> Any:
    """What torch.distributed.checkpoint takes: one torch optimizer, or the ones MuonWithAdamW steps
    (in its param_groups order, AdamW's then Muon's)."""
    return optimizer.optimizers if isinstance(optimizer, MuonWithAdamW) else optimizer
