"""The `lm-train` command (`python -m lm_train` too): the process's host set-up, then the command line."""

from lm_train.run.host_memory import restart_with_hugepage_malloc


def main() -> None:
    """Start again with malloc on huge pages when that helps (before the heavy imports), then run the CLI."""
    restart_with_hugepage_malloc()
    from lm_train.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
