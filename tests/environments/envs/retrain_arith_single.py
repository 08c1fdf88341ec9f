"""A single-turn verifiers 0.4 test environment: the tiny model's 2-digit additions, scored by exact answer.

Top-level module (verifiers imports a taskset id as a module name): the tests put this directory on PYTHONPATH.
`split=eval` yields no tasks, as an evaluation-only environment does.
"""

from __future__ import annotations

import verifiers.v1 as vf

from retrain.data.arithmetic import addition_example, draw_problems
from retrain.environments.harness import ChatHarness


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        return float(vf.extract_boxed_answer(trace.last_reply) == task.answer)


class ArithTasksetConfig(vf.TasksetConfig):
    num_tasks: int = 16
    split: str = "train"  # "eval": no tasks (an evaluation-only environment)


class ArithTaskset(vf.Taskset[ArithTask, ArithTasksetConfig]):
    def load(self):
        if self.config.split != "train":
            return
        for a, b in draw_problems(self.config.num_tasks, 10, 99, task_seed=0):
            example = addition_example(a, b)
            yield ArithTask(ArithData(id=example.id, prompt=example.prompt, answer=example.reference), self.config.task)


__all__ = ["ArithTaskset", "ChatHarness"]
