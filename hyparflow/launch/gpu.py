"""One GPU per rank: which GPU a rank keeps, chosen by its node-local rank.

Without binding, every rank's TensorFlow takes the node's first GPU (and, by default, nearly
all of its memory). `choose_gpu` is the pure rule, from what each rank on the node sees
(`RankGpus`); `node_view` gathers that over the node (MPI's shared-memory split, so it works
under any launcher) and `bind` applies the choice through `tf.config` before TensorFlow
initialises its GPUs. hf.fit calls them collectively only when some rank sees a GPU
(`hyparflow.devices`); on a machine without GPUs nothing here runs. docs/gpu.md has the rule,
its opt-in (`hf.bind_gpus()`, `Strategy(bind_gpus=True)`), the veto `HYPARFLOW_BIND_GPUS=0`
and what was never run on a real GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SWITCH = "HYPARFLOW_BIND_GPUS"
# How users and launchers restrict a process's GPUs (NVIDIA; AMD's HIP and ROCm runtimes).
VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class NoGpuError(RuntimeError):
    """A rank would train without a GPU of its own on a node that has GPUs."""


@dataclass(frozen=True)
class RankGpus:
    """What one rank's process sees: the GPUs TensorFlow lists, the visibility variables set
    for it (e.g. "CUDA_VISIBLE_DEVICES=0,1"; "" when none), and whether this process already
    narrowed TensorFlow's visible GPUs (`tf.config.set_visible_devices`, by the user or an
    earlier binding)."""

    gpus: int
    visibility: str = ""
    narrowed: bool = False


@dataclass(frozen=True)
class Binding:
    """The choice for one rank: keep GPU `gpu` (an index into the GPUs its TensorFlow lists),
    or None to leave the process as it is; `reason` says why."""

    gpu: int | None
    reason: str


def choose_gpu(local_rank: int, node: Sequence[RankGpus], enabled: bool = True) -> Binding:
    """The GPU node-local rank `local_rank` keeps, given what every rank on its node sees.

    First match wins: binding turned off, or no rank on the node sees a GPU: leave alone. This
    rank sees none while others on its node do: `NoGpuError`. This process already narrowed
    its GPUs: leave alone. The ranks see different GPUs (the launcher or user gave each its
    own, e.g. `srun --gpus-per-task=1`): leave alone. All see the same GPUs (none hidden, or
    the same list such as Slurm's CUDA_VISIBLE_DEVICES for the job): local rank i keeps the
    i-th of them, and more ranks than GPUs is a `NoGpuError` (some rank would have none).

    Example:
        >>> choose_gpu(1, [RankGpus(4)] * 2)
        Binding(gpu=1, reason='node-local rank 1 of 2 keeps GPU 1 of the 4 its ranks see')
        >>> choose_gpu(0, [RankGpus(0)] * 2).gpu is None  # a CPU node: nothing to do
        True
        >>> choose_gpu(0, [RankGpus(1, "CUDA_VISIBLE_DEVICES=0"),
        ...                RankGpus(1, "CUDA_VISIBLE_DEVICES=1")]).reason
        'the ranks on this node see different GPUs (their own visibility): each keeps its own'
    """
    if not 0 <= local_rank < len(node):
        raise ValueError(f"local rank {local_rank} is not one of {len(node)} local ranks")
    if not enabled:
        return Binding(None, f"binding turned off (Strategy(bind_gpus=False) or {SWITCH}=0)")
    mine = node[local_rank]
    seeing = [i for i, rank in enumerate(node) if rank.gpus]
    if not seeing:
        return Binding(None, "no rank on this node sees a GPU")
    if not mine.gpus:
        hidden = f" ({mine.visibility})" if mine.visibility else ""
        raise NoGpuError(
            f"node-local rank {local_rank} sees no GPU{hidden} while local ranks {seeing} of "
            f"its node do: it would train on its CPU, far slower than the others. Give every "
            f"rank a GPU (its CUDA_VISIBLE_DEVICES), or run fewer ranks per node."
        )
    if mine.narrowed:
        return Binding(None, "this process already chose its visible GPUs (tf.config)")
    if any((rank.gpus, rank.visibility) != (mine.gpus, mine.visibility) for rank in node):
        return Binding(
            None,
            "the ranks on this node see different GPUs (their own visibility): each keeps its own",
        )
    if len(node) > mine.gpus:
        raise NoGpuError(
            f"{len(node)} ranks share a node whose ranks see {mine.gpus} GPU(s)"
            f"{' (' + mine.visibility + ')' if mine.visibility else ''}: node-local rank(s) "
            f"{list(range(mine.gpus, len(node)))} would have none. Launch at most {mine.gpus} "
            f"rank(s) per node (mpirun --map-by ppr:{mine.gpus}:node, srun "
            f"--ntasks-per-node={mine.gpus}), or let ranks share GPUs on purpose with "
            f"Strategy(bind_gpus=False) or {SWITCH}=0."
        )
    return Binding(
        local_rank,
        f"node-local rank {local_rank} of {len(node)} keeps GPU {local_rank} of the "
        f"{mine.gpus} its ranks see",
    )


def visibility(environ: Mapping[str, str] | None = None) -> str:
    """The GPU visibility variables set for this process, e.g. "CUDA_VISIBLE_DEVICES=0,1"."""
    env = os.environ if environ is None else environ
    return " ".join(f"{name}={env[name]}" for name in VISIBILITY_VARIABLES if name in env)


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `HYPARFLOW_BIND_GPUS` leaves binding on (anything but 0)."""
    env = os.environ if environ is None else environ
    return env.get(SWITCH, "1").strip() != "0"


# --- the edges: TensorFlow (this process) and MPI (its node) --------------------------------


def local_view() -> RankGpus:
    """What this process's TensorFlow sees. Listing devices does not initialise the GPUs."""
    import tensorflow as tf  # the launch layer imports no TF at module level

    physical = tf.config.list_physical_devices("GPU")
    visible = tf.config.get_visible_devices("GPU")
    return RankGpus(len(physical), visibility(), narrowed=len(visible) < len(physical))


def node_view(comm, mine: RankGpus) -> tuple[int, list[RankGpus]]:
    """Collective over `comm`: this rank's node-local rank and what every rank on its node
    sees (MPI's shared-memory split: the node as MPI knows it, under any launcher)."""
    from mpi4py import MPI  # on use: importing mpi4py.MPI initialises MPI (comm/world.py)

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.allgather(mine)
    finally:
        node.Free()


_warned_late = False


def bind(binding: Binding) -> bool:
    """Keep only `binding.gpu` visible to TensorFlow, with memory growth on (ranks never grab a
    whole GPU up front). Returns whether it holds; if TensorFlow initialised its GPUs already
    (any TF op, e.g. building a Keras model, does), nothing can change: a warning says so."""
    if binding.gpu is None:
        return False
    import tensorflow as tf  # the launch layer imports no TF at module level

    gpu = tf.config.list_physical_devices("GPU")[binding.gpu]
    try:
        tf.config.set_visible_devices([gpu], "GPU")
        tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as error:  # TF: "cannot be modified after being initialized"
        global _warned_late
        if _warned_late:
            return False
        _warned_late = True
        logger.warning(
            "hyparflow could not bind this process to %s (%s): TensorFlow had initialised its "
            "GPUs already (%s), so it keeps the GPUs it has, probably the same as other ranks "
            "on its node. Call hf.bind_gpus() at the top of the script, before building the "
            "model (docs/gpu.md).",
            gpu.name,
            binding.reason,
            error,
        )
        return False
    logger.info("hyparflow bound this process to %s: %s", gpu.name, binding.reason)
    return True
