"""DoReMi: online domain reweighting of a mixture with a proxy model against a frozen reference (Xie et al. 2023)."""
