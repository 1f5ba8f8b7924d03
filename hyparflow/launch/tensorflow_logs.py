"""TensorFlow's C++ log lines, so that a job shows each of them once (pure logic).

TensorFlow writes its start-up lines (absl's pre-init notice, oneDNN, CPU features, CUDA
probes) from C++ before its logging reads `TF_CPP_MIN_LOG_LEVEL`, so every rank writes them,
whatever the level says: N ranks, N copies. `hyparflow run` passes the job's standard error
through `RepeatFilter`, which drops a C++ log line that some rank already wrote with the same
severity, source line and message. A line that differs on one rank (its GPU, a failed CUDA
probe) is still shown, and nothing else is touched (docs/launch.md, "Output").
"""

from __future__ import annotations

import re

# absl's format: severity, MMDD, time, thread id, file.cc:line] message
_LOG_LINE = re.compile(r"[IWEF][0-9]{4} [0-9:.]+ +[0-9]+ (?P<source>[\w.-]+\.cc:[0-9]+\].*)")
# absl's notice before its logging starts, and the CPU-features line's second line
NOTICES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions:",
)
STARTUP_LOG = re.compile("|".join([_LOG_LINE.pattern, *(re.escape(notice) for notice in NOTICES)]))


def repeat_key(line: str) -> str | None:
    """What a C++ log line says, without the time and thread that differ between ranks; None
    for any other line.

    Example:
        >>> repeat_key("I0000 00:00:1764707712.345678   4711 cpu_feature_guard.cc:210] Fast")
        'I cpu_feature_guard.cc:210] Fast'
        >>> repeat_key("Epoch 1/5") is None
        True
    """
    text = line.rstrip("\r\n")
    found = _LOG_LINE.fullmatch(text)
    if found is not None:
        return f"{text[0]} {found['source']}"
    return text if text.startswith(NOTICES) else None


def could_become_log_line(start: str) -> bool:
    """Whether an unfinished line may still turn out to be a C++ log line (so is held back
    until its end comes); anything else, a progress bar's `\\r` say, is passed on at once.

    Example:
        >>> could_become_log_line("W0000 00:0"), could_become_log_line("\\r 50%|#####")
        (True, False)
    """
    if re.fullmatch(r"[IWEF][0-9]{0,4}", start) or re.match(r"[IWEF][0-9]{4} ", start):
        return True
    return any(notice.startswith(start) or start.startswith(notice) for notice in NOTICES)


class RepeatFilter:
    """Keeps each C++ log line the first time it is seen (by `repeat_key`), and every other line.

    Example:
        >>> keep = RepeatFilter().keep
        >>> [keep(line) for line in ["I0101 1.0 7 a.cc:1] x", "I0101 2.0 8 a.cc:1] x", "y", "y"]]
        [True, False, True, True]
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def keep(self, line: str) -> bool:
        key = repeat_key(line)
        if key is None:
            return True
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
