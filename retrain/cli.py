"""Thin entry: tool subcommands (`status`, `squeeze`) by name, everything else through Hydra.

An error the user caused (a `retrain.errors.UserError`: config, data, plugin, Hub) ends a run with
its message on one line and exit code 1; its traceback goes to the run's log file only, unless the
run dir was refused (another run's, retrain/housekeeping/launch.py): then nothing goes into it. In a `--multirun`
the failed job reports the same way and the sweep goes on; Hydra ends it with the first failed job's
message, on one line too (a `FailedJob`). A mistake Hydra finds while composing the config (a key's
typo, a wrong type, a missing option) reads as one line too (retrain/config_checks/compose_errors.py). Any other error
is a bug in retrain and keeps Hydra's report, traceback included.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

import hydra
from dotenv import load_dotenv
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from retrain.config import config_dir, register_configs
from retrain.config_checks.compose_errors import COMPOSE_ERRORS, compose_error_line, output_dir_unwritable
from retrain.error_lines import one_line, user_error_behind
from retrain.errors import UserError
from retrain.housekeeping.threads import fitted_threads, set_openmp_waits, threads_override
from retrain.model.cuda_allocator import use_expandable_segments

log = logging.getLogger("retrain")

# subcommand -> module with `main(argv) -> int`
SUBCOMMANDS = {
    "status": "retrain.commands.status",
    "squeeze": "retrain.squeeze",
    "backends": "retrain.commands.backends",
    "doctor": "retrain.commands.doctor",
    "explain": "retrain.commands.explain",
    "init": "retrain.commands.init",
    "plugins": "retrain.commands.plugins",
    "init-plugin": "retrain.commands.init_plugin",
    "migrate-config": "retrain.commands.migrate_config",
    "man": "retrain.commands.man",
    "export": "retrain.commands.export",
}


def _hydra_entry(cfg: DictConfig) -> None:
    from retrain.config_checks.validation import check_run_config
    from retrain.housekeeping.launch import RunDirRefused
    from retrain.housekeeping.secrets import masked_override

    sys.argv[1:] = [masked_override(arg) for arg in sys.argv[1:]]  # parsed already; what wandb records of it
    try:
        # before retrain.run imports torch and transformers (10-20 s on a busy machine): a wrong value, an unknown
        # key or a local path that does not exist is refused in seconds; the run checks them again (run_as)
        check_run_config(cfg)
        from retrain.run import run

        run(cfg)
    except Exception as error:
        if isinstance(error, RunDirRefused):  # the run dir is another run's: not a line into its run.log
            _stop_logging_into(Path(HydraConfig.get().runtime.output_dir))
        user_error = user_error_behind(error)
        if user_error is None:
            raise
        _report_user_error(user_error, error)
        hydra_config = HydraConfig.get()
        if hydra_config.mode == RunMode.RUN:
            raise SystemExit(1) from None
        where = f"job #{hydra_config.job.num} ({hydra_config.runtime.output_dir})"
        raise FailedJob(f"retrain: {where} failed: {one_line(user_error)}", user_error) from None


class FailedJob(CompactHydraException):
    """A sweep job's user error. Hydra raises the first one when the sweep ends, and prints a compact
    error's message alone; `user_error` is what the job raised (the campaign's records read it)."""

    def __init__(self, message: str, user_error: UserError | None = None) -> None:
        super().__init__(message)
        self.user_error = user_error  # a default, so that a job on a cluster node sends it back pickled


def _stop_logging_into(run_dir: Path) -> None:
    """Close the log files Hydra opened inside `run_dir` (its run.log): what this process logs goes to the console."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(run_dir):
            root.removeHandler(handler)
            handler.close()


def _report_user_error(user_error: UserError, raised: BaseException) -> None:
    """The message, on one line, on the console and in the log files; the traceback (and the error's
    details) in the log files only."""
    files = [handler for handler in logging.getLogger().handlers if isinstance(handler, logging.FileHandler)]
    where = f" (traceback in {files[0].baseFilename})" if files else ""
    log.error("retrain: %s%s", one_line(user_error), where)
    details = f"\n{user_error.details.rstrip()}" if user_error.details else ""
    record = log.makeRecord(
        log.name,
        logging.ERROR,
        __file__,
        0,
        "traceback of the error above:%s",
        (details,),
        (type(raised), raised, raised.__traceback__),
    )
    for handler in files:
        if record.levelno >= handler.level:
            handler.handle(record)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if str(Path.cwd()) not in sys.path and "" not in sys.path:  # the `retrain` script: plugins in the working
        sys.path.insert(0, str(Path.cwd()))  # directory import as they do under `python -m retrain`
    # a `.env` in the working directory, as the original retrain read it: keys and tokens without exporting them (the environment wins)
    load_dotenv(Path.cwd() / ".env", override=False)
    if args and args[0] in ("--version", "-V"):
        print(f"retrain {version('retrain')}")
        return 0
    if args and args[0] in SUBCOMMANDS:
        try:
            return int(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]) or 0)
        except BrokenPipeError:  # `retrain plugins | head`: the reader has what it wanted
            sys.stderr.close()  # nothing more to say, and no "Exception ignored" flushing stdout at exit
            return 0
    if toml := next((arg for arg in args if arg.endswith(".toml") and "=" not in arg), None):
        print(
            f"retrain: {toml} is a TOML config of the original retrain, which this retrain no longer reads; convert it with "
            f"`retrain migrate-config {toml}` and run the preset it writes (the command says how)",
            file=sys.stderr,
        )
        return 2
    if args and re.fullmatch(r"[a-z][a-z-]*", args[0]):  # a word where Hydra wants key=value: a mistyped command
        close = difflib.get_close_matches(args[0], SUBCOMMANDS, n=1)
        hint = f"did you mean `retrain {close[0]}`? " if close else ""
        print(f"retrain: unknown command {args[0]!r}; {hint}commands: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    # before anything imports torch (Hydra's callbacks do): OpenMP reads its wait policy when torch loads
    set_openmp_waits(fitted_threads(threads_override(args)))  # retrain/housekeeping/threads.py
    use_expandable_segments()  # CUDA's allocator reads its setting when CUDA initialises
    register_configs()
    sys.argv = [sys.argv[0], *flags_before_overrides(args)]
    from retrain.campaign.sweeper import multirun_file_masked

    with _compose_mistakes_in_one_line(), multirun_file_masked(), _stderr_masked():
        hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")(_hydra_entry)()
    return 0


@contextmanager
def _stderr_masked() -> Iterator[None]:
    """What is written to stderr passes retrain.housekeeping.secrets.mask_text: Hydra prints a failed sweep job's
    overrides there as typed (`Error executing job with overrides: [...]`)."""
    from retrain.housekeeping.secrets import MaskedStream

    stream = sys.stderr
    sys.stderr = MaskedStream(stream)
    try:
        yield
    finally:
        sys.stderr = stream


def flags_before_overrides(args: list[str]) -> list[str]:
    """Hydra's flags (with their values) ahead of the overrides, each kept in its order. Hydra's argparse
    takes the overrides as one positional list, so `experiment=quickstart -m training.seed=1,2` would
    otherwise refuse `training.seed=1,2` with a usage text."""
    from hydra._internal.utils import get_args_parser  # hydra-core is pinned to 1.3.x (pyproject)

    options = get_args_parser()._option_string_actions
    flags: list[str] = []
    overrides: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        name, has_value = token.split("=", 1)[0], "=" in token
        action = options.get(name) if token.startswith("-") else None
        if action is None:
            overrides.append(token)
            continue
        flags.append(token)
        takes_next = action.nargs is None or (
            action.nargs == "?" and index < len(args) and args[index] in (action.choices or ())
        )
        if takes_next and not has_value and index < len(args):
            flags.append(args[index])
            index += 1
    return [*flags, *overrides]


def _raised_in_task(error: BaseException) -> bool:
    """Whether `error` came out of the run itself (`_hydra_entry`), not Hydra's setup around it."""
    return any(frame.f_code is _hydra_entry.__code__ for frame, _ in traceback.walk_tb(error.__traceback__))


def _output_dir_keys(error: BaseException) -> str:
    """The keys that set the directory Hydra was creating or writing when it failed, read from its
    `run_job` (the run's dir, or a sweep job's dir and subdir)."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "run_job" and frame.f_globals.get("__name__") == "hydra.core.utils":
            return " + ".join(
                str(key) for key in (frame.f_locals.get("job_dir_key"), frame.f_locals.get("job_subdir_key")) if key
            )
    return "hydra.run.dir or hydra.sweep.dir"


@contextmanager
def _compose_mistakes_in_one_line() -> Iterator[None]:
    """A mistake Hydra meets while composing (a key's typo, a wrong type, an option that does not
    exist, a run dir's interpolation that does not resolve) ends the command as retrain's own mistakes
    do: one line, exit 1. Hydra reports them in
    `run_and_report`, around everything `hydra.main` does; HYDRA_FULL_ERROR=1 keeps its traceback."""
    from hydra._internal import utils as hydra_internals  # hydra-core is pinned to 1.3.x (pyproject)

    hydras_report = hydra_internals.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        def composing() -> Any:
            try:
                return func()
            except COMPOSE_ERRORS as error:
                line = compose_error_line(error)
                if line is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                print(f"retrain: {line}", file=sys.stderr)
                raise SystemExit(1) from None
            except (OSError, ValueError) as error:
                # logging.config says "Unable to configure handler 'file'" for a run.log it cannot open (a
                # read-only file system): the OSError is its cause
                unwritable = error if isinstance(error, OSError) else error.__cause__
                if (
                    not isinstance(unwritable, OSError)
                    or _raised_in_task(error)
                    or os.environ.get("HYDRA_FULL_ERROR") == "1"
                ):
                    raise
                print(f"retrain: {output_dir_unwritable(_output_dir_keys(error), unwritable)}", file=sys.stderr)
                raise SystemExit(1) from None

        return hydras_report(composing)

    hydra_internals.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_internals.run_and_report = hydras_report
