"""From the data config to batches: inputs, tokenizer, cache builds, the batches of each step, prefetching."""

DATA_TIMEOUT_S = 3600.0
"""How long a reader waits for a cache build (or process 0's tokenizer) to provide what a step needs."""
