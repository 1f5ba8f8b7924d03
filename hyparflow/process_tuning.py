"""Opt-in process tuning for ranks that share a node: glibc heap, huge pages, core pinning.

hf.fit changes no process-wide state by default: binding ranks to cores is the launcher's job
(`mpirun --bind-to core`, `srun --cpu-bind=cores`), and glibc's allocator and the kernel's page
sizes are the user's. `hf.Strategy(tune_process=True)` asks hf.fit to apply, on every rank of a
multi-rank job, all three of:

- glibc keeps large temporaries in its heap (`hyparflow.launch.malloc`), so a training step
  does not map and fault in its activation pages again every step;
- the pages under MPI's large host buffers become transparent huge pages
  (`hyparflow.comm.hugepages`), which Open MPI's single-copy transfers walk faster;
- when a node runs more ranks than cores and the launcher bound none, each rank's threads are
  pinned to one core, stages mixed on each core (`hyparflow.launch.affinity`).

Each is a no-op where it does not apply (not glibc, no THP, a core per rank, ranks already
bound), and each keeps its environment opt-out (`HYPARFLOW_MALLOC_TUNING=0`,
`HYPARFLOW_HUGEPAGES=0`, `HYPARFLOW_PIN_RANKS=0`).
"""

from __future__ import annotations

from hyparflow.comm import hugepages
from hyparflow.launch import affinity, malloc


def tune_process(comm, stage: int) -> None:
    """Collective over `comm`: apply the tuning above to this rank (pipeline stage `stage`)."""
    hugepages.start_promoting(malloc.keep_temporaries_in_heap())
    affinity.pin_if_oversubscribed(comm, stage)
