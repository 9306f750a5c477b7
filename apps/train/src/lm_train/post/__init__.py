"""Post-training on top of the run: LoRA, DPO, DoReMi."""
