"""LoRA-Squeeze: how much of a LoRA adapter's update lives in its top singular directions (docs/squeeze.md).

Train at a generous rank, then ask the adapter which rank it actually needed: for every module the
update ΔW ∝ B·A is factored exactly (QR of Aᵀ and of B, SVD of the small r×r core), so the analysis
costs O(r²·(in+out)) per module and never forms the out×in matrix. Compression keeps the top-k
singular triplets and writes an ordinary PEFT adapter that `PeftModel.from_pretrained` loads.

    retrain squeeze <adapter or run dir> [--min-variance-retention 0.95] [--compress-to K --output DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from retrain.errors import UserError
from retrain.housekeeping.file_modes import follow_umask
from retrain.housekeeping.rundir import RunDir, checksum_mismatch, read_text_file
from retrain.model.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS

SQUEEZE_REPORT = "squeeze.json"
# PEFT names the two factors of a linear layer lora_A/lora_B and of an embedding lora_embedding_A/B.
FACTOR_SUFFIXES = ((".lora_A.weight", ".lora_B.weight"), (".lora_embedding_A", ".lora_embedding_B"))


class SqueezeError(UserError, ValueError):
    """An adapter that cannot be analysed or compressed, or a setting that cannot work, with the reason."""


@dataclass
class SqueezeSettings:
    """The `squeeze:` block of a campaign (and the CLI's options)."""

    min_variance_retention: float = 0.95  # recommended rank keeps at least this share of ΔW's energy
    target_ranks: list[int] = field(default_factory=list)  # [] = powers of two below the rank + the rank
    compress_to: int = 0  # campaigns: also write a compressed adapter at this rank (0 = recommended)
    output_dir: str = ""  # campaigns: where the compressed adapter goes ("" = do not compress)

    def __post_init__(self) -> None:
        share = self.min_variance_retention
        if not (_is_number(share) and 0.0 < share <= 1.0):
            raise SqueezeError(f"squeeze.min_variance_retention={share!r}: must be a number in (0, 1]")
        ranks = self.target_ranks
        if not isinstance(ranks, list) or not all(_is_integer(k) and k >= 1 for k in ranks):
            raise SqueezeError(f"squeeze.target_ranks={ranks!r}: must be a list of ranks >= 1 ([] = the default ranks)")
        if not (_is_integer(self.compress_to) and self.compress_to >= 0):
            raise SqueezeError(
                f"squeeze.compress_to={self.compress_to!r}: must be an integer >= 0 (0 = recommended rank)"
            )
        if not isinstance(self.output_dir, str):
            raise SqueezeError(f'squeeze.output_dir={self.output_dir!r}: must be a path ("" = do not compress)')

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> SqueezeSettings:
        """Build from a config mapping; an unknown key is named in the error."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise SqueezeError(f"squeeze: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**values)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class ModuleFactors:
    """One LoRA module's factors in PEFT orientation: A is r×in, B is out×r."""

    name: str
    a_key: str
    b_key: str
    A: torch.Tensor
    B: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass
class ModuleSpectrum:
    """The exact SVD of one module's B·A, from its thin factors."""

    name: str
    singular_values: torch.Tensor  # [r], descending
    left: torch.Tensor  # [out, r] orthonormal columns
    right: torch.Tensor  # [r, in] orthonormal rows

    def retention(self, k: int) -> float:
        """V(k): share of Σ s² carried by the top-k singular values (1.0 when ΔW is zero)."""
        energy = self.singular_values.double().square()
        total = float(energy.sum())
        return 1.0 if total == 0.0 else float(energy[:k].sum()) / total


@dataclass
class SqueezeReport:
    """Per target rank, the retention of every module and their mean; plus the recommendation."""

    adapter_dir: str
    source_rank: int
    min_variance_retention: float
    target_ranks: list[int]
    mean_retention: dict[int, float]
    min_retention: dict[int, float]
    recommended_rank: int
    num_modules: int
    module_retention: dict[str, dict[int, float]] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("mean_retention", "min_retention"):
            data[key] = {str(k): v for k, v in data[key].items()}
        data["module_retention"] = {m: {str(k): v for k, v in r.items()} for m, r in self.module_retention.items()}
        return data

    def table(self) -> str:
        """A Markdown table (it reads well in a terminal too)."""
        lines = ["| rank | mean variance retained | worst module |", "|---:|---:|---:|"]
        for k in self.target_ranks:
            mark = "  ← recommended" if k == self.recommended_rank else ""
            lines.append(f"| {k} | {self.mean_retention[k]:.4f} | {self.min_retention[k]:.4f} |{mark}")
        return "\n".join(lines)

    def recommendation(self) -> str:
        return (
            f"Recommended rank {self.recommended_rank} (of {self.source_rank}): the smallest rank whose mean "
            f"variance retained over {self.num_modules} modules is >= {self.min_variance_retention:g}."
        )


def resolve_adapter_dir(path: Path) -> Path:
    """An adapter dir, or a run dir whose final/ (else latest checkpoint) holds the adapter."""
    run_dir = RunDir(path)
    for candidate in (path, run_dir.final_dir, *run_dir.step_dirs()):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise SqueezeError(f"{path}: no PEFT adapter here ({ADAPTER_CONFIG} not found in it, in final/ or in checkpoints/)")


def read_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapter's config and tensors, each checked to read (and against checksums.json, when there is one)."""
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise SqueezeError(f"{adapter_dir}: {ADAPTER_WEIGHTS} is missing")
    if mismatch := checksum_mismatch(adapter_dir):
        raise SqueezeError(f"{adapter_dir}: {mismatch}")
    try:
        config = json.loads(read_text_file(config_path))
    except (OSError, ValueError) as error:  # ValueError: JSON or UTF-8 that does not decode
        raise SqueezeError(f"{config_path}: does not read as JSON ({type(error).__name__}: {error})") from None
    if not isinstance(config, dict):
        raise SqueezeError(f"{config_path}: holds a {type(config).__name__}, not PEFT's adapter config (an object)")
    if config.get("peft_type", "LORA") != "LORA":
        raise SqueezeError(f"{config_path}: peft_type={config.get('peft_type')!r}; only LORA adapters can be squeezed")
    if config.get("use_dora"):
        raise SqueezeError(f"{config_path}: use_dora=true; DoRA's magnitude vectors are not low-rank factors")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise SqueezeError(f"{config_path}: {key} is set; per-module ranks or alphas are not supported")
    if "lora_alpha" in config and not _is_number(config["lora_alpha"]):
        raise SqueezeError(f"{config_path}: lora_alpha={config['lora_alpha']!r} is not a number")
    try:
        return config, load_file(str(weights_path))
    except (SafetensorError, OSError) as error:  # a truncated or garbled file
        raise SqueezeError(f"{weights_path}: does not read ({type(error).__name__}: {error})") from None


def adapter_rank(adapter_dir: Path, config: dict[str, Any], modules: list[ModuleFactors]) -> int:
    """The adapter's rank `r`, checked against its factors (a config that says otherwise describes other tensors)."""
    rank = config.get("r", modules[0].rank)
    if not _is_integer(rank) or rank < 1:
        raise SqueezeError(f"{adapter_dir / ADAPTER_CONFIG}: r={rank!r} must be an integer >= 1")
    if other := sorted({m.rank for m in modules if m.rank != rank}):
        raise SqueezeError(
            f"{adapter_dir / ADAPTER_CONFIG}: r={rank}, but the factors in {ADAPTER_WEIGHTS} have rank "
            f"{', '.join(map(str, other))}"
        )
    return int(rank)


def lora_modules(weights: dict[str, torch.Tensor]) -> list[ModuleFactors]:
    """Pair every module's A and B factors (each module's name is the key before the suffix)."""
    modules = []
    for a_suffix, b_suffix in FACTOR_SUFFIXES:
        for a_key in sorted(k for k in weights if k.endswith(a_suffix)):
            name = a_key[: -len(a_suffix)]
            b_key = name + b_suffix
            if b_key not in weights:
                raise SqueezeError(f"{a_key} has no matching {b_key}")
            A, B = weights[a_key], weights[b_key]
            if A.dim() != 2 or B.dim() != 2 or B.shape[1] != A.shape[0]:
                raise SqueezeError(
                    f"{name}: factors of shape {tuple(A.shape)} and {tuple(B.shape)} are not "
                    "a 2-D LoRA pair (r×in and out×r)"
                )
            for key, factor in ((a_key, A), (b_key, B)):
                if not torch.isfinite(factor).all():
                    raise SqueezeError(f"{key} holds NaN or infinite values: the adapter's training diverged")
            modules.append(ModuleFactors(name, a_key, b_key, A, B))
    if not modules:
        raise SqueezeError("no LoRA factors (…lora_A.weight / …lora_B.weight) in the adapter")
    return modules


def spectrum(module: ModuleFactors) -> ModuleSpectrum:
    """SVD of B·A through QR: B·A = Q_B (R_B R_Aᵀ) Q_Aᵀ, and the r×r core is cheap to decompose."""
    A, B = module.A.double(), module.B.double()
    q_a, r_a = torch.linalg.qr(A.T)  # Aᵀ = Q_A R_A: [in, r], [r, r]
    q_b, r_b = torch.linalg.qr(B)  # B = Q_B R_B: [out, r], [r, r]
    u, s, vh = torch.linalg.svd(r_b @ r_a.T)
    return ModuleSpectrum(module.name, s, left=q_b @ u, right=vh @ q_a.T)


def default_target_ranks(source_rank: int) -> list[int]:
    ranks = [1 << i for i in range(source_rank.bit_length()) if (1 << i) < source_rank]
    return [*ranks, source_rank]


def analyse(
    adapter_dir: Path, min_variance_retention: float = 0.95, target_ranks: list[int] | None = None
) -> SqueezeReport:
    """Variance retained at each target rank, and the smallest rank that keeps enough."""
    SqueezeSettings(min_variance_retention=min_variance_retention, target_ranks=list(target_ranks or []))
    config, weights = read_adapter(adapter_dir)
    modules = lora_modules(weights)
    source_rank = adapter_rank(adapter_dir, config, modules)
    ranks = sorted({int(k) for k in target_ranks}) if target_ranks else default_target_ranks(source_rank)
    too_big = [k for k in ranks if k > source_rank]
    if too_big:
        raise SqueezeError(f"target ranks {too_big} exceed the adapter's rank {source_rank}")
    spectra = [spectrum(m) for m in modules]
    per_module = {s.name: {k: s.retention(k) for k in ranks} for s in spectra}
    mean = {k: sum(r[k] for r in per_module.values()) / len(per_module) for k in ranks}
    worst = {k: min(r[k] for r in per_module.values()) for k in ranks}
    # a float tolerance, so that a rank holding all the energy is never rejected for rounding
    enough = [k for k in ranks if mean[k] >= min_variance_retention - 1e-12]
    return SqueezeReport(
        adapter_dir=str(adapter_dir),
        source_rank=source_rank,
        min_variance_retention=min_variance_retention,
        target_ranks=ranks,
        mean_retention=mean,
        min_retention=worst,
        recommended_rank=enough[0] if enough else source_rank,
        num_modules=len(spectra),
        module_retention=per_module,
    )


def compress(adapter_dir: Path, rank: int, output_dir: Path, overwrite: bool = False) -> Path:
    """Write a rank-`rank` PEFT adapter that keeps the top singular triplets of every module.

    √s goes to each factor, and lora_alpha is rescaled so the LoRA scaling factor is unchanged:
    at the source rank the new adapter reproduces ΔW exactly (up to floating point). An adapter
    already in `output_dir` is replaced only with `overwrite`.
    """
    config, weights = read_adapter(adapter_dir)
    modules = lora_modules(weights)
    source_rank = adapter_rank(adapter_dir, config, modules)
    if not 1 <= rank <= source_rank:
        raise SqueezeError(f"--compress-to {rank}: must be between 1 and the adapter's rank {source_rank}")
    if output_dir.resolve() == adapter_dir.resolve():
        raise SqueezeError(f"--output {output_dir}: must differ from the source adapter dir")
    if not overwrite and any((output_dir / name).exists() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)):
        raise SqueezeError(f"--output {output_dir}: holds an adapter already (--force replaces it)")
    compressed = dict(weights)
    for module in modules:
        spec = spectrum(module)
        root = spec.singular_values[:rank].sqrt()
        new_b = spec.left[:, :rank] * root  # [out, k]
        new_a = root[:, None] * spec.right[:rank]  # [k, in]
        compressed[module.b_key] = new_b.to(module.B.dtype).contiguous()
        compressed[module.a_key] = new_a.to(module.A.dtype).contiguous()
    alpha = float(config.get("lora_alpha", source_rank))
    # scaling is alpha/r (or alpha/√r with rsLoRA): keep it fixed when r changes
    factor = math.sqrt(rank / source_rank) if config.get("use_rslora") else rank / source_rank
    new_config = {**config, "r": rank, "lora_alpha": alpha * factor}
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(compressed, str(output_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    follow_umask(output_dir / ADAPTER_WEIGHTS)
    (output_dir / ADAPTER_CONFIG).write_text(json.dumps(new_config, indent=2, sort_keys=True) + "\n")
    return output_dir


def run_squeeze(adapter: Path, settings: SqueezeSettings, overwrite: bool = False) -> tuple[SqueezeReport, Path | None]:
    """Analyse, and compress when settings name an output dir (the shared path of CLI and campaigns)."""
    adapter_dir = resolve_adapter_dir(adapter)
    report = analyse(adapter_dir, settings.min_variance_retention, settings.target_ranks or None)
    written = None
    if settings.output_dir:
        rank = settings.compress_to or report.recommended_rank
        written = compress(adapter_dir, rank, Path(settings.output_dir), overwrite)
        payload = {**report.to_json(), "compressed_rank": rank}
        (written / SQUEEZE_REPORT).write_text(json.dumps(payload, indent=2) + "\n")
    return report, written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="retrain squeeze",
        description="LoRA-Squeeze: variance retained per rank, the recommended rank, optional compression.",
    )
    parser.add_argument("adapter", type=Path, help="PEFT adapter dir, or a run dir (its final/ adapter is used)")
    parser.add_argument(
        "--min-variance-retention",
        type=_share,
        default=0.95,
        metavar="F",
        help="recommend the smallest rank whose mean retention is >= F (default 0.95)",
    )
    parser.add_argument(
        "--target-ranks",
        type=_rank_list,
        default=[],
        metavar="K,K,...",
        help="ranks to evaluate (default: powers of two below the rank, and the rank)",
    )
    parser.add_argument(
        "--compress-to",
        type=int,
        default=0,
        metavar="K",
        help="write a rank-K adapter to --output (default with --output: the recommended rank)",
    )
    parser.add_argument("--output", type=Path, default=None, metavar="DIR", help="where the compressed adapter goes")
    parser.add_argument("--force", action="store_true", help="replace an adapter already in --output")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0.0 < share <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
    return share


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compress_to and args.output is None:
        parser.error("--compress-to needs --output DIR")
    try:
        settings = SqueezeSettings(
            min_variance_retention=args.min_variance_retention,
            target_ranks=args.target_ranks,
            compress_to=args.compress_to,
            output_dir=str(args.output or ""),
        )
        report, written = run_squeeze(args.adapter, settings, overwrite=args.force)
    except (SqueezeError, OSError) as error:
        print(f"retrain squeeze: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**report.to_json(), "output": str(written) if written else None}, indent=2))
        return 0
    print(f"LoRA-Squeeze of {report.adapter_dir} (rank {report.source_rank}, {report.num_modules} modules)\n")
    print(report.table())
    print()
    print(report.recommendation())
    if written is not None:
        print(f"Wrote the rank-{settings.compress_to or report.recommended_rank} adapter to {written}")
    return 0
