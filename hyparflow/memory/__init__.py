"""Memory: what a rank holds (measured resident memory, and the memory plan's prediction)."""
