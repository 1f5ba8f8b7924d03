"""The planner of `strategy="auto"`: every layout of a world size, priced; the fastest that fits.

`search` lists and ranks layouts (pure), `estimate` prices one with the scaling model
(`simulate`), `command` is `hyparflow simulate --auto` and `plan --auto` (docs/simulate.md, "The
planner"), whose `--measure` trains the top layouts (`measure`, pure; `measure_launch`, the
jobs; `measure_worker`, a rank of one).
"""
