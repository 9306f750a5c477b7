"""`python -m lm_train` runs the lm-train command."""

from lm_train.cli import main

main()
