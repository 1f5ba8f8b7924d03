"""`hf.callbacks.ThroughputProgbarLogger`: the progress bar `hf.fit` shows, with samples/s."""

from hyparflow.engine.loops.progress import ThroughputProgbarLogger

__all__ = ["ThroughputProgbarLogger"]
