"""Advantage algorithms: rewards and token log-probs in, token advantages out (pure tensors, no models).

advantages.py   episode advantages (grpo, maxrl, reinforce_pp, rloo, grpo_std)
uncertainty.py  token uncertainty kinds (surprisal, predictive_variance, shannon_entropy)
transforms.py   token transforms (SEPA pooling/amplification, GTPO, HICRA, surprisal mask)
batch.py        batch normalisation and the advantage cap
tokens.py       TokenBatch, the step's token-level view, and its masked reductions
base.py         the Algorithm protocol the trainer calls, and AdvantageOutput
pipeline.py     Algorithm: the built-in one, its parts composed
sepa.py         the SEPA lambda schedule (linear, auto, correctness gate) and its state
grams.py        strategic grams; planning.py finds them in completions and marks their tokens
checks.py       the contracts plugins' outputs are checked against; preflight.py the synthetic probe at startup
config.py       the `algorithm` group's schema (SCHEMAS)
"""
