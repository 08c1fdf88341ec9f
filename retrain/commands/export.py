"""`retrain export RUN_DIR [--adapter OUT] [--merged OUT]`: a run's result in the formats other tools load.

    retrain export outputs/runs/.../12-00-00_maxrl_gtpo_sepa                     # -> <run>/export/adapter
    retrain export outputs/runs/.../12-00-00_maxrl_gtpo_sepa --merged merged/    # base + adapter, one model

The adapter (PEFT format: adapter_model.safetensors, adapter_config.json naming the base model it
trained on) or the base model with the adapter merged into its weights (transformers format, what
vLLM and any `from_pretrained` load without peft), the tokenizer and its chat template with either.
The run's final checkpoint is exported; a run that has not finished gives its latest intact one, and
RUN_DIR may also name one checkpoint (`<run>/checkpoints/step_20`). Merging is done in float32 and
the merged weights are saved in the base model's own dtype unless `--dtype` says otherwise. Each
output is written into a temp dir beside it and renamed into place, so it is whole or absent; the two
outputs must not overlap. A run still writing may prune a checkpoint as it is read (`training.keep_checkpoints`):
the newer one that replaced it is exported instead, or the command says the run is rotating them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from retrain.errors import UserError
from retrain.housekeeping.file_modes import follow_umask
from retrain.housekeeping.rundir import STATE_FILE, Checkpoint, RunDir

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
DEFAULT_ADAPTER_DIR = Path("export") / "adapter"  # inside the run dir
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class ExportError(UserError):
    """What makes a run dir or an output path unfit to export from or into."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retrain export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run dir, or one checkpoint dir of a run")
    parser.add_argument(
        "--adapter",
        type=Path,
        metavar="OUT",
        help=f"write the adapter here (default without --merged: RUN_DIR/{DEFAULT_ADAPTER_DIR})",
    )
    parser.add_argument("--merged", type=Path, metavar="OUT", help="write the base model with the adapter merged here")
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="dtype of the merged weights (auto: the base model's own)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        checkpoint, run = exported_checkpoint(args.run_dir)
        spec = run_model(run)
        if not checkpoint.is_final:
            print(f"retrain export: {run.path} has no final/ checkpoint yet: exporting {checkpoint.path}")
        adapter_out = args.adapter or (None if args.merged else run.path / DEFAULT_ADAPTER_DIR)
        outputs = [out for out in (adapter_out, args.merged) if out is not None]
        check_apart(outputs)
        for out in outputs:
            check_free(out)
        with _rotation_reported(checkpoint):
            if adapter_out is not None:
                write_adapter(checkpoint.path, spec, adapter_out)
                print(f"adapter (PEFT) of {spec.name_or_path} written to {adapter_out}")
            if args.merged is not None:
                write_merged(checkpoint.path, spec, args.merged, args.dtype)
                print(f"merged model (transformers) written to {args.merged}")
    except UserError as error:
        print(f"retrain export: {error}", file=sys.stderr)
        return 1
    return 0


def exported_checkpoint(path: Path) -> tuple[Checkpoint, RunDir]:
    """The checkpoint to export and its run: the one `path` names, else the run's newest that reads whole."""
    path = path.expanduser().resolve()
    if (path / STATE_FILE).is_file():
        checkpoint = Checkpoint(path)
        run = RunDir.of_checkpoint(path)
        damage = checkpoint.damage(ADAPTER_FILES)
        if damage is not None:
            raise ExportError(f"checkpoint {path} is damaged: {damage}")
        return checkpoint, run
    run = RunDir(path)
    if not run.has_run():
        raise ExportError(f"{path} is not a run dir (no status.json, job.json or .hydra/)")
    found = run.resumable_checkpoint(set_aside=False, required=ADAPTER_FILES)
    if found is None:
        raise ExportError(
            f"{path} holds no checkpoint yet (one is written every training.save_every steps and at the end)"
        )
    return found, run


def run_model(run: RunDir) -> Any:
    """The run's ModelSpec, from the config it recorded (.hydra/config.yaml)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    if not run.hydra_config.is_file():
        raise ExportError(f"{run.path} has no {run.hydra_config.relative_to(run.path)}: its base model is unknown")
    return instantiate(OmegaConf.load(run.hydra_config).model)


def check_free(out: Path) -> None:
    """An output must not overwrite anything: a path that exists must be an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; remove it or choose another")


def check_apart(outputs: list[Path]) -> None:
    """The adapter and the merged model go to two directories, neither inside the other: the second written
    would find the first where it renames its own into place."""
    if len(outputs) < 2:
        return
    adapter, merged = (out.expanduser().resolve() for out in outputs)
    if adapter == merged or adapter.is_relative_to(merged) or merged.is_relative_to(adapter):
        raise ExportError(
            f"--adapter {outputs[0]} and --merged {outputs[1]} overlap; give each its own directory, neither inside "
            "the other"
        )


def write_adapter(checkpoint: Path, spec: Any, out: Path) -> None:
    """The checkpoint's adapter files, its config naming where the base model loads from, and the tokenizer."""
    source, _ = spec.source()
    with _written_into(out) as staging:
        for name in ADAPTER_FILES:
            shutil.copyfile(checkpoint / name, staging / name)
        config_file = staging / "adapter_config.json"
        config = json.loads(config_file.read_text())
        # a bundled model (retrain:<name>) is named by its directory, which peft and vLLM can open
        config.update(base_model_name_or_path=source, revision=spec.revision)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        spec.load_tokenizer().save_pretrained(str(staging))


def write_merged(checkpoint: Path, spec: Any, out: Path, dtype: str = "auto") -> None:
    """The base model with W + s·B·A in every adapted layer (computed in float32), saved as a plain model."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    source, _ = spec.source()
    saved = AutoConfig.from_pretrained(source, revision=spec.revision)
    target = getattr(torch, DTYPES[dtype]) if dtype != "auto" else _config_dtype(saved)
    with _quiet_loading():
        base = AutoModelForCausalLM.from_pretrained(source, revision=spec.revision, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, str(checkpoint)).merge_and_unload()
        merged.to(target)
        with _written_into(out) as staging:
            merged.save_pretrained(str(staging))
            spec.load_tokenizer().save_pretrained(str(staging))


@contextmanager
def _rotation_reported(checkpoint: Checkpoint) -> Iterator[None]:
    """A checkpoint a live run prunes while it is copied (`training.keep_checkpoints`) is said to be, not a traceback."""
    try:
        yield
    except Exception as error:  # a file gone mid-copy: OSError from shutil, other errors from peft's loader
        if isinstance(error, UserError) or checkpoint.path.exists():
            raise
        raise ExportError(
            f"{checkpoint.path} was removed while it was exported: a run is writing this dir and rotating its "
            "checkpoints (training.keep_checkpoints); export again, or once it has stopped"
        ) from error


@contextmanager
def _quiet_loading() -> Iterator[None]:
    """No per-shard progress bars or deprecation chatter between the command's own lines."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def _config_dtype(config: Any) -> Any:
    """The dtype a model's config.json declares (float32 when it declares none)."""
    import torch

    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


@contextmanager
def _written_into(out: Path) -> Iterator[Path]:
    """A temp dir beside `out`, renamed to `out` when the block succeeds and removed when it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        follow_umask(staging)  # mkdtemp's dir and safetensors' files are private: the output is as readable as any
        try:
            if out.is_dir():  # an empty directory (check_free)
                out.rmdir()
            staging.rename(out)
        except OSError as error:  # something wrote `out` meanwhile
            raise ExportError(
                f"{out} could not be put in place ({error.strerror}); nothing was written there"
            ) from error
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
