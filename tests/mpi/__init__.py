"""Scenario modules run under a real `mpirun` by tests/mpirun.py; each rank reports JSON."""
