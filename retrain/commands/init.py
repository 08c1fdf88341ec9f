"""`retrain init --template quickstart|experiment|campaign [--name N] [--force]`, `retrain init --interactive`,
`retrain init --list`.

Writes a preset into your own config dir (`./conf` unless `--config-dir`), where Hydra finds it with
`--config-dir`, and prints the command that runs it. `--interactive` asks for the run's model, data,
reward, algorithm, backend, engine and steps instead (retrain/commands/init_interactive.py). Built-in
presets stay as shipped: a name that one of them already has is refused, since retrain's own option
would win over yours.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from retrain.config import config_dir, config_groups

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class Preset:
    """A template: what it is, the group it goes in, and how it is run."""

    summary: str
    group: str
    run: str  # the command, with {config_dir} and {name}

    def command(self, config_dir: str, name: str) -> str:
        return self.run.format(config_dir=config_dir, name=name)


PRESETS: dict[str, Preset] = {
    "quickstart": Preset(
        "the offline CPU demo (tiny Qwen3 learns 2-digit addition in minutes): a copy of experiment=quickstart",
        "experiment",
        "python -m retrain --config-dir {config_dir} experiment={name}",
    ),
    "experiment": Preset(
        "a full-size run: Qwen3-4B-Instruct on MATH with maxrl_gtpo_sepa, every main knob spelled out",
        "experiment",
        "python -m retrain --config-dir {config_dir} experiment={name}",
    ),
    "campaign": Preset(
        "conditions x seeds with statistics (a --multirun preset; add experiment=quickstart to try it on CPU)",
        "campaign",
        "python -m retrain --config-dir {config_dir} --multirun +campaign={name}",
    ),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrain init", description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--template", choices=list(PRESETS), help="the preset to write")
    what.add_argument(
        "--interactive",
        action="store_true",
        help="ask for model, data, reward, algorithm, backend, engine and steps (answers may come on stdin, a line each)",
    )
    parser.add_argument("--name", help="the preset's name (default: my_<template>, my_run with --interactive)")
    parser.add_argument("--config-dir", default="conf", help="your config dir (default: conf)")
    parser.add_argument("--force", action="store_true", help="overwrite a preset of that name")
    parser.add_argument("--list", action="store_true", help="list the templates")
    args = parser.parse_args(argv)
    if args.list:
        width = max(map(len, PRESETS))
        for template, preset in PRESETS.items():
            print(
                f"{template:<{width}}  {preset.summary}\n{'':<{width}}  -> {args.config_dir}/{preset.group}/<name>.yaml"
            )
        return 0
    if args.template is None and not args.interactive:
        parser.error("give --template (one of: " + ", ".join(PRESETS) + "), --interactive or --list")
    preset = PRESETS["experiment" if args.interactive else args.template]
    name = args.name or ("my_run" if args.interactive else f"my_{args.template}")
    if not NAME.fullmatch(name):
        parser.error(f"--name {name!r} must be letters, digits, '_' or '-' (it becomes {preset.group}=<name>)")
    if name in config_groups().get(preset.group, []):
        parser.exit(
            1,
            f"retrain init: {preset.group}={name} is a built-in preset and would win over yours; pick another --name\n",
        )
    target = Path(args.config_dir) / preset.group / f"{name}.yaml"
    if target.exists() and not args.force:
        parser.exit(1, f"retrain init: {target} exists; pass --force to overwrite it\n")
    text = (
        _interviewed(parser, name, args.config_dir)
        if args.interactive
        else render(args.template, name, args.config_dir)
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    except OSError as error:  # --config-dir names a file, or a place this user cannot write
        parser.exit(1, f"retrain init: cannot write {target}: {error.strerror} (--config-dir {args.config_dir})\n")
    print(f"wrote {target}\nrun it with:\n  {preset.command(args.config_dir, name)}")
    return 0


def _interviewed(parser: argparse.ArgumentParser, name: str, config_dir_arg: str) -> str:
    """The preset the answers describe, composed and checked as a run first (exit 1 naming what is wrong)."""
    from retrain.commands.explain import checked_config, composed
    from retrain.commands.init_interactive import AnswerError, interview, preset_text
    from retrain.config_checks.compose_errors import config_mistake

    try:
        picked, values = interview()
    except AnswerError as error:
        parser.exit(1, f"retrain init: {error}\n")
    text = preset_text(name, PRESETS["experiment"].command(config_dir_arg, name), picked, values)
    with tempfile.TemporaryDirectory() as scratch:  # composed where the user will run it from, before it is written
        (Path(scratch) / "experiment").mkdir()
        (Path(scratch) / "experiment" / f"{name}.yaml").write_text(text, encoding="utf-8")
        try:
            checked_config(composed([f"experiment={name}"], Path(scratch)))
        except Exception as error:
            mistake = config_mistake(error)
            if mistake is None:
                raise
            parser.exit(1, f"retrain init: these answers do not make a run: {mistake}\n")
    return text


def render(template: str, name: str, config_dir_arg: str) -> str:
    """The preset's text: the quickstart is the built-in demo itself under a header naming yours."""
    command = PRESETS[template].command(config_dir_arg, name)
    if template == "quickstart":
        return _quickstart(name, command)
    text = resources.files("retrain.templates").joinpath("init", f"{template}.yaml").read_text(encoding="utf-8")
    return Template(text).substitute(name=name, config_dir=config_dir_arg)


def _quickstart(name: str, command: str) -> str:
    """conf/experiment/quickstart.yaml with its header comment replaced: one source for the demo's settings."""
    lines = (Path(config_dir()) / "experiment" / "quickstart.yaml").read_text(encoding="utf-8").splitlines()
    body = lines[next(i for i, line in enumerate(lines) if not line.startswith("#")) :]
    header = [
        "# @package _global_",
        f"# {name}: the offline demo (written by `retrain init --template quickstart`): the tiny Qwen3",
        "# shipped inside retrain learns 2-digit addition on CPU. Edit freely; run it with",
        f"#   {command}",
    ]
    return "\n".join([*header, *body]) + "\n"
