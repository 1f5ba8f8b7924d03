"""hyparflow-aware Keras callbacks: checkpoints, the scaling profiler, the progress bar."""

from hyparflow.callbacks.checkpoint import Checkpoint
from hyparflow.callbacks.profiler import ScalingProfiler
from hyparflow.callbacks.progress import ThroughputProgbarLogger

__all__ = ["Checkpoint", "ScalingProfiler", "ThroughputProgbarLogger"]
