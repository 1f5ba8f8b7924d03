"""Standard-error lines that an earlier launch of the same job already showed (pure logic).

A script that fails the same way at start-up fails on every restart of `hyparflow run
--max-restarts K`; its traceback is shown for the first launch only, and the later launches
say how many of their lines were held back (`hyparflow/run.py`).
"""

from __future__ import annotations


class EarlierLaunches:
    """Decides which lines of the current launch to show: none that an earlier one showed.

    Example:
        >>> lines = EarlierLaunches()
        >>> lines.keep(b"ValueError: bad"), lines.keep(b"ValueError: bad")  # one launch
        (True, True)
        >>> lines.next_launch()
        0
        >>> lines.keep(b"ValueError: bad"), lines.keep(b"step 3"), lines.next_launch()
        (False, True, 1)
    """

    def __init__(self):
        self._earlier: set[bytes] = set()
        self._current: set[bytes] = set()
        self._held_back = 0

    def keep(self, line: bytes) -> bool:
        """Whether to show `line` (without its newline) of the current launch."""
        self._current.add(line)
        if line.strip() and line in self._earlier:
            self._held_back += 1
            return False
        return True

    def next_launch(self) -> int:
        """Start counting the next launch; how many lines the one that ended held back."""
        held_back, self._held_back = self._held_back, 0
        self._earlier |= self._current
        self._current = set()
        return held_back
