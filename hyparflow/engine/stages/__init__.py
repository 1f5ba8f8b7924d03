"""What runs a stage: the pipeline walk over a schedule's actions, the plan every rank agrees
on, and the runners (fused, pipelined, split into input and weight halves, in segments)."""
