"""The parts of inference=pytorch (retrain/inference/pytorch.py), one job each: counter-based random numbers,
token choice, the paged KV cache and its budget, row admission, and the decode loop that drives them."""
