"""How the user wrote what an error's hint names, so that the hint says it back that way."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Spelling:
    """The split's keywords (`hf.fit`'s `num_partitions=` or `hf.Strategy`'s `partitions=`)
    and the command that launched the job, `{ranks}` standing for the rank count.

    Example:
        >>> Spelling.of(fit_keywords=True, launch="hyparflow run -n {ranks}").partitions
        'num_partitions'
    """

    partitions: str = "partitions"
    replicas: str = "replicas"
    launch: str = "mpirun -np {ranks}"

    @classmethod
    def of(cls, fit_keywords: bool, launch: str) -> Spelling:
        """HyPar-Flow's keywords of `hf.fit` when the user gave a strategy by name
        (`fit_keywords`), else `hf.Strategy`'s fields."""
        if fit_keywords:
            return cls("num_partitions", "num_replicas", launch)
        return cls(launch=launch)
