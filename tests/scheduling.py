"""How pytest-xdist's two workers share the tests (`--dist loadscope`, pyproject; tests/conftest.py installs it).

A module's tests run on one worker, so that a module-scoped server or engine starts once. The SLURM modules all run
on one worker: the one-node cluster runs one module's jobs at a time (tests/campaign/test_slurm.py's lock), and a
second worker would wait for it. The tests of an independent module go one by one to whichever worker is free: they
share nothing and each takes minutes, so a module of them on one worker would leave the other idle at the end.

The units are drawn from module paths in the controller, which never imports a test module (a marker would not reach
it); xdist's own `xdist_group` marks cannot do it under pytest 9.2, where a test's id no longer follows the
`_nodeid` xdist rewrites.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

ON_THE_CLUSTER = frozenset({"tests/campaign/test_slurm.py", "tests/campaign/test_slurm_distributed.py"})
INDEPENDENT = frozenset(
    {
        "tests/distributed/test_servers_ranks.py",
        "tests/test_benchmarks.py",
        "tests/test_memory_plan.py",
        "tests/test_training.py",
        "tests/test_vllm_training.py",
    }
)


class SharedScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with this suite's units: a module, the SLURM modules together, or one test."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        if module in ON_THE_CLUSTER:
            return "the SLURM cluster"
        return nodeid if module in INDEPENDENT else module
