"""``trainer.accelerator``: what a TRL script uses of accelerate's ``Accelerator`` — who this process is, printing
once, waiting for the others, gathering — backed by shardtune's runtime instead of accelerate's state.

Who this process is comes from torchrun's environment (rank 0 of 1 under plain ``python``). A collective made outside
a run (``wait_for_everyone``, ``gather``, ``main_process_first`` after ``train()``) joins a process group for its
duration, as the run joins its own (shardtune.runtime.distributed: nccl on GPUs, gloo on CPU, keys of its own in
torchrun's store), and leaves it after; inside a run (a callback) it uses the run's group. Every process must make
the same collective calls in the same order, as with accelerate.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from shardtune.runtime.distributed import init_distributed, is_torchrun_worker, shutdown


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default)) if is_torchrun_worker() else default


@contextlib.contextmanager
def process_group() -> Iterator[bool]:
    """A process group for a collective: the run's (or one joined before), else one joined now and left after;
    yields whether there is more than one process."""
    if _env_int("WORLD_SIZE", 1) == 1:
        yield False
        return
    if dist.is_initialized():
        yield True
        return
    init_distributed()
    try:
        yield True
    finally:
        shutdown()


class ScriptAccelerator:
    """The part of accelerate's ``Accelerator`` a training script calls, on shardtune's runtime."""

    @property
    def process_index(self) -> int:
        return _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        return _env_int("LOCAL_RANK", 0)

    @property
    def num_processes(self) -> int:
        return _env_int("WORLD_SIZE", 1)

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_process_index)
        return torch.device("cpu")

    @property
    def distributed_type(self) -> str:
        """accelerate's DistributedType value: MULTI_GPU / MULTI_CPU across processes, else NO."""
        if self.num_processes == 1:
            return "NO"
        return "MULTI_GPU" if torch.cuda.is_available() else "MULTI_CPU"

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs, flush=True)

    def wait_for_everyone(self) -> None:
        with process_group() as several:
            if several:
                dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self, local: bool = False) -> Iterator[None]:
        """The main process (``local``: of each node) runs the block, then the others."""
        main = self.is_local_main_process if local else self.is_main_process
        with process_group() as several:
            if several and not main:
                dist.barrier()
            yield
            if several and main:
                dist.barrier()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        return self.main_process_first(local=True)

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """A decorator: the function runs on the main process only (None elsewhere)."""

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return wrapper

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_local_main_process else None

        return wrapper

    def gather(self, data: Any) -> Any:
        """Tensors (or lists / tuples / dicts of them) of every process, concatenated along the first dimension in
        rank order (a 0-d tensor counts as one row), as accelerate's ``gather``: every process gives the same
        shape (pad first where they differ)."""
        with process_group() as several:
            return _map(data, lambda t: _gather_tensor(t, self.device) if several else _rows(t))

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """``gather`` for tensors; any other object (a list of strings) gathered as objects, concatenated."""
        if use_gather_object or not _has_tensor(data):
            return self.gather_object(data)
        return self.gather(data)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every process's object, in rank order; lists are concatenated (accelerate's ``gather_object``)."""
        with process_group() as several:
            if not several:
                return list(obj) if isinstance(obj, list) else [obj]
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, obj)
        if all(isinstance(item, list) for item in gathered):
            return [x for item in gathered for x in item]
        return gathered

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """A tensor summed (or averaged: ``mean``) over all processes, times ``scale``."""
        if reduction not in ("sum", "mean", "none"):
            raise ValueError(f"reduce: reduction {reduction!r} is not one of sum, mean, none")

        def one(t: torch.Tensor) -> torch.Tensor:
            out = t.detach().clone().to(self.device)
            if several and reduction != "none":
                dist.all_reduce(out, op=dist.ReduceOp.SUM)
                if reduction == "mean":
                    out /= dist.get_world_size()
            return (out * scale).to(t.device)

        with process_group() as several:
            return _map(tensor, one)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True) -> Any:
        """The model itself: outside a run nothing wraps it (DDP / FSDP / DeepSpeed wrap inside ``train()``)."""
        return getattr(model, "module", model)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """``torch.save`` on the main process."""
        if self.is_main_process:
            torch.save(obj, f)

    def end_training(self) -> None:
        """Nothing to finish: the run closed its trackers and left its process group in ``train()``."""

    def free_memory(self, *objects: Any) -> tuple[Any, ...]:
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return tuple(None for _ in objects)


def _map(data: Any, function: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(data, torch.Tensor):
        return function(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_map(item, function) for item in data)
    if isinstance(data, dict):
        return type(data)({key: _map(value, function) for key, value in data.items()})
    raise TypeError(f"gather / reduce take tensors (or lists, tuples, dicts of them), not a {type(data).__name__}")


def _has_tensor(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return any(_has_tensor(item) for item in data)
    if isinstance(data, dict):
        return any(_has_tensor(item) for item in data.values())
    return False


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _gather_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    local = _rows(tensor).detach().to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(tensor.device)
