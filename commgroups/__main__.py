"""``python -m commgroups``: the command line."""

from commgroups.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
