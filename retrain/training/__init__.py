"""The step loop and what it drives: batch sizes, the freshness proof after every sync, the metric sinks."""
