"""GPUs under hf.fit: one GPU per rank, and MPI handed GPU memory only if it is CUDA-aware.

`prepare` runs collectively at the start of every distributed hf.fit, evaluate and predict.
Where no rank's TensorFlow sees a GPU it gathers that fact once and does nothing else: no
detection, no binding, no process state touched. Otherwise every rank decides whether its MPI
is CUDA-aware (`comm/cuda_aware.py`), the ranks settle on one answer (aware only if all are,
so every rank uses the device path or none; rank 0 warns once when GPU tensors will be staged
through host memory), and, where the user opted in (`Strategy(bind_gpus=True)`), each rank is
bound to one GPU of its node
(`launch/gpu.py`), errors agreed on every rank. docs/gpu.md explains each decision.
"""

from __future__ import annotations

from hyparflow.comm import cuda_aware
from hyparflow.comm.agree import agree
from hyparflow.comm.world import launched, world
from hyparflow.launch import gpu


def prepare(comm, bind: bool = True) -> cuda_aware.CudaAwareness | None:
    """Collective over `comm`: settle whether MPI may be handed GPU memory and, with `bind`,
    keep one GPU per rank. Returns the settled answer, or None when no rank sees a GPU.

    Example:
        answer = prepare(MPI.COMM_WORLD, bind=strategy.bind_gpus)
    """
    mine, allowed = _gathered(comm)
    if mine is None:
        return None
    answer = cuda_aware.combine(comm.allgather(agree(comm, cuda_aware.local_answer)))
    cuda_aware.settle(answer)
    cuda_aware.warn_staging(answer, comm.Get_rank())
    if bind and allowed:
        gpu.bind(_choice(comm, mine))
    return answer


def bind_gpus() -> gpu.Binding:
    """Keep one GPU for this rank, chosen by its node-local rank, with memory growth on; call
    it at the top of the script, before building the model (TensorFlow cannot change its GPUs
    once it has run anything). Collective over the MPI world when launched; a rank left with
    no GPU on a GPU node raises on every rank. `HYPARFLOW_BIND_GPUS=0` turns it off.

    For example:
        import hyparflow as hf
        hf.bind_gpus()   # first thing, then build, compile and hf.fit the model
    """
    if not launched():  # one process: no MPI to start
        binding = gpu.choose_gpu(0, [gpu.local_view()], gpu.enabled())
    else:
        comm = world()
        mine, allowed = _gathered(comm)
        if mine is None:
            binding = gpu.Binding(None, "no rank sees a GPU")
        elif not allowed:
            binding = gpu.Binding(None, f"binding turned off ({gpu.SWITCH}=0 on some rank)")
        else:
            binding = _choice(comm, mine)
    gpu.bind(binding)
    return binding


def _gathered(comm) -> tuple[gpu.RankGpus | None, bool]:
    """Collective: this rank's view of its GPUs (None when no rank sees one) and whether every
    rank's environment allows binding."""
    mine = agree(comm, gpu.local_view)
    views = comm.allgather((mine.gpus, gpu.enabled()))
    if not any(gpus for gpus, _ in views):
        return None, False
    return mine, all(allowed for _, allowed in views)


def _choice(comm, mine: gpu.RankGpus) -> gpu.Binding:
    """Collective: this rank's GPU from what its node's ranks see; errors raised everywhere."""
    local_rank, node = gpu.node_view(comm, mine)
    return agree(comm, gpu.choose_gpu, local_rank, node)
