"""Several processes: the DP x TP / EP mesh, parallelizing the model from outside, sharded loading and export, collectives."""
