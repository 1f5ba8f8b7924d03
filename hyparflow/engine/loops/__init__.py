"""Fit, evaluate and predict's loops with Keras callbacks, the progress bar, and the
optimizer state rank 0 gathers for the files its callbacks save."""
