"""``python -m ortflow``: the ``ortflow`` command."""

from ortflow.cli.app import main

if __name__ == "__main__":  # imported (not run) by tools that import every module
    main()
