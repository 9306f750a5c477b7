"""Training data: the built-in corpus, tokenizers and the shard-cache pipeline."""
