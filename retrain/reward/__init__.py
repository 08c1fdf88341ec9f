"""Verifiable rewards (match, math, judge) and the parallel, time-bounded scorer that runs them."""
