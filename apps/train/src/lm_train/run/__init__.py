"""The training run: loop, step, state, start, preflight, mesh, precision, checkpoints, signals, tracking."""
