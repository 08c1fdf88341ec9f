"""One run on many processes: torch.distributed's process group, the step's row shares and what ranks gather.

docs/distributed.md: ranks split a step's groups, sample and score their own, gather the step's rollouts so
advantages see the whole batch, train their own rows and all-reduce the adapter's gradients.
"""
