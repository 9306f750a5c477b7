"""Direct preference optimization (`lm-train dpo`): the loss, the pairs' data, the frozen reference model."""
