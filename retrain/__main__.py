"""`python -m retrain ...`: the same entry as the `retrain` console script."""

from retrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
