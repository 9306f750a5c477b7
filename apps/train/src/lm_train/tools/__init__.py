"""What works on a run or a checkpoint: sample, export, token scores and viewer, plots, the eval harness."""
