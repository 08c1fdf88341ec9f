"""`retrain init --interactive`: the few choices a first run needs, asked one by one, as a preset.

Each question shows its default (what a plain `python -m retrain` runs; an empty answer takes it) and,
when they are few, its options. The answers are read a line each from stdin, so a script can give them
all (`printf 'tiny\\narithmetic\\n...' | retrain init --interactive`): without a terminal a wrong or
missing answer ends the command naming the question, since re-asking would shift every later answer.
The answers are composed as a run before anything is written, so a preset that would not compose is
never written.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from omegaconf import DictConfig, OmegaConf

from retrain.config import compose, config_groups
from retrain.errors import UserError
from retrain.housekeeping.digits import whole_number

if TYPE_CHECKING:
    from retrain.model.spec import ModelSpec

LISTED = 8  # a group with more options names only the default and how many there are
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a NUL byte, an escape, ...: in no answer


class AnswerError(Exception):
    """An answer that does not fit its question, read where there is no one to ask again."""


@dataclass
class Questions:
    """Asks on `output`, reads answers from `answers`; re-asks a wrong answer only on a terminal."""

    answers: TextIO
    output: TextIO

    def ask(
        self, question: str, default: str, check: Callable[[str], str | None], options: list[str] | None = None
    ) -> str:
        """The answer (the default when empty); `check` says what is wrong with one, or None."""
        shown = ""
        if options:
            listed = (
                ", ".join(options) if len(options) <= LISTED else f"{len(options)} options, `python -m retrain --help`"
            )
            shown = f" ({listed})"
        while True:
            self.output.write(f"{question}{shown} [{default}]: ")
            self.output.flush()
            line = self.answers.readline()
            if not line:
                raise AnswerError(f"stdin ended before {question!r} was answered")
            if not self.answers.isatty():
                self.output.write(line if line.endswith("\n") else line + "\n")  # a transcript reads as asked
            answer = line.strip() or default
            problem = _unprintable(answer) or check(answer)
            if problem is None:
                return answer
            if not self.answers.isatty():
                raise AnswerError(f"{question}: {problem}")
            self.output.write(f"  {problem}\n")


def one_of(options: list[str]) -> Callable[[str], str | None]:
    return lambda answer: None if answer in options else f"{answer!r} is not one of: {', '.join(options)}"


def positive_int(answer: str) -> str | None:
    number = whole_number(answer)  # ASCII digits: `²` passes str.isdigit, not int
    return None if number is not None and number >= 1 else f"{answer!r} is not a whole number >= 1"


def loadable_model(options: list[str]) -> Callable[[str], str | None]:
    """An option of the model group, or a Hub id or a model directory that is there (checked now, where the
    answer can still be given again, not when the preset first runs)."""

    def check(answer: str) -> str | None:
        if answer in options:
            return None
        try:
            _model_spec(answer, options).source()
        except UserError as error:
            return str(error)
        return None

    return check


def anything(answer: str) -> str | None:
    return None if answer else "an answer is needed"


def _unprintable(answer: str) -> str | None:
    """No answer holds a control character: a NUL byte ends a path at the OS and breaks an override."""
    found = CONTROL.search(answer)
    return None if found is None else f"{answer!r} holds the control character {found.group()!r}; type it without"


def ask_run(questions: Questions) -> tuple[list[str], dict[str, object]]:
    """The group choices (`group=option` overrides) and values (`key: value`) of the run the answers describe."""
    defaults = compose(return_hydra_config=True)
    choices = OmegaConf.to_container(defaults.hydra.runtime.choices)
    assert isinstance(choices, dict)
    groups = config_groups()
    picked: dict[str, str] = {}
    values: dict[str, object] = {}

    def pick(group: str, question: str) -> str:
        options = groups[group]
        picked[group] = questions.ask(question, str(choices[group]), one_of(options), options)
        return picked[group]

    model_options = groups["model"]
    model = questions.ask(
        "model: an option, a Hub id or a local directory",
        str(choices["model"]),
        loadable_model(model_options),
        model_options,
    )
    if model in model_options:
        picked["model"] = model
    else:
        values["model.name_or_path"] = model
    if pick("data", "data") == "jsonl":
        values["data.path"] = questions.ask("data.path: a jsonl/parquet/csv file, directory or Hub id", "", anything)
    pick("reward", "reward")
    pick("algorithm", "algorithm (<advantage>_<transforms>)")
    backend = pick("backend", "backend")
    backend_cfg = compose([f"backend={backend}"]).backend
    if "devices" in backend_cfg:
        values["backend.devices"] = questions.ask(
            "backend.devices (cpu, gpu:N)", _device_default(str(backend_cfg.devices)), anything
        )
    if not _samples_itself(backend_cfg):
        pick("inference", "inference engine")
    values["training.max_steps"] = int(
        questions.ask("training.max_steps", str(defaults.training.max_steps), positive_int)
    )
    max_tokens = _fitting_max_tokens(_model_spec(model, model_options), int(defaults.training.max_tokens))
    values["training.max_tokens"] = int(
        questions.ask("training.max_tokens (new tokens per completion)", str(max_tokens), positive_int)
    )
    return [f"{group}={option}" for group, option in picked.items()], values


def _model_spec(model: str, options: list[str]) -> ModelSpec:
    """The model an answer names: an option of the group, else the default's with `name_or_path` set (set on
    the config, not as an override, so a path with spaces or `=` in it is taken as it is)."""
    node = compose([f"model={model}"] if model in options else []).model
    if model not in options:
        node.name_or_path = model
    spec: ModelSpec = OmegaConf.to_object(node)  # type: ignore[assignment]
    return spec


def _fitting_max_tokens(spec: ModelSpec, default: int) -> int:
    """The default, or half the model's context when that is less and the model is here to read (a Hub
    model's context would need a download): a run whose completions leave no room for the prompt is refused."""
    from retrain.config_checks.validation import model_context

    if spec.source()[1]:
        return default
    context = model_context(spec)
    return default if context is None else min(default, context // 2)


def _device_default(configured: str) -> str:
    """The composed default where CUDA is, else cpu: the first run should run on this machine."""
    import torch

    return configured if torch.cuda.is_available() else "cpu"


def _samples_itself(backend: DictConfig) -> bool:
    """A backend that is its own engine ignores `inference=`: not asked."""
    from retrain.backend.capabilities import describe_backend

    return describe_backend(str(backend._target_)).capabilities.samples_itself


def preset_text(name: str, command: str, picked: list[str], values: dict[str, object]) -> str:
    """The preset's YAML: the picked options as overrides of the defaults list, then the values."""
    nested: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        section, _, field = key.partition(".")
        nested.setdefault(section, {})[field] = value
    body = OmegaConf.to_yaml(OmegaConf.create(nested)) if nested else ""
    header = [
        "# @package _global_",
        f"# {name}: written by `retrain init --interactive`. Edit freely; run it with",
        f"#   {command}",
        "# Inspect what it composes to first: add --cfg job. Every key: docs/configuration.md.",
        "defaults:",
        *(f"  - override /{choice.replace('=', ': ')}" for choice in picked),
    ]
    return "\n".join(header) + "\n\n" + body


def interview(answers: TextIO | None = None, output: TextIO | None = None) -> tuple[list[str], dict[str, object]]:
    """Ask every question on stdin/stdout (or the given streams); AnswerError when an answer cannot be used."""
    return ask_run(Questions(answers or sys.stdin, output or sys.stdout))
