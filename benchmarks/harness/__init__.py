"""Shared pieces of the benchmark scripts: statistics, records, launching, the machine, reports."""
