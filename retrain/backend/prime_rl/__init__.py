"""backend=prime_rl: retrain's trainer loop drives an external PRIME-RL trainer and inference server.

retrain takes the place of PRIME-RL's orchestrator: it samples from the PRIME-RL inference server
(engine.py), packs each step's rows into PRIME-RL's micro-batch messages (messages.py, packing.py),
hands them to the PRIME-RL trainer through its rollout transport (transport.py), and waits for the
trainer's broadcast of the new weights, which the inference server then reloads (weights.py).
The wire format follows PRIME-RL v0.8.1.dev67 (commit 559b44772e471d1538537b8805cc77f3824a5e64).
"""
