"""`retrain <command>` tools that are not a training run: each module has `main(argv) -> int`."""
