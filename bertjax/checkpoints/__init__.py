"""Storage of runs: parameters, training checkpoints, run directories."""
