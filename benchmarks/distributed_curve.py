"""Does a run on 2 ranks learn as one on 1 rank does? The quickstart's curve and held-out accuracy, per seed (a script).

    python benchmarks/distributed_curve.py [--seeds 0 1 2] [--steps 150] [--ranks 2] [--out curve.json] [-- OVERRIDE ...]

For each seed, runs `python -m retrain experiment=quickstart` (its default held-out evaluation: 200 problems,
greedy and 4 samples each, before and after training) on 1 rank and on `--ranks` ranks
(`python -m torch.distributed.run --standalone --nproc-per-node=N`: gloo on the CPU), every process with
OMP_NUM_THREADS=1. Per run: the training curve (`correct_rate` per step; its mean over each `--window` steps)
and the held-out accuracy after training (status.json's `eval/after_greedy_accuracy` and
`eval/after_sampled_accuracy`). Prints a table of 1 rank vs N ranks per seed, each world size's mean over the
seeds with its spread (min-max and sample std), and the verdict for each quantity: is |mean_N - mean_1|
within the 1-rank seeds' min-max range (their seed-to-seed spread)?

The runs of one seed on 1 and on N ranks sample and train the same first step (tests/distributed/
test_same_as_one_rank.py) but part after it: the ranks sum the gradients in another order, so they are only
expected to be alike statistically; the script prints, per seed, the first step at which their metrics
differ, on how many steps their `correct_rate` is the same, and their largest |Δloss| and |Δgrad_norm|. The same seed on the same world size reproduces itself exactly: the
script runs `--repeat-seed` (default: the first seed) on N ranks a second time and compares the metrics of the
two runs (every field but the wall times, keys ending in `_s`, as tests/conftest.py's `without_timing`) and
their held-out results. docs/benchmarks.md and docs/distributed.md report what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = ["experiment=quickstart", "scoring.workers=1", "logging.console_groups=0", "logging.progress_bar=false"]
HELD_OUT = ("eval/after_greedy_accuracy", "eval/after_sampled_accuracy")


def run_env() -> dict[str, str]:
    """One OpenMP thread per process (the ranks share the CPUs), retrain importable, no Hub look-ups."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }


def command(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "retrain"]
    # --standalone: a rendezvous on a free local port (other runs on this machine may hold torchrun's 29500)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "retrain"]


def without_timing(records: list[dict]) -> list[dict]:
    """Metrics minus wall-clock fields (they end in `_s`), as tests/conftest.py's."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


def windows(steps: int, width: int) -> list[tuple[int, int]]:
    """[(first, last)] step ranges of `width` steps covering 0 .. steps-1."""
    return [(first, min(first + width, steps) - 1) for first in range(0, steps, width)]


def run(ranks: int, seed: int, steps: int, width: int, overrides: list[str], run_dir: Path) -> dict:
    """One run: its curve, window means, held-out results and metrics (for the reproducibility check)."""
    args = [*QUICKSTART, f"training.seed={seed}", f"training.max_steps={steps}", *overrides, f"hydra.run.dir={run_dir}"]
    log_file = run_dir.with_suffix(".log")
    started = time.perf_counter()
    with log_file.open("w") as log:
        finished = subprocess.run(
            [*command(ranks), *args], stdout=log, stderr=subprocess.STDOUT, env=run_env(), cwd=run_dir.parent
        )
    wall_s = time.perf_counter() - started
    if finished.returncode != 0:
        tail = "\n".join(log_file.read_text().splitlines()[-30:])
        raise SystemExit(f"{ranks}-rank run of seed {seed} failed ({finished.returncode}):\n{tail}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["step"])
    status = json.loads((run_dir / "status.json").read_text())
    curve = [r["correct_rate"] for r in records]
    if len(curve) != steps or status.get("state") != "done":
        raise SystemExit(f"{ranks}-rank run of seed {seed}: {len(curve)} of {steps} steps, state {status.get('state')}")
    return {
        "ranks": ranks,
        "seed": seed,
        "wall_s": round(wall_s, 1),
        "curve": curve,
        "windows": {f"{a}-{b}": statistics.fmean(curve[a : b + 1]) for a, b in windows(steps, width)},
        "held_out": {key: value for key, value in status.get("eval", {}).items() if key.startswith("eval/")},
        "metrics": without_timing(records),
    }


def quantities(result: dict) -> dict[str, float]:
    """The compared numbers of one run: the curve's window means and the held-out accuracy after training."""
    found = {f"correct_rate {name}": value for name, value in result["windows"].items()}
    for key in HELD_OUT:
        if key in result["held_out"]:
            found[key.removeprefix("eval/after_").replace("_accuracy", "") + " held-out"] = result["held_out"][key]
    return found


def spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def agreement(first: dict, second: dict) -> dict:
    """Whether two runs of one seed and world size gave identical metrics and held-out results."""
    differing = next((a["step"] for a, b in zip(first["metrics"], second["metrics"]) if a != b), None)
    same_length = len(first["metrics"]) == len(second["metrics"])
    return {
        "identical": differing is None and same_length and first["held_out"] == second["held_out"],
        "steps_compared": min(len(first["metrics"]), len(second["metrics"])),
        "first_differing_step": differing,
        "held_out_identical": first["held_out"] == second["held_out"],
    }


def same_seed(one: dict, many: dict) -> dict:
    """How far a seed's N-rank run is from its 1-rank run: the first step whose metrics differ (every field but
    the wall times and the dist/ ones), the steps with the same `correct_rate`, the largest |difference| of
    `loss` and `grad_norm`, and whether the held-out results are the same."""
    strip = [[{k: v for k, v in r.items() if not k.startswith("dist/")} for r in run["metrics"]] for run in (one, many)]
    differing = next((a["step"] for a, b in zip(*strip) if a != b), None)
    pairs = list(zip(one["metrics"], many["metrics"]))
    return {
        "first_differing_step": differing,
        "same_correct_rate_steps": sum(a["correct_rate"] == b["correct_rate"] for a, b in pairs),
        "steps": len(pairs),
        "max_abs_diff": {key: max(abs(a[key] - b[key]) for a, b in pairs) for key in ("loss", "grad_norm")},
        "held_out_identical": one["held_out"] == many["held_out"],
    }


def summarize(runs: list[dict], ranks: int) -> dict:
    """Per quantity: each world size's spread over the seeds and the verdict."""
    by_world = {n: [quantities(r) for r in runs if r["ranks"] == n] for n in (1, ranks)}
    summary = {}
    for name in by_world[1][0]:
        one, many = spread([q[name] for q in by_world[1]]), spread([q[name] for q in by_world[ranks]])
        gap = abs(many["mean"] - one["mean"])
        summary[name] = {
            "1": one,
            str(ranks): many,
            "gap": gap,
            "seed_range_1": one["max"] - one["min"],
            "within_seed_spread": gap <= one["max"] - one["min"],
        }
    return summary


def table(runs: list[dict], summary: dict, ranks: int, seeds: list[int]) -> list[str]:
    names = list(summary)
    head = ["seed", "ranks", *names, "wall"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed in seeds:
        for n in (1, ranks):
            (result,) = (r for r in runs if r["seed"] == seed and r["ranks"] == n and not r.get("repeat"))
            values = quantities(result)
            lines.append(
                f"| {seed} | {n} | " + " | ".join(f"{values[k]:.3f}" for k in names) + f" | {result['wall_s']:.0f} s |"
            )
    for n in (1, ranks):
        cells = [
            f"{summary[k][str(n)]['mean']:.3f} ({summary[k][str(n)]['min']:.3f}–{summary[k][str(n)]['max']:.3f}, "
            f"σ {summary[k][str(n)]['std']:.3f})"
            for k in names
        ]
        lines.append(f"| mean (min–max, σ) | {n} | " + " | ".join(cells) + " | |")
    verdicts = [
        f"{summary[k]['gap']:.3f} {'≤' if summary[k]['within_seed_spread'] else '>'} {summary[k]['seed_range_1']:.3f} "
        f"{'yes' if summary[k]['within_seed_spread'] else 'NO'}"
        for k in names
    ]
    lines.append(f"| \\|mean{ranks} − mean1\\| vs 1-rank range | | " + " | ".join(verdicts) + " | |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=50, help="steps per mean of the training curve")
    parser.add_argument("--ranks", type=int, default=2, help="the world size compared with 1 rank")
    parser.add_argument("--repeat-seed", type=int, help="the seed run twice on --ranks ranks (default: the first)")
    parser.add_argument("--out", type=Path, help="write the measurements as JSON here")
    parser.add_argument("overrides", nargs="*", help="more retrain overrides, e.g. eval.num_examples=50")
    args = parser.parse_args(argv)
    repeat_seed = args.seeds[0] if args.repeat_seed is None else args.repeat_seed
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="distributed_curve_") as tmp:
        work = Path(tmp)
        plan = [(seed, n, False) for seed in args.seeds for n in (1, args.ranks)] + [(repeat_seed, args.ranks, True)]
        for seed, n, repeat in plan:
            name = f"seed{seed}_ranks{n}" + ("_repeat" if repeat else "")
            result = run(n, seed, args.steps, args.window, args.overrides, work / name)
            result["repeat"] = repeat
            runs.append(result)
            windows_text = " ".join(f"{k}: {v:.3f}" for k, v in result["windows"].items())
            held_out = " ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in result["held_out"].items())
            print(
                f"seed {seed} on {n} rank(s){' (again)' if repeat else ''}: {result['wall_s']:.0f} s | "
                f"correct_rate {windows_text} | {held_out} | load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    first = next(r for r in runs if r["seed"] == repeat_seed and r["ranks"] == args.ranks and not r["repeat"])
    again = next(r for r in runs if r["repeat"])
    reproduced = {"seed": repeat_seed, "ranks": args.ranks, **agreement(first, again)}
    same_first_step = {
        seed: [r["metrics"][0]["correct_rate"] for r in runs if r["seed"] == seed and not r["repeat"]]
        for seed in args.seeds
    }
    one_vs_many = {}
    for seed in args.seeds:
        one, many = (
            next(r for r in runs if r["seed"] == seed and r["ranks"] == n and not r["repeat"]) for n in (1, args.ranks)
        )
        one_vs_many[seed] = same_seed(one, many)
    summary = summarize([r for r in runs if not r["repeat"]], args.ranks)
    print()
    print("\n".join(table(runs, summary, args.ranks, args.seeds)))
    print()
    print(
        f"seed {repeat_seed} on {args.ranks} ranks, run twice: "
        + ("identical metrics and held-out results" if reproduced["identical"] else f"DIFFERENT {reproduced}")
    )
    for seed, compared in one_vs_many.items():
        print(
            f"seed {seed}, 1 vs {args.ranks} ranks: metrics differ from step {compared['first_differing_step']}; "
            f"correct_rate equal on {compared['same_correct_rate_steps']} of {compared['steps']} steps; "
            f"max |Δloss| {compared['max_abs_diff']['loss']:.1e}, |Δgrad_norm| {compared['max_abs_diff']['grad_norm']:.1e}; "
            f"held-out results {'the same' if compared['held_out_identical'] else 'differ'}"
        )
    verdict = all(s["within_seed_spread"] for s in summary.values())
    print(f"{args.ranks} ranks within the 1-rank seed-to-seed spread on every quantity: {'yes' if verdict else 'NO'}")
    total_s = time.perf_counter() - started
    print(
        f"{len(runs)} runs in {total_s / 60:.1f} min; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    if args.out:
        report = {
            "seeds": args.seeds,
            "steps": args.steps,
            "ranks": args.ranks,
            "overrides": [*QUICKSTART, *args.overrides],
            "runs": [{k: v for k, v in r.items() if k != "metrics"} for r in runs],
            "summary": summary,
            "within_seed_spread": verdict,
            "reproduced": reproduced,
            "first_step_correct_rate": same_first_step,
            "one_vs_many": one_vs_many,
            "total_s": round(total_s, 1),
            "load_average": {"before": load_before, "after": os.getloadavg()},
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
