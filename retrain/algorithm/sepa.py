"""The SEPA schedule: how strongly execution-token uncertainty is pooled (lambda) at each step.

`linear` ramps lambda from 0 to 1 over `steps` after `delay_steps`; `auto` also raises it as the
execution-token uncertainty variance decays below `var_threshold` of its post-warmup level. A
correctness gate holds lambda at 0 until a step's correct rate reaches `correct_rate_gate`.
The learned state (variance EMA, baseline, warmup count, gate) goes into every checkpoint;
hyper-parameters always come from the current config (their defaults: `SEPASettings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from retrain.algorithm.checks import require
from retrain.algorithm.config import SEPASettings

SCHEDULES = ("linear", "auto")
VAR_FLOOR = 1e-8


@dataclass(eq=False)
class SEPASchedule(SEPASettings):
    """Resolves lambda before a step samples, and learns from the step once it is done.

    Built from the hyper-parameters of `SEPASettings` (the schema of `algorithm.sepa`, so each default
    is written once); the learned state starts empty.
    """

    var_ema: float | None = field(default=None, init=False)
    var_0: float | None = field(default=None, init=False)
    warmup_seen: int = field(default=0, init=False)
    gate_open: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        require(
            self.schedule in SCHEDULES, f"algorithm.sepa.schedule={self.schedule!r} must be one of {list(SCHEDULES)}"
        )
        require(self.steps >= 0, f"algorithm.sepa.steps={self.steps} must be >= 0")
        require(self.delay_steps >= 0, f"algorithm.sepa.delay_steps={self.delay_steps} must be >= 0")
        require(
            0.0 <= self.correct_rate_gate <= 1.0,
            f"algorithm.sepa.correct_rate_gate={self.correct_rate_gate} must be in [0, 1]",
        )
        require(0.0 <= self.ema_decay <= 1.0, f"algorithm.sepa.ema_decay={self.ema_decay} must be in [0, 1]")
        require(self.warmup >= 1, f"algorithm.sepa.warmup={self.warmup} must be >= 1")
        require(self.var_threshold > 0.0, f"algorithm.sepa.var_threshold={self.var_threshold} must be > 0")
        self.gate_open = self.correct_rate_gate <= 0.0

    def linear_lambda(self, step: int) -> float:
        if self.steps <= 0:
            return 0.0
        return min(max((step - self.delay_steps) / self.steps, 0.0), 1.0)

    def auto_lambda(self) -> float:
        if self.var_ema is None or self.var_0 is None:
            return 0.0
        return 1.0 - min(self.var_ema / self.var_0 / self.var_threshold, 1.0)

    def lambda_at(self, step: int) -> float:
        """lambda for `step` from the state left by step - 1 (0 while the gate is closed)."""
        if not self.gate_open:
            return 0.0
        linear = self.linear_lambda(step)
        return max(self.auto_lambda(), linear) if self.schedule == "auto" else linear

    def update(self, correct_rate: float, execution_variance: float | None) -> None:
        """After a step: open the gate on a good enough correct rate; feed the auto schedule once."""
        if not self.gate_open and math.isfinite(correct_rate) and correct_rate >= self.correct_rate_gate:
            self.gate_open = True
        if self.schedule != "auto" or execution_variance is None or not math.isfinite(execution_variance):
            return
        if self.var_ema is None:
            self.var_ema = execution_variance
        else:
            self.var_ema = self.ema_decay * self.var_ema + (1.0 - self.ema_decay) * execution_variance
        if self.var_0 is None:
            self.warmup_seen += 1
            if self.warmup_seen >= self.warmup:
                self.var_0 = max(self.var_ema, VAR_FLOOR)

    def state_dict(self) -> dict[str, Any]:
        return {
            "var_ema": self.var_ema,
            "var_0": self.var_0,
            "warmup_seen": self.warmup_seen,
            "gate_open": self.gate_open,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"var_ema", "var_0", "warmup_seen", "gate_open"}
        require(not unknown, f"SEPA state has unknown keys {sorted(unknown)}")
        self.var_ema = None if state["var_ema"] is None else float(state["var_ema"])
        self.var_0 = None if state["var_0"] is None else float(state["var_0"])
        self.warmup_seen = int(state["warmup_seen"])
        self.gate_open = bool(state["gate_open"])
