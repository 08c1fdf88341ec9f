"""`retrain backends [--json]`: every built-in backend with its capabilities, options and extra.

What a user reads before choosing `backend=`: whether it keeps token-level advantages, reports a
real loss and resumes exactly, which `backend.*` keys it takes, and whether its extra is installed.
A plugin backend can be described too (`--target my_pkg.MyBackend`): what its hooks declare.
"""

from __future__ import annotations

import argparse
import json

from retrain.backend.capabilities import HOOK_NAMES, BackendInfo, builtin_backends, describe_backend
from retrain.errors import ConfigError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrain backends", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the machine-readable description")
    parser.add_argument("--target", help="also describe the plugin backend class at this dotted path")
    args = parser.parse_args(argv)
    try:
        infos = builtin_backends() + ([describe_backend(args.target)] if args.target else [])
    except ConfigError as error:
        parser.exit(1, f"retrain backends: {error}\n")
    if args.json:
        print(json.dumps({"backends": [info.as_dict() for info in infos], "plugin_hooks": list(HOOK_NAMES)}, indent=2))
        return 0
    for info in infos:
        print(_describe(info))
    print(f"Plugin backends (backend._target_=...) declare these through the hooks: {', '.join(HOOK_NAMES)}")
    return 0


def _describe(info: BackendInfo) -> str:
    caps = info.capabilities
    installed = (
        "built in"
        if info.extra is None
        else (
            f"extra [{info.extra}] installed" if info.extra_installed else f"needs: pip install 'retrain[{info.extra}]'"
        )
    )
    lines = [
        f"{info.name}  ({info.target}; {installed}; source={info.source})",
        f"  reports_sync_loss={caps.reports_sync_loss} preserves_token_advantages={caps.preserves_token_advantages} "
        f"supports_checkpoint_resume={caps.supports_checkpoint_resume} "
        f"resume_runtime_dependent={caps.resume_runtime_dependent}",
    ]
    for spec in info.options.values():
        choices = f" {{{'|'.join(map(str, spec.choices))}}}" if spec.choices else ""
        lines.append(f"  backend.{spec.name}: {spec.type} = {spec.default!r}{choices}  {spec.help}".rstrip())
    return "\n".join(lines) + "\n"
