"""A tool-less chat harness that runs in-process: one model call per segment, through the rollout's
interception endpoint (as verifiers 0.4 requires of every harness).

verifiers' built-in harnesses launch programs (`bash`, `null`) that `uv` installs into a runtime, which
needs the network; this one needs nothing beyond verifiers itself, so single-turn and multi-turn
(`Interaction.turn`) environments run offline. An environment uses it by exporting it from its taskset
module (`__all__ = ["MyTaskset", "ChatHarness"]`) or by pinning `harness={"id": <a module exporting it>}`.
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire


class ChatHarnessConfig(vf.HarnessConfig):
    """No knobs: the prompt comes from the task, the sampling from the run."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """Sends the conversation so far and ends the segment with the model's reply."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a later segment is relaunched on the whole conversation (multi-turn)
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: Any,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[Any] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(message) for message in prompt or [])
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["ChatHarness"]
