"""`retrain doctor [overrides…] [--json]`: is this machine ready for a run, and what blocks it.

    retrain doctor                         # the default run (`python -m retrain`)
    retrain doctor experiment=quickstart   # the run these overrides compose (any `python -m retrain` takes)

Reports Python, torch, CUDA and each GPU's memory, every optional extra (importable or not, with its
version; nothing heavy is imported), wandb's login state (never the key), whether the Hugging Face Hub
answers or the cache is offline, the SLURM commands and whether a cluster answers, a `.env` file, and the
composed backend's capability flags with where they come from (`builtin`, `plugin/hook`, `plugin/default`).
Exit 1 when something blocks the run the overrides compose (no GPU for `backend.devices=gpu:0`, the
backend's extra missing, the model neither here nor fetchable, ...), each finding with its fix; else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import netrc
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from retrain.config_checks.compose_errors import config_mistake
from retrain.distributed.rendezvous import rendezvous_report
from retrain.errors import ConfigError, UserError
from retrain.housekeeping.digits import whole_number
from retrain.housekeeping.secrets import check_env_names, masked_values

# pip extra -> the top-level modules it provides (pyproject.toml's optional dependencies)
EXTRAS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "sglang": ("sglang",),
    "tinker": ("tinker",),
    "prime_rl": ("msgspec", "zmq"),
    "verifiers": ("verifiers",),
    "tensorboard": ("tensorboard",),
    "semantic": ("sentence_transformers",),
}
# inference `_target_` -> the extra its engine imports in-process (server engines need only httpx)
ENGINE_EXTRAS = {"retrain.inference.vllm.VllmEngine": "vllm"}
SLURM_COMMANDS = ("sinfo", "sbatch", "squeue", "scancel", "sacct")
SLURM_TIMEOUT_S = 5.0
WANDB_HOST = "https://api.wandb.ai"


@dataclass(frozen=True)
class Finding:
    """Something that blocks the run (`blocking`) or may surprise it (`warning`), with what to do."""

    check: str
    severity: str  # "blocking" | "warning"
    message: str
    fix: str


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="retrain doctor",
        description="Check this machine for a run: exit 1 when something blocks it, each finding with its fix.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run to check (default: the default run)")
    parser.add_argument("--json", action="store_true", help="print the machine-readable report")
    parser.add_argument("--config-dir", type=Path, help="a config dir of your own, searched too (as for retrain)")
    args = parser.parse_args(argv)
    report = masked_values(diagnose(args.overrides, args.config_dir))  # no key or credential shown
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


def diagnose(overrides: list[str], config_dir: Path | None = None) -> dict[str, Any]:
    """The whole report (what `--json` prints)."""
    with ThreadPoolExecutor(max_workers=2) as waiting:  # the Hub probe and sinfo may each wait seconds
        hub, slurm = waiting.submit(hub_report), waiting.submit(slurm_report)
        distributions = packages_distributions()
        torch_info = torch_report()
        report: dict[str, Any] = {
            "python": {"version": platform.python_version(), "executable": sys.executable},
            "torch": torch_info,
            "extras": {extra: extra_report(extra, distributions, torch_info["cuda_available"]) for extra in EXTRAS},
            "wandb": wandb_report(distributions),
            "hub": hub.result(),
            "slurm": slurm.result(),
            "rendezvous": rendezvous_report(),
            "env_file": env_file_report(Path.cwd() / ".env"),
        }
    findings = config_findings(overrides, config_dir, report)
    report["findings"] = [asdict(finding) for finding in findings]
    report["ok"] = not any(finding.severity == "blocking" for finding in findings)
    return report


def config_findings(overrides: list[str], config_dir: Path | None, report: dict[str, Any]) -> list[Finding]:
    """The findings of the run the overrides compose, its part of the report put in `report["run"]`;
    a config that does not compose is one blocking finding."""
    from retrain.commands.explain import composed

    try:
        cfg = composed(overrides, config_dir)
        report["run"] = run_report(cfg, overrides)
        return run_findings(cfg, report)
    except Exception as error:
        mistake = config_mistake(error)
        if mistake is None:
            raise
        report["run"] = {"overrides": overrides, "error": mistake}
        return [Finding("config", "blocking", f"the config does not compose: {mistake}", "fix the override")]


# ---- the machine ---------------------------------------------------------------------------------


def torch_report() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"installed": False, "version": None, "cuda_available": False, "cuda_version": None, "gpus": []}
    import torch

    gpus = []
    available = torch.cuda.is_available()
    for index in range(torch.cuda.device_count() if available else 0):
        properties = torch.cuda.get_device_properties(index)
        try:
            free, _ = torch.cuda.mem_get_info(index)
        except RuntimeError:  # a GPU taken exclusively by another process
            free = None
        gpus.append(
            {
                "index": index,
                "name": properties.name,
                "memory_gib": round(properties.total_memory / 2**30, 1),
                "free_gib": None if free is None else round(free / 2**30, 1),
            }
        )
    return {
        "installed": True,
        "version": torch.__version__,
        "cuda_available": available,
        "cuda_version": torch.version.cuda,
        "gpus": gpus,
    }


def install_command(extra: str, cuda: bool) -> str:
    """How to install an extra on this machine: vLLM's wheels on PyPI are CUDA builds, so on a machine
    without CUDA its CPU build comes from the script that builds it."""
    if extra == "vllm" and not cuda:
        return "bash scripts/install-vllm-cpu.sh (no CUDA here: vLLM's CPU build)"
    return f"pip install 'retrain[{extra}]'"


def extra_report(extra: str, distributions: Mapping[str, list[str]], cuda: bool = True) -> dict[str, Any]:
    """Whether the extra's modules would import (found, not imported) and their distributions' versions."""
    modules = {}
    for module in EXTRAS[extra]:
        found = importlib.util.find_spec(module) is not None
        names = distributions.get(module, []) if found else []
        modules[module] = {
            "installed": found,
            "distribution": names[0] if names else None,
            "version": _version(names[0]) if names else None,
        }
    return {
        "installed": all(m["installed"] for m in modules.values()),
        "modules": modules,
        "install": install_command(extra, cuda),
    }


def _version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def wandb_report(distributions: Mapping[str, list[str]]) -> dict[str, Any]:
    """wandb's version and whether a key is there for it (the environment or a netrc entry); never the key."""
    installed = importlib.util.find_spec("wandb") is not None
    host = urlparse(os.environ.get("WANDB_BASE_URL", WANDB_HOST)).hostname or "api.wandb.ai"
    source = None
    if os.environ.get("WANDB_API_KEY"):
        source = "WANDB_API_KEY"
    else:
        path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
        try:
            if path.is_file() and netrc.netrc(path).authenticators(host):
                source = str(path)
        except (netrc.NetrcParseError, OSError):
            pass
    names = distributions.get("wandb", [])
    return {
        "installed": installed,
        "version": _version(names[0]) if installed and names else None,
        "logged_in": source is not None,
        "credentials": source,  # where the key is, not the key
        "host": host,
        "mode": os.environ.get("WANDB_MODE") or None,
    }


def hub_report() -> dict[str, Any]:
    from huggingface_hub import constants

    from retrain.hub import hub_reachable

    offline = bool(constants.HF_HUB_OFFLINE)
    return {
        "endpoint": constants.ENDPOINT,
        "offline": offline,  # HF_HUB_OFFLINE: only the cache is read
        "reachable": None if offline else hub_reachable(constants.ENDPOINT),
        "cache_dir": constants.HF_HUB_CACHE,
        "token": bool(os.environ.get("HF_TOKEN")) or Path(constants.HF_TOKEN_PATH).is_file(),
    }


def slurm_report() -> dict[str, Any]:
    commands = {name: shutil.which(name) for name in SLURM_COMMANDS}
    cluster: dict[str, Any] = {"answering": False, "partitions": [], "error": None}
    if commands["sinfo"] is None:
        cluster["error"] = "sinfo not found"
        return {"commands": commands, "cluster": cluster}
    try:
        answer = subprocess.run(
            [commands["sinfo"], "--noheader", "--format=%P %a %D %t"],
            capture_output=True,
            text=True,
            timeout=SLURM_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        cluster["error"] = f"sinfo did not answer within {SLURM_TIMEOUT_S:.0f} s (is slurmctld running?)"
        return {"commands": commands, "cluster": cluster}
    except OSError as error:
        cluster["error"] = f"sinfo: {error}"
        return {"commands": commands, "cluster": cluster}
    if answer.returncode != 0:
        cluster["error"] = f"sinfo exited {answer.returncode}: {answer.stderr.strip()[:300]}"
    else:
        cluster["answering"] = True
        cluster["partitions"] = [
            dict(zip(("partition", "availability", "nodes", "state"), line.split(), strict=False))
            for line in answer.stdout.splitlines()
            if line.strip()
        ]
    return {"commands": commands, "cluster": cluster}


def env_file_report(path: Path) -> dict[str, Any]:
    """A `.env` here and the names it sets (never their values); every retrain command loads it at start
    (retrain/cli.py), a variable already in the environment winning."""
    if not path.is_file():
        return {"path": None, "variables": []}
    from dotenv import dotenv_values  # the parser retrain/cli.py loads it with

    return {"path": str(path), "variables": list(dotenv_values(path))}


# ---- the run the overrides compose ---------------------------------------------------------------


def run_report(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    return {
        "overrides": overrides,
        "backend": str(cfg.backend._target_),
        "devices": cfg.backend.get("devices"),
        "model": str(cfg.model.name_or_path),
        "inference": str(cfg.inference._target_),
        "launcher": str(cfg.hydra.launcher.get("_target_", "")).rsplit(".", 1)[-1],
        "wandb_project": str(cfg.logging.wandb_project) or None,
        "capabilities": capability_report(str(cfg.backend._target_)),
        "error": None,
    }


def capability_report(backend: str) -> dict[str, Any]:
    """The backend's capability flags and their source, as the trainer's startup line reports them;
    the reason instead when its class cannot be read (its extra missing, a plugin not on the path)."""
    from retrain.backend.capabilities import BUILTIN_BACKENDS, describe_backend

    builtin = next((b for b in BUILTIN_BACKENDS.values() if b.target == backend), None)
    if builtin is not None and builtin.extra and not _installed(builtin.modules):
        return {"flags": None, "source": None, "error": f"its [{builtin.extra}] extra is not installed"}
    try:
        info = describe_backend(backend)
    except UserError as error:
        return {"flags": None, "source": None, "error": str(error)}
    return {"flags": info.capabilities.as_dict(), "source": info.source, "error": None}


def env_name_findings(cfg: DictConfig) -> list[Finding]:
    """A key pasted where a variable's name belongs (`*_env`): the run refuses it at start, so doctor does."""
    try:
        check_env_names(cfg)
    except ConfigError as error:
        return [Finding("config", "blocking", str(error), "put the key in that environment variable")]
    return []


def run_findings(cfg: DictConfig, report: dict[str, Any]) -> list[Finding]:
    return [
        *env_name_findings(cfg),
        *device_findings(cfg, report["torch"]),
        *extra_findings(cfg, report["extras"]),
        *model_findings(cfg, report["hub"]),
        *wandb_findings(cfg, report["wandb"]),
        *slurm_findings(cfg, report["slurm"]),
        *rendezvous_findings(report["rendezvous"]),
    ]


def rendezvous_findings(rendezvous: dict[str, Any]) -> list[Finding]:
    """Rank variables that cannot make a process group (docs/distributed.md): the run would wait, then time out."""
    problem = rendezvous["problem"]
    if problem is None:
        return []
    return [Finding("distributed", "blocking", f"torch.distributed rendezvous: {problem}", "see docs/distributed.md")]


def device_findings(cfg: DictConfig, torch_info: dict[str, Any]) -> list[Finding]:
    devices = cfg.backend.get("devices")
    if devices is None:  # a remote or external backend: its GPUs are not this machine's
        return []
    if not torch_info["installed"]:
        return [Finding("torch", "blocking", "torch is not installed", "pip install torch (see README.md)")]
    indices = (whole_number(spec.strip()[4:]) for spec in str(devices).split(","))
    wanted = sorted({index for index in indices if index is not None})
    visible = len(torch_info["gpus"])
    missing = [index for index in wanted if index >= visible]
    if not missing:
        return []
    seen = "no CUDA GPU is visible" if visible == 0 else f"only {visible} CUDA GPU(s) are visible"
    fix = "backend.devices=cpu (slow: for small models and tests)"
    if not _is_the_demo(cfg):
        fix += ", or experiment=quickstart for the CPU demo"
    if visible:
        fix = f"backend.devices=gpu:0 (a visible GPU), or {fix}"
    return [Finding("gpu", "blocking", f"backend.devices={devices!r} but {seen} (torch {torch_info['version']})", fix)]


def _is_the_demo(cfg: DictConfig) -> bool:
    """The run already is the offline demo: suggesting it would change nothing."""
    return OmegaConf.select(cfg, "hydra.runtime.choices.experiment") == "quickstart"


def extra_findings(cfg: DictConfig, extras: dict[str, Any]) -> list[Finding]:
    from retrain.backend.capabilities import BUILTIN_BACKENDS

    findings = []
    backend = str(cfg.backend._target_)
    builtin = next((b for b in BUILTIN_BACKENDS.values() if b.target == backend), None)
    if builtin is not None and builtin.extra and not extras.get(builtin.extra, {}).get("installed", False):
        findings.append(
            Finding(
                "extra",
                "blocking",
                f"backend {backend} needs the [{builtin.extra}] extra, which is not installed",
                f"pip install 'retrain[{builtin.extra}]'",
            )
        )
    if builtin is None and importlib.util.find_spec(backend.rpartition(".")[0].split(".")[0]) is None:
        findings.append(
            Finding(
                "backend",
                "blocking",
                f"backend._target_={backend!r}: its package is not installed",
                "install it, or put its directory on PYTHONPATH",
            )
        )
    engine = str(cfg.inference._target_)
    extra = ENGINE_EXTRAS.get(engine)
    if extra is not None and not extras[extra]["installed"] and not _samples_itself(backend):
        findings.append(
            Finding(
                "extra",
                "blocking",
                f"inference engine {engine} needs vLLM, which is not installed",
                f"{extras[extra]['install']}, or inference=pytorch",
            )
        )
    return findings


def _samples_itself(backend: str) -> bool:
    """A built-in that samples itself ignores `inference=` (found without importing it where its extra is missing)."""
    from retrain.backend.capabilities import BUILTIN_BACKENDS, describe_backend

    if not any(b.target == backend and (b.extra is None or _installed(b.modules)) for b in BUILTIN_BACKENDS.values()):
        return False
    return describe_backend(backend).capabilities.samples_itself


def _installed(modules: tuple[str, ...]) -> bool:
    return all(importlib.util.find_spec(module) is not None for module in modules)


def model_findings(cfg: DictConfig, hub: dict[str, Any]) -> list[Finding]:
    """The model must be here (a local dir, a bundled asset, the cache) or fetchable from the Hub."""
    from retrain.hub import local_path
    from retrain.model.spec import ASSET_PREFIX

    name = str(cfg.model.name_or_path)
    if name.startswith(ASSET_PREFIX) or cfg.backend.get("devices") is None:  # bundled, or loaded by a service
        return []
    try:
        if local_path(name, "model.name_or_path") is not None:
            return []
    except UserError as error:
        return [Finding("model", "blocking", str(error), "model.name_or_path=<a local model dir or a Hub id>")]
    if hub["reachable"]:
        return []
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json", revision=cfg.model.get("revision")), str):
        return []
    why = "HF_HUB_OFFLINE is set" if hub["offline"] else f"the Hub ({hub['endpoint']}) does not answer"
    return [
        Finding(
            "hub",
            "blocking",
            f"model.name_or_path={name!r} is not in the Hugging Face cache ({hub['cache_dir']}) and {why}",
            f"download it where the Hub answers (hf download {name}) into this cache"
            + (
                ", or set model.name_or_path=<a local model dir>"
                if _is_the_demo(cfg)
                else ", set model.name_or_path=<a local model dir>, or run the offline demo: experiment=quickstart"
            ),
        )
    ]


def wandb_findings(cfg: DictConfig, wandb: dict[str, Any]) -> list[Finding]:
    if not cfg.logging.wandb_project or wandb["mode"] in ("offline", "disabled"):
        return []
    if not wandb["installed"]:
        return [
            Finding(
                "wandb",
                "blocking",
                "logging.wandb_project is set but wandb is not installed",
                "pip install wandb, or logging.wandb_project=''",
            )
        ]
    if not wandb["logged_in"]:
        return [
            Finding(
                "wandb",
                "blocking",
                f"logging.wandb_project={cfg.logging.wandb_project!r} but no wandb key (WANDB_API_KEY or ~/.netrc)",
                "wandb login (or export WANDB_API_KEY), or WANDB_MODE=offline",
            )
        ]
    return []


def slurm_findings(cfg: DictConfig, slurm: dict[str, Any]) -> list[Finding]:
    launcher = str(cfg.hydra.launcher.get("_target_", ""))
    if not launcher.endswith("SlurmLauncher") or slurm["cluster"]["answering"]:
        return []
    return [
        Finding(
            "slurm",
            "blocking",
            f"hydra/launcher=slurm but no cluster answers ({slurm['cluster']['error']})",
            "run on a SLURM login node (docs/slurm.md), or leave hydra/launcher at its default",
        )
    ]


# ---- the text report ------------------------------------------------------------------------------


def _mark(good: bool | None) -> str:
    return "ok  " if good else "--  " if good is None else "no  "


def render(report: dict[str, Any]) -> str:
    torch_info, hub, wandb, slurm = report["torch"], report["hub"], report["wandb"], report["slurm"]
    lines = [f"{_mark(True)}Python {report['python']['version']} ({report['python']['executable']})"]
    if torch_info["installed"]:
        cuda = f"CUDA {torch_info['cuda_version']}" if torch_info["cuda_version"] else "CPU build"
        lines.append(f"{_mark(True)}torch {torch_info['version']} ({cuda}); {len(torch_info['gpus'])} GPU(s) visible")
        lines += [
            f"      gpu:{g['index']} {g['name']}: {g['memory_gib']} GiB ({g['free_gib']} GiB free)"
            for g in torch_info["gpus"]
        ]
    else:
        lines.append(f"{_mark(False)}torch not installed")
    for extra, info in report["extras"].items():
        found = ", ".join(
            f"{m['distribution'] or name} {m['version']}" if m["installed"] else f"{name} missing"
            for name, m in info["modules"].items()
        )
        lines.append(
            f"{_mark(info['installed'])}extra [{extra}]: {found}"
            + ("" if info["installed"] else f"  ({info['install']})")
        )
    login = f"logged in ({wandb['credentials']})" if wandb["logged_in"] else "not logged in"
    lines.append(
        f"{_mark(wandb['logged_in'])}wandb {wandb['version'] or 'not installed'}: {login}"
        + (f", WANDB_MODE={wandb['mode']}" if wandb["mode"] else "")
    )
    hub_state = (
        "offline (HF_HUB_OFFLINE): cache only"
        if hub["offline"]
        else ("reachable" if hub["reachable"] else "unreachable")
    )
    lines.append(f"{_mark(hub['reachable'])}Hugging Face Hub {hub['endpoint']}: {hub_state}; cache {hub['cache_dir']}")
    present = [name for name, path in slurm["commands"].items() if path]
    cluster = slurm["cluster"]
    answer = (
        f"cluster answers ({len(cluster['partitions'])} partition(s))"
        if cluster["answering"]
        else (f"no cluster ({cluster['error']})")
    )
    lines.append(f"{_mark(cluster['answering'])}SLURM: {', '.join(present) or 'no commands'}; {answer}")
    variables = {name: value for name, value in report["rendezvous"]["variables"].items() if value is not None}
    lines.append(
        f"{_mark(None if not variables else report['rendezvous']['problem'] is None)}torch.distributed rendezvous: "
        + (" ".join(f"{name}={value}" for name, value in variables.items()) if variables else "none (one process)")
    )
    env = report["env_file"]
    lines.append(
        f"{_mark(env['path'] is not None)}.env: "
        + (f"{env['path']} sets {', '.join(env['variables']) or 'nothing'}" if env["path"] else "none here")
    )
    run = report["run"]
    if run.get("error") is None:
        lines.append(
            f"Run checked: {' '.join(run['overrides']) or '(defaults)'}: backend {run['backend']}, devices "
            f"{run['devices']}, model {run['model']}, launcher {run['launcher']}"
        )
        capabilities = run["capabilities"]
        if capabilities["error"] is None:
            flags = ", ".join(f"{key}={value}" for key, value in capabilities["flags"].items())
            lines.append(f"      backend capabilities (source={capabilities['source']}): {flags}")
        else:
            lines.append(f"      backend capabilities: unknown ({capabilities['error']})")
    for finding in report["findings"]:
        lines.append(f"{finding['severity'].upper()}: {finding['message']}\n  fix: {finding['fix']}")
    lines.append("Ready for this run." if report["ok"] else "Not ready: fix the blocking findings above.")
    return "\n".join(lines)
