"""The planner of `strategy="auto"`: every layout of a world size, priced; the fastest that fits.

`search` lists and ranks layouts (pure), `estimate` prices one with the scaling model
(`simulate`), `command` is `hyparflow simulate --auto` (docs/simulate.md, "The planner").
"""
