"""The formulas of docs/advantages.md applied completion by completion on Python floats: the oracle for the tensors.

Also the baseline of benchmarks/advantages.py, which times the vectorized pipeline against it.
"""

from __future__ import annotations

import math


def episode(kind: str, group: list[float]) -> list[float]:
    n, mean = len(group), sum(group) / len(group)
    if kind in ("grpo", "reinforce_pp"):
        return [r - mean for r in group]
    if kind == "maxrl":
        return [(r - mean) / (mean + 1e-6) if mean > 1e-6 else 0.0 for r in group]
    if kind == "rloo":
        return [r - (sum(group) - r) / (n - 1) if n > 1 else 0.0 for r in group]
    if kind == "grpo_std":
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / n)
        return [(r - mean) / (std + 1e-6) for r in group]
    raise ValueError(kind)


def uncertainty(kind: str, logprob: float, entropy: float | None) -> float:
    if kind == "surprisal":
        return min(-logprob, 50.0)
    if kind == "predictive_variance":
        p = math.exp(max(logprob, -50.0))
        return min(p * (1 - p), 50.0)
    return min(entropy, 50.0)


def sepa(variant: str, u: list[float], plan: list[bool], lam: float) -> list[float]:
    lam = min(max(lam, 0.0), 1.0)
    execution = [x for x, p in zip(u, plan) if not p]
    if lam == 0.0 or not execution:
        return u
    mu = sum(execution) / len(execution)
    if variant == "pool":
        return [x if p else lam * mu + (1 - lam) * x for x, p in zip(u, plan)]
    amplified = [x if p else (1 + lam) * x - lam * mu for x, p in zip(u, plan)]
    return [x if p else max(0.0, x) for x, p in zip(amplified, plan)] if variant == "amp_c" else amplified


def sepa_variant(transform: str) -> str | None:
    """The SEPA variant a transform name applies, None when it applies none."""
    return {"gtpo_sepa": "pool", "gtpo_sepa_amp": "amp", "gtpo_sepa_amp_c": "amp_c"}.get(transform)


def gtpo(advantages: list[float], u: list[float], beta: float) -> list[float]:
    u = [min(x, 50.0) for x in u]
    mean = sum(u) / len(u) if u else 0.0
    if beta == 0.0 or mean < 1e-7:
        return list(advantages)
    return [a * max(0.0, 1 + beta * (x / (mean + 1e-8) - 1)) for a, x in zip(advantages, u)]


def token_advantages(
    *,
    advantage: str,
    transform: str,
    rewards: list[list[float]],
    logprobs: list[list[float]],
    planning: list[list[bool]],
    entropies: list[list[float]] | None,
    kind: str = "surprisal",
    lam: float = 0.0,
    beta: float = 0.1,
    alpha: float = 0.2,
    rho: float = 0.0,
    batch_norm: bool = False,
    cap: float = 0.0,
) -> list[list[float]]:
    """Token advantages of every completion's real tokens (`logprobs` rows hold real tokens only)."""
    batch_norm = batch_norm or advantage == "reinforce_pp"
    out, raw_rows = [], []
    for b, group in enumerate(rewards):
        uniform = max(group) - min(group) <= 1e-6 and len(group) > 1
        values = [0.0] * len(group) if uniform and not batch_norm else episode(advantage, group)
        for g, a in enumerate(values):
            row = b * len(group) + g
            plan = planning[row]
            raw = [
                uncertainty(kind, lp, entropies[row][t] if entropies else None) for t, lp in enumerate(logprobs[row])
            ]
            raw_rows.append(raw)
            u = raw
            variant = sepa_variant(transform)
            if variant is not None:
                u = sepa(variant, u, plan, lam)
            tokens = [a] * len(u)
            if transform != "none":
                tokens = gtpo(tokens, u, beta)
            if transform == "gtpo_hicra":
                tokens = [x + alpha * abs(x) if p else x for x, p in zip(tokens, plan)]
            out.append(tokens)
    if rho > 0:
        size = len(rewards[0])
        for b in range(len(rewards)):
            rows = range(b * size, (b + 1) * size)
            pooled = sorted((x for r in rows for x in raw_rows[r]), reverse=True)
            if not pooled:
                continue
            threshold = pooled[min(max(1, int(len(pooled) * rho)), len(pooled)) - 1]
            for r in rows:
                out[r] = [a if x >= threshold else 0.0 for a, x in zip(out[r], raw_rows[r])]
    if batch_norm:
        nonzero = [a for row in out for a in row if a != 0.0]
        if nonzero:
            mu = sum(nonzero) / len(nonzero)
            sigma = math.sqrt(sum((a - mu) ** 2 for a in nonzero) / len(nonzero))
            scale = sigma + 1e-8 if sigma >= 1e-8 else 1.0
            out = [[(a - mu) / scale if a != 0.0 else 0.0 for a in row] for row in out]
    if cap > 0:
        out = [[min(max(a, -cap), cap) for a in row] for row in out]
    return out


def uncertainty_moments(
    *,
    transform: str,
    logprobs: list[list[float]],
    planning: list[list[bool]],
    entropies: list[list[float]] | None = None,
    kind: str = "surprisal",
    lam: float = 0.0,
) -> dict[str, float]:
    """Mean and (population) variance of execution and planning uncertainty over the step's real tokens,
    before and after SEPA: the pipeline's `<prefix>/{exec,plan}_{mean,var}_{before,after}` metrics."""
    values: dict[str, list[float]] = {f"{part}_{when}": [] for part in ("exec", "plan") for when in ("before", "after")}
    variant = sepa_variant(transform)
    for row, plan in enumerate(planning):
        before = [uncertainty(kind, lp, entropies[row][t] if entropies else None) for t, lp in enumerate(logprobs[row])]
        after = sepa(variant, before, plan, lam) if variant is not None else before
        for when, u in (("before", before), ("after", after)):
            for x, p in zip(u, plan):
                values[f"{'plan' if p else 'exec'}_{when}"].append(x)
    moments = {}
    for key, data in values.items():
        part, when = key.split("_")
        mean = sum(data) / len(data) if data else 0.0
        moments[f"{part}_mean_{when}"] = mean
        moments[f"{part}_var_{when}"] = sum((x - mean) ** 2 for x in data) / len(data) if data else 0.0
    return moments
