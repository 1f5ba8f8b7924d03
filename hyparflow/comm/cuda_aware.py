"""Whether the MPI library may be handed GPU memory (CUDA-aware), decided once per process.

Handing a GPU pointer to an MPI that is not CUDA-aware crashes the process (a segfault inside
MPI), so hyparflow hands GPU memory to MPI only when this module says yes; otherwise GPU
tensors are staged through host memory (`comm/dlpack.py`, `comm/p2p.py`; docs/gpu.md).

`decide(facts)` is pure: the facts (the library's version string, what its query functions
answered, environment switches) are injected, so the rule is tested without any GPU. The edge,
`gather_facts`, reads them from the MPI library that mpi4py loaded (through ctypes) and from
the environment. `detect()` caches the answer per process; hf.fit replaces it with the answer
every rank agreed on (`settle`, `combine`), so that all ranks use the device path or none.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

OVERRIDE = "HYPARFLOW_CUDA_AWARE"
TRUE = frozenset({"1", "true", "yes", "on", "enable", "enabled"})
FALSE = frozenset({"0", "false", "no", "off", "disable", "disabled"})

# Each library family's own run-time switch for GPU buffers. Setting one off always means "not
# aware"; setting one on means "aware" only where the library has no query that answered
# (MVAPICH2-GDR, Cray MPICH, MPICH): Open MPI's own query reflects its switch already.
SWITCHES = {
    "openmpi": ("OMPI_MCA_opal_cuda_support", "OMPI_MCA_mpi_cuda_support"),
    "mvapich": ("MV2_USE_CUDA",),
    "cray": ("MPICH_GPU_SUPPORT_ENABLED",),
    "mpich": ("MPIR_CVAR_ENABLE_GPU",),
}
ENABLING_FAMILIES = ("mvapich", "cray", "mpich")
LABELS = {"mvapich": "MVAPICH", "cray": "Cray MPICH", "mpich": "MPICH"}
# MPICH's MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag): the type id of CUDA is 0.
MPICH_GPU_SUPPORT_CUDA = 0


@dataclass(frozen=True)
class MpiFacts:
    """What is known about the MPI library of this process (every field may be unknown)."""

    library_version: str = ""  # MPI_Get_library_version
    query_cuda: int | None = None  # MPIX_Query_cuda_support() (Open MPI, MVAPICH2, MPICH 4.1+)
    query_gpu_cuda: int | None = None  # MPICH's MPIX_GPU_query_support for CUDA
    built_with_cuda: bool | None = None  # Open MPI's mpi_built_with_cuda_support (ompi_info)
    environ: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CudaAwareness:
    """The answer: whether MPI may be handed GPU memory, and how that was decided."""

    aware: bool
    reason: str


def library_family(version: str) -> str:
    """Which MPI family a `MPI_Get_library_version` string names.

    Example:
        >>> library_family("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4")
        'openmpi'
        >>> library_family("MPI VERSION    : CRAY MPICH version 8.1.28"), library_family("?")
        ('cray', 'unknown')
    """
    upper = version.upper()
    for marker, family in (
        ("OPEN MPI", "openmpi"),
        ("MVAPICH", "mvapich"),
        ("CRAY MPICH", "cray"),
        ("INTEL(R) MPI", "intel"),
        ("MPICH", "mpich"),
    ):
        if marker in upper:
            return family
    return "unknown"


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    """True/False for a set switch, None when unset; a value that is neither raises."""
    value = environ.get(name)
    if value is None or value.strip() == "":
        return None
    value = value.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(
        f"{name}={environ[name]!r} is neither on (1, true, yes) nor off (0, false, no): set "
        "one of those, or unset it"
    )


def decide(facts: MpiFacts) -> CudaAwareness:
    """Whether MPI is CUDA-aware, from injected facts. First match wins:

    1. `HYPARFLOW_CUDA_AWARE` set (1/0): the user's word.
    2. The library family's own switch set off (`OMPI_MCA_opal_cuda_support=0`,
       `MV2_USE_CUDA=0`, `MPICH_GPU_SUPPORT_ENABLED=0`, `MPIR_CVAR_ENABLE_GPU=0`): not aware.
    3. The library's query functions, where found: `MPIX_Query_cuda_support()` and MPICH's
       `MPIX_GPU_query_support(CUDA)`; aware only if every one found says so.
    4. Open MPI's `mpi_built_with_cuda_support`, when the caller read it (`ompi_info`).
    5. MVAPICH2, Cray MPICH, MPICH with their switch set on: aware.
    6. Otherwise not aware: unknown libraries are never handed GPU memory.

    Example:
        >>> decide(MpiFacts("Open MPI v4.1.4", query_cuda=0)).aware
        False
        >>> decide(MpiFacts("MVAPICH2 Version 2.3.7", environ={"MV2_USE_CUDA": "1"})).reason
        'MV2_USE_CUDA=1 turns on MVAPICH GPU buffer support'
    """
    env, version = facts.environ, facts.library_version.strip().strip("\x00")
    family = library_family(version)
    name = (version.splitlines() or [""])[0].split(",")[0].strip() or "an unidentified MPI"
    override = _flag(env, OVERRIDE)
    if override is not None:
        return CudaAwareness(override, f"{OVERRIDE}={env[OVERRIDE]} (set by the user)")
    switches = [(s, _flag(env, s)) for s in SWITCHES.get(family, ())]
    for switch, value in switches:
        if value is False:
            return CudaAwareness(False, f"{switch}={env[switch]} turns off {name}'s GPU support")
    queries = [
        (call, answer)
        for call, answer in (
            ("MPIX_Query_cuda_support()", facts.query_cuda),
            ("MPIX_GPU_query_support(CUDA)", facts.query_gpu_cuda),
        )
        if answer is not None
    ]
    if queries:
        aware = all(answer == 1 for _, answer in queries)
        said = ", ".join(f"{call} returned {answer}" for call, answer in queries)
        return CudaAwareness(aware, f"{name}: {said}")
    if family == "openmpi" and facts.built_with_cuda is not None:
        built = str(facts.built_with_cuda).lower()
        return CudaAwareness(facts.built_with_cuda, f"{name}: mpi_built_with_cuda_support={built}")
    if family in ENABLING_FAMILIES:
        for switch, value in switches:
            if value:
                support = f"{LABELS[family]} GPU buffer support"
                return CudaAwareness(True, f"{switch}={env[switch]} turns on {support}")
    return CudaAwareness(False, f"{name} answers no CUDA query and no switch says it is CUDA-aware")


def combine(answers: Sequence[CudaAwareness]) -> CudaAwareness:
    """One answer for ranks that each decided: aware only if every rank is (rank order).

    Example:
        >>> combine([CudaAwareness(True, "a"), CudaAwareness(False, "b")])
        CudaAwareness(aware=False, reason='rank 1: b')
    """
    for rank, answer in enumerate(answers):
        if not answer.aware:
            return CudaAwareness(False, f"rank {rank}: {answer.reason}")
    return CudaAwareness(True, f"every rank: {answers[0].reason}" if answers else "no ranks")


# --- the edge: this process's MPI library ----------------------------------------------------


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("libmpi", "libmpich")))


def _symbol(name: str):
    """A ctypes function `name` of the loaded MPI library, or None when it has none.

    mpi4py loads Open MPI's libmpi with global symbols, so the process's own namespace finds
    it (Debian's Open MPI 4.1.4: yes, once mpi4py.MPI is imported); otherwise the libraries
    already mapped are asked (RTLD_NOLOAD: never loads a second one)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except AttributeError:
        pass
    for path in _loaded_mpi_libraries():
        try:
            return getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_LOCAL), name)
        except (OSError, AttributeError):
            continue
    return None


def _query_cuda() -> int | None:
    function = _symbol("MPIX_Query_cuda_support")
    if function is None:
        return None
    function.restype, function.argtypes = ctypes.c_int, []
    return int(function())


def _query_gpu_cuda() -> int | None:
    function = _symbol("MPIX_GPU_query_support")
    if function is None:
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    supported = ctypes.c_int(0)
    if function(MPICH_GPU_SUPPORT_CUDA, ctypes.byref(supported)) != 0:
        return None
    return int(supported.value)


def gather_facts(environ: Mapping[str, str] | None = None) -> MpiFacts:
    """The facts about this process's MPI (initialises MPI; the queries need it running).

    `ompi_info` is not run (it would start a process on every rank): `built_with_cuda` stays
    unknown, and Open MPI answers through `MPIX_Query_cuda_support` instead."""
    from mpi4py import MPI  # on use: importing it initialises MPI (docs/architecture.md)

    return MpiFacts(
        library_version=MPI.Get_library_version(),
        query_cuda=_query_cuda(),
        query_gpu_cuda=_query_gpu_cuda(),
        environ=dict(os.environ if environ is None else environ),
    )


_local: CudaAwareness | None = None  # this rank's own answer
_settled: CudaAwareness | None = None  # the answer every rank agreed on (hf.fit)
_warned = False


def local_answer() -> CudaAwareness:
    """This rank's own answer, decided on first use from `gather_facts()`, then cached."""
    global _local
    if _local is None:
        _local = decide(gather_facts())
    return _local


def detect() -> CudaAwareness:
    """This process's answer: the one every rank agreed on once hf.fit settled it, else this
    rank's own (`local_answer`).

    Example (Debian's Open MPI 4.1.4):
        detect()  # CudaAwareness(False, "Open MPI v4.1.4: MPIX_Query_cuda_support() returned 0")
    """
    return _settled if _settled is not None else local_answer()


def settle(answer: CudaAwareness | None) -> None:
    """Make `answer` this process's (hf.fit: the one every rank agreed on, `combine`); None
    goes back to this rank's own."""
    global _settled
    _settled = answer


def resolve(answer: CudaAwareness | bool | None) -> CudaAwareness:
    """`answer` as a CudaAwareness: None asks `detect()`, a bool is the caller's word."""
    if answer is None:
        return detect()
    if isinstance(answer, bool):
        return CudaAwareness(answer, f"cuda_aware={answer} given by the caller")
    return answer


def warn_staging(answer: CudaAwareness, rank: int) -> bool:
    """Say once per process, on rank 0 only, that GPU tensors go through host memory and why;
    returns whether it warned now."""
    global _warned
    if rank != 0 or _warned or answer.aware:
        return False
    _warned = True
    warnings.warn(
        "hyparflow stages GPU tensors through host memory for MPI (a device-to-host copy before "
        "each send, a host-to-device copy after each receive), because it cannot tell that "
        f"this MPI is CUDA-aware: {answer.reason}. If the library is CUDA-aware, set "
        f"{OVERRIDE}=1 on every rank to hand it GPU memory directly (docs/gpu.md).",
        RuntimeWarning,
        stacklevel=3,
    )
    return True
