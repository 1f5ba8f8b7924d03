"""Helpers the tests import: the mpirun harness, tiny models, comparisons and case lists."""
