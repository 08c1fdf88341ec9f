"""Campaigns: a `--multirun` of conditions × seeds, its manifest, statistics, plots, pre-emption and auto-squeeze."""
