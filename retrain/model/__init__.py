"""The model as both sides use it: its spec, its forward, its log-probs, and the probe that proves freshness.

The trainer's backend and the in-process inference engines import from here; this package imports
neither of them.
"""
