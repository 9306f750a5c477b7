"""named_tensors."""
