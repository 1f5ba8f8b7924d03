"""What single-process Keras does, kept across ranks and slices of the batch: added and
per-output losses, metrics, dropout masks, batch-norm statistics, global-batch means,
row-sparse tables, and the layers as one rank runs them."""
