"""A multi-turn verifiers 0.4 test environment: a wrong answer gets "Wrong, try again." until max_turns.

The environment's turns are user messages sent through `Interaction.turn`; the reward reads the last reply.
"""

from __future__ import annotations

import verifiers.v1 as vf
from retrain_arith_single import ArithTaskset as SingleTurnTaskset

from retrain.environments.harness import ChatHarness

RETRY = "Wrong, try again."


class ArithMultiTaskset(SingleTurnTaskset):
    pass


class ArithMultiEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=3)


class ArithMultiEnv(vf.Env[ArithMultiEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            while not reply.terminated and vf.extract_boxed_answer(reply.last_reply) != task.data.answer:
                reply = await chat.turn(RETRY)


__all__ = ["ArithMultiEnv", "ArithMultiTaskset", "ChatHarness"]
