"""Memory: what a rank holds (measured resident memory, and the memory plan's prediction)."""

from hyparflow.memory.plan import memory_plan
from hyparflow.memory.table import MemoryPlan, RankMemory

__all__ = ["MemoryPlan", "RankMemory", "memory_plan"]
