"""Environments as task sources: data sources that also sample and score their own rollouts (data=verifiers)."""
