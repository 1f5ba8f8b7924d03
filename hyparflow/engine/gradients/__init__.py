"""A step's gradient path: the form gradients take, their sums over stages and replicas
(flat, per variable, row-sparse), clipping, and the optimizer update."""
