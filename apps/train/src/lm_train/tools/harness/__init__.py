"""lm-evaluation-harness on our models: the LM adapter, built-in offline tasks, and running them."""
