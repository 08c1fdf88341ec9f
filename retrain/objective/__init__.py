"""The training objective as pure functions of tensors: the per-token policy loss of each objective
(PPO/DAPO, GSPO, GSPO-token, CISPO), the KL and entropy terms, and how a step aggregates token losses
(docs/loss.md). The local backend calls them; a remote backend declares which non-default choices it
honours (`retrain.objective.support`)."""
