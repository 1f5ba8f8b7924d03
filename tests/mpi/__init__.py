"""Scenarios run under a real `mpirun` by tests/support/mpirun.py; each rank reports JSON."""
