"""Whether a model built under `hf.scope()` can be trained in one process here, before its
variables are made: refused with the memory plan's figures rather than killed part way."""

from __future__ import annotations

from hyparflow.memory.limits import memory_room
from hyparflow.memory.plan import memory_plan


def check_fits_one_process(model, batch_size) -> None:
    """Refuse to materialise a hf.scope() model whose training the memory plan says cannot fit
    in what this process's cgroup can still be charged, rather than be killed part way."""
    room = memory_room()
    if room is None:
        return
    needed = memory_plan(model, "data", batch_size or 32).largest.total
    if needed > room:
        gib = 2**30
        raise MemoryError(
            f"Training this model in one process needs about {needed / gib:.2f} GiB more "
            f"(hf.memory_plan), but this process's memory limit leaves {room / gib:.2f} GiB. "
            "Launch it on several ranks (mpirun -np N) with strategy=hf.Strategy('model', "
            "partitions=N), tensor=T or shard_optimizer=True; `hyparflow plan --memory` "
            "shows what each rank holds."
        )
