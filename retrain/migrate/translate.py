"""Translate a parsed TOML of the original format (training or campaign config) into a `Preset`, key by key.

The table of what becomes what is docs/migrate-config.md; this module is its executable form. Every
key the TOML holds is read exactly once and either set, turned into a group choice, or dropped
with a reason; a key outside the original TOML format, or a value retrain has no equivalent for where it
matters (an unknown transform mode, reward type, engine), is a ConfigError naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from retrain.errors import ConfigError
from retrain.migrate.preset import Preset
from retrain.migrate.seeds import (
    DATA_SOURCES,
    DEFAULT_ADVANTAGE,
    DEFAULT_CONDITIONS,
    DEFAULT_SEEDS,
    DEFAULT_TRANSFORM,
    LEGACY_PRIME_RL_KEYS,
    REWARD_TYPES,
    unknown_keys,
)

_UNSET = object()
# backends that sample themselves: the original [inference] section does not apply to them
_SELF_SAMPLING = ("tinker", "prime_rl")
_SERVER_ENGINES = {"vllm": "vllm_server", "sglang": "sglang", "max": "openai", "mlx": "openai", "openai": "openai"}


def translate(toml: dict[str, Any], source: str) -> Preset:
    """The preset an original-format TOML becomes (a campaign preset when it has a `[campaign]` section)."""
    unknown = unknown_keys(toml)
    if unknown:
        raise ConfigError(
            f"unknown keys, not part of the original TOML format: {', '.join(unknown)} "
            "(docs/migrate-config.md lists every key)"
        )
    return _Translation(toml, source).run()


def _dotted(name: str) -> bool:
    return "." in name


class _Translation:
    def __init__(self, toml: dict[str, Any], source: str) -> None:
        self.toml = toml
        self.campaign = "campaign" in toml
        self.preset = Preset(source=source, package="campaign" if self.campaign else "experiment")
        self.read: set[tuple[str, str]] = set()
        self.backend = "local"
        self.backend_fields: set[str] | None = None  # the chosen backend's option names, None when unknown
        self.open_base = ""  # the condition an untyped algorithm node starts from (an algorithm plugin's params)

    def run(self) -> Preset:
        steps = (
            self._campaign,
            self._backend,
            self._model,
            self._algorithm,
            self._planning,
            self._inference,
            self._reward,
            self._data,
            self._training,
            self._section_to("backpressure", "backpressure"),
            self._squeeze,
            self._section_to("resume", "resume"),
            self._logging,
            self._plugins,
        )
        for step in steps:
            step()
        if self.open_base:
            self._open_algorithm_node()
        unread = [
            f"[{section}] {key}"
            for section, table in self.toml.items()
            for key in table
            if (section, key) not in self.read
        ]
        if unread:  # a key of the original format this module forgot: a bug, never a silent loss
            raise RuntimeError(f"migrate-config read no rule for {', '.join(unread)}")
        return self.preset

    # -- reading the TOML -------------------------------------------------------------------------

    def has(self, section: str, key: str) -> bool:
        return key in self.toml.get(section, {})

    def get(self, section: str, key: str, default: Any = _UNSET) -> Any:
        """The value (marking it read), or `default` when the TOML leaves it out."""
        table = self.toml.get(section, {})
        if key not in table:
            if default is _UNSET:
                raise KeyError(key)
            return default
        self.read.add((section, key))
        return table[key]

    def text(self, section: str, key: str, default: str) -> str:
        value = self.get(section, key, default)
        if not isinstance(value, str):
            raise ConfigError(f"[{section}] {key} = {value!r}: expected a string")
        return value

    def table(self, section: str, key: str) -> dict[str, Any]:
        value = self.get(section, key, {})
        if not isinstance(value, dict):
            raise ConfigError(f"[{section}] {key} = {value!r}: expected a table ([{section}.{key}])")
        return value

    def map(self, section: str, key: str, dotted: str, convert: Any = None) -> None:
        """Carry `[section] key` to `dotted` when the TOML has it."""
        if self.has(section, key):
            value = self.get(section, key)
            self.preset.set(dotted, convert(value) if convert else value)

    def drop(self, section: str, key: str, reason: str) -> None:
        if self.has(section, key):
            self.preset.drop(f"[{section}] {key}", self.get(section, key), reason)

    def _section_to(self, section: str, target: str) -> Any:
        def step() -> None:
            for key in list(self.toml.get(section, {})):
                self.map(section, key, f"{target}.{key}")

        return step

    # -- sections -----------------------------------------------------------------------------------

    def _campaign(self) -> None:
        if not self.campaign:
            return
        seeds = self.get("campaign", "seeds", list(DEFAULT_SEEDS))
        if not isinstance(seeds, list) or not seeds or not all(type(seed) is int for seed in seeds):
            raise ConfigError(f"[campaign] seeds = {seeds!r}: expected a non-empty list of integers")
        names = [self._condition(index, raw) for index, raw in enumerate(self._conditions())]
        self.preset.set(
            "hydra.sweeper.params", {"algorithm": ",".join(names), "training.seed": ",".join(map(str, seeds))}
        )
        # as the original retrain's campaigns named wandb runs, and as +campaign=ablation does
        self.preset.set("logging.wandb_group", "${algorithm.name}")
        self.preset.set("logging.wandb_run_name", "${algorithm.name}_s${training.seed}")
        self.preset.set("logging.wandb_tags", ["${algorithm.name}", "seed${training.seed}"])
        self.map("campaign", "max_steps", "training.max_steps")
        if self.get("campaign", "parallel", False):
            self.preset.choose("hydra/launcher", "local")
            self.drop(
                "campaign",
                "max_workers",
                "hydra/launcher=local starts every run at once; to cap how many run "
                "together use hydra/launcher=slurm with hydra.launcher.array_parallelism",
            )
        else:
            self.drop("campaign", "parallel", "the default: Hydra's basic launcher trains the runs one after another")
            self.drop("campaign", "max_workers", "used only with parallel = true")
        self.drop("campaign", "stagger_seconds", "not available: a launcher starts its runs together")

    def _conditions(self) -> list[Any]:
        raw = self.get("campaign", "conditions", [])
        if not isinstance(raw, list):
            raise ConfigError(f"[campaign] conditions = {raw!r}: expected [[campaign.conditions]] tables")
        return raw or [{"advantage_mode": a, "transform_mode": t} for a, t in DEFAULT_CONDITIONS]

    def _condition(self, index: int, raw: Any) -> str:
        where = f"[[campaign.conditions]] #{index + 1}"
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a table with advantage_mode and transform_mode")
        extra = sorted(set(raw) - {"advantage_mode", "transform_mode"})
        if extra:
            raise ConfigError(
                f"{where}: per-condition overrides ({', '.join(extra)}) cannot be migrated: a Hydra sweep varies "
                "the condition and the seed; migrate one campaign per override value"
            )
        name = f"{raw.get('advantage_mode', '')}_{raw.get('transform_mode', '')}"
        if name not in _conditions().presets():
            raise ConfigError(
                f"{where}: {raw.get('advantage_mode')!r} + {raw.get('transform_mode')!r} is not a built-in condition "
                f"(advantages: {', '.join(_conditions().advantages)}; transform modes: {', '.join(_transform_modes())}); "
                "plugin modes cannot be swept by name"
            )
        return name

    def _backend(self) -> None:
        name = self.text("backend", "backend", "local")
        if _dotted(name):
            self.preset.set("backend._target_", name)
        elif name in _options("backend"):
            if self.has("backend", "backend"):
                self.preset.choose("backend", name)
            self.backend = name
            self.backend_fields = _schema_fields("backend", name)
        else:
            raise ConfigError(
                f"[backend] backend = {name!r}: not a backend (choices: {', '.join(_options('backend'))}, or a dotted path)"
            )
        if self.takes("devices"):
            self.map("backend", "devices", "backend.devices")
        else:
            self.drop("backend", "devices", f"backend={name} runs remotely and takes no devices")
        if name == "prime_rl":
            self.map("backend", "adapter_path", "backend.output_dir")
        else:
            self.drop(
                "backend",
                "adapter_path",
                "checkpoints and the final adapter go to the run dir "
                "(<run dir>/checkpoints/step_N, <run dir>/final), set by [logging] log_dir",
            )
        options = self.table("backend", "options")
        for old, new in LEGACY_PRIME_RL_KEYS.items():
            if not self.has("backend", old):
                continue
            if new in options:
                self.drop("backend", old, f"[backend.options] {new} is set too, and wins")
            else:
                self._option(f"[backend] {old}", new, self.get("backend", old))
        for key, value in options.items():
            self._option(f"[backend.options] {key}", key, value)

    def takes(self, option: str) -> bool:
        """Whether the chosen backend has `option` (assumed when its schema is not known here)."""
        return self.backend_fields is None or option in self.backend_fields

    def _option(self, where: str, key: str, value: Any) -> None:
        if self.takes(key):
            self.preset.set(f"backend.{key}", value)
        else:
            self.preset.drop(
                where,
                value,
                f"not an option of backend={self.backend} "
                f"(its options: {', '.join(sorted(self.backend_fields or ()))})",
            )

    def _model(self) -> None:
        self.map("model", "model", "model.name_or_path")
        self.map("model", "lora_rank", "model.lora_rank")
        self.map("lora", "alpha", "model.lora_alpha")
        self.map("lora", "dropout", "model.lora_dropout")
        if self.backend == "tinker" and self.takes("base_url"):
            self.map("model", "base_url", "backend.base_url")
        elif self.text("model", "base_url", "") == "":
            self.drop("model", "base_url", "empty (the Tinker service URL, tinker backend only)")
        else:
            self.drop("model", "base_url", f"the Tinker service URL; backend={self.backend} does not use it")

    def _algorithm(self) -> None:
        conditions = _conditions()
        algorithm_mode = self.text("algorithm", "algorithm_mode", "")
        advantage = self.text("algorithm", "advantage_mode", DEFAULT_ADVANTAGE)
        transform = self.text("algorithm", "transform_mode", DEFAULT_TRANSFORM)
        if self.campaign:
            for key in ("algorithm_mode", "advantage_mode", "transform_mode"):
                self.drop("algorithm", key, "each run's condition comes from [campaign] conditions")
            self._unused_params(("params", "advantage_params", "transform_params"), "campaign conditions are built-in")
        elif algorithm_mode and not _dotted(algorithm_mode):
            if algorithm_mode not in conditions.presets():
                raise ConfigError(
                    f"[algorithm] algorithm_mode = {algorithm_mode!r}: not a built-in algorithm "
                    f"(<advantage>_<transform mode>, e.g. maxrl_gtpo_sepa) nor a dotted path"
                )
            self.preset.choose("algorithm", algorithm_mode)
            for key in ("advantage_mode", "transform_mode"):
                self.drop("algorithm", key, "replaced by algorithm_mode")
            self._unused_params(("params", "advantage_params", "transform_params"), "algorithm_mode is built-in")
        else:
            self._composed(advantage, transform, algorithm_mode)
        self.map("algorithm", "uncertainty_kind", "algorithm.uncertainty")
        rho = {
            key: self.get("algorithm", key)
            for key in ("surprisal_mask_rho", "entropy_mask_rho")
            if self.has("algorithm", key)
        }
        if len(set(rho.values())) > 1:
            raise ConfigError(f"[algorithm] surprisal_mask_rho and its alias entropy_mask_rho disagree: {rho}")
        if rho:
            self.preset.set("algorithm.surprisal_mask_rho", next(iter(rho.values())))
        self.map("gtpo", "beta", "algorithm.gtpo.beta")
        self.map("hicra", "alpha", "algorithm.hicra.alpha")
        for key in ("steps", "schedule", "delay_steps", "correct_rate_gate"):
            self.map("sepa", key, f"algorithm.sepa.{key}")

    def _composed(self, advantage: str, transform: str, algorithm_mode: str) -> None:
        """advantage_mode + transform_mode (built-in names or dotted plugin paths), and an algorithm_mode plugin."""
        conditions = _conditions()
        if not _dotted(advantage) and advantage not in conditions.advantages:
            raise ConfigError(
                f"[algorithm] advantage_mode = {advantage!r}: not an advantage "
                f"({', '.join(conditions.advantages)}) nor a dotted path"
            )
        if not _dotted(transform) and transform not in _transform_modes():
            raise ConfigError(
                f"[algorithm] transform_mode = {transform!r}: not a transform mode "
                f"({', '.join(_transform_modes())}) nor a dotted path"
            )
        base = f"{'grpo' if _dotted(advantage) else advantage}_{'none' if _dotted(transform) else transform}"
        self.preset.choose("algorithm", base)
        if _dotted(advantage):
            self.preset.set("algorithm.advantage._target_", advantage)
            for key, value in self.table("algorithm", "advantage_params").items():
                self.preset.set(f"algorithm.advantage.{key}", value)
        else:
            self._unused_params(("advantage_params",), "advantage_mode is built-in")
        if _dotted(transform):
            name = transform.rsplit(".", 1)[-1]
            self.preset.set(f"algorithm.transforms.{name}._target_", transform)
            for key, value in self.table("algorithm", "transform_params").items():
                if key == "uncertainty_kind":
                    self.preset.drop(
                        "[algorithm.transform_params] uncertainty_kind",
                        value,
                        "not available per transform: algorithm.uncertainty applies to every transform",
                    )
                else:
                    self.preset.set(f"algorithm.transforms.{name}.{key}", value)
        else:
            self._unused_params(("transform_params",), "transform_mode is built-in")
        if _dotted(algorithm_mode):
            self.preset.set("algorithm._target_", algorithm_mode)
            params = self.table("algorithm", "params")
            if params:  # AlgorithmConfig takes no extra keys: the preset then writes the whole node, untyped
                self.open_base = base
                self.preset.choices["algorithm"] = None
            for key, value in params.items():
                self.preset.set(f"algorithm.{key}", value)
        else:
            self._unused_params(("params",), "read only by an algorithm_mode plugin, and algorithm_mode is not set")

    def _unused_params(self, keys: tuple[str, ...], reason: str) -> None:
        for key in keys:
            for name, value in self.table("algorithm", key).items():
                self.preset.drop(f"[algorithm.{key}] {name}", value, f"plugin parameter; {reason}")

    def _open_algorithm_node(self) -> None:
        """Replace the typed algorithm option by its full composed node, which takes a plugin's extra keys."""
        from omegaconf import OmegaConf

        from retrain.config import compose

        base = OmegaConf.to_container(compose([f"algorithm={self.open_base}"]).algorithm, resolve=False)
        self.preset.values["algorithm"] = OmegaConf.to_container(
            OmegaConf.merge(base, self.preset.values["algorithm"]), resolve=False
        )

    def _planning(self) -> None:
        self.map("planning", "detector", "algorithm.planning.detector")
        if self.text("planning", "detector", "regex") == "semantic":
            self.map("planning", "model", "algorithm.planning.model")
        else:
            self.drop("planning", "model", "semantic detector only; the regex detector is chosen")
        self.drop(
            "planning",
            "threshold",
            "another scale: algorithm.planning.threshold is a cosine similarity to the nearest gram (default 0.6)",
        )
        grams = self.get("logging", "strategic_grams", "")
        if grams in ("", []):
            self.read.discard(("logging", "strategic_grams"))
            self.drop("logging", "strategic_grams", "empty: the 18 default planning grams")
        else:
            self.preset.set("algorithm.planning.grams", _grams(grams))

    def _inference(self) -> None:
        engine = self.text("inference", "engine", "pytorch")
        url = self.text("inference", "url", "")
        keys = ("engine", "url", "attention_kernel", "dtype", "kv_cache_dtype", "prefix_caching")
        if self.backend == "tinker":
            for key in keys:
                self.drop("inference", key, "backend=tinker samples on the Tinker service: inference= is unused")
            return
        if self.backend == "prime_rl":
            if self.takes("inference_url"):
                self.map("inference", "url", "backend.inference_url")
            for key in keys:
                if key == "url" and self.takes("inference_url"):
                    continue
                self.drop(
                    "inference", key, "backend=prime_rl samples on the PRIME-RL inference server, configured there"
                )
            return
        if engine == "pytorch":
            option = "pytorch"
        elif engine == "vllm" and not url:
            option = "vllm"  # in-process vLLM: no server to point at
        elif engine in _SERVER_ENGINES:
            option = _SERVER_ENGINES[engine]
        else:
            raise ConfigError(
                f"[inference] engine = {engine!r}: not an engine (pytorch, vllm, sglang, max, mlx, openai)"
            )
        if self.has("inference", "engine"):
            self.preset.choose("inference", option)
        if option in ("pytorch", "vllm"):
            self.drop("inference", "url", f"inference={option} samples in this process, not on a server")
        else:
            self.map("inference", "url", "inference.url")
        server = option not in ("pytorch", "vllm")
        for key in ("attention_kernel", "kv_cache_dtype"):
            if option == "vllm" or (option == "pytorch" and key == "attention_kernel"):
                self.map("inference", key, f"inference.{key}")
            elif server:
                self.drop("inference", key, f"a flag of the {engine} server itself, set where it starts")
            else:
                self.drop(
                    "inference", key, "inference=pytorch has no such setting (a plain KV cache in the model's dtype)"
                )
        if option == "vllm":
            self.map("inference", "dtype", "inference.dtype")
        elif server:
            self.drop("inference", "dtype", f"a flag of the {engine} server itself, set where it starts")
        elif self.text("inference", "dtype", "auto") in ("auto", "bf16"):
            self.map("inference", "dtype", "model.dtype")  # the pytorch engine samples with the training model
        else:
            self.drop(
                "inference",
                "dtype",
                "not available with inference=pytorch, which samples with the training "
                "model in model.dtype (auto, bf16, fp16, fp32); use inference=vllm for fp8",
            )
        if server:
            self.drop("inference", "prefix_caching", f"a setting of the {engine} server itself")
        else:
            self.map("inference", "prefix_caching", "inference.prefix_caching")

    def _reward(self) -> None:
        kind = self.text("reward", "type", "match")
        if kind in REWARD_TYPES:
            if self.has("reward", "type"):
                self.preset.choose("reward", kind)
            for key in ("custom_module", "custom_function"):
                self.drop("reward", key, 'used only by type = "custom"')
        elif kind == "custom":
            module = self.text("reward", "custom_module", "")
            function = self.text("reward", "custom_function", "score")
            if not module:
                raise ConfigError('[reward] type = "custom" needs custom_module (the reward\'s Python module)')
            self.preset.choose("reward", "match")
            self.preset.set("reward._target_", f"{module}.{function}")
        else:
            raise ConfigError(f"[reward] type = {kind!r}: not a reward type (match, math, judge, custom)")
        if kind == "judge" and self.text("reward", "judge_model", ""):
            self.map("reward", "judge_model", "reward.model")
        elif kind == "judge":
            self.drop("reward", "judge_model", "empty: reward.model keeps its default")
        else:
            self.drop("reward", "judge_model", 'used only by type = "judge"')

    def _data(self) -> None:
        provider = self.text("environment", "provider", "")
        environment_keys = ("id", "args", "max_turns", "auto_install")
        if provider == "verifiers":
            self.preset.choose("data", "verifiers")
            for key in environment_keys:
                self.map("environment", key, f"data.{key}")
            self.drop("data", "source", "ignored when [environment] is set (as in the original retrain)")
        elif provider == "":
            for key in ("provider", *environment_keys):
                self.drop("environment", key, "[environment] provider is empty: no environment is used")
            source = self.text("data", "source", "math")
            if source not in DATA_SOURCES:
                raise ConfigError(f"[data] source = {source!r}: not a data source ({', '.join(DATA_SOURCES)})")
            if self.has("data", "source"):
                self.preset.choose("data", source)
        else:
            raise ConfigError(f'[environment] provider = {provider!r}: not a provider ("" or "verifiers")')
        self.map("training", "max_examples", "data.max_examples")

    def _training(self) -> None:
        for key in (
            "seed",
            "max_steps",
            "batch_size",
            "group_size",
            "max_tokens",
            "temperature",
            "top_p",
            "lr",
            "weight_decay",
            "save_every",
        ):
            if self.campaign and key == "seed":
                self.drop("training", key, "swept: each run's seed comes from [campaign] seeds")
            elif self.campaign and key == "max_steps" and self.has("campaign", "max_steps"):
                self.drop("training", key, "replaced by [campaign] max_steps")
            else:
                self.map("training", key, f"training.{key}")
        if self.has("optimizer", "beta1") or self.has("optimizer", "beta2"):
            self.preset.set(
                "training.betas", [self.get("optimizer", "beta1", 0.9), self.get("optimizer", "beta2", 0.95)]
            )
        self.map("optimizer", "eps", "training.eps")

    def _squeeze(self) -> None:
        for key, target in (
            ("min_variance_retention", "min_variance_retention"),
            ("target_ranks", "target_ranks"),
            ("output_path", "output_dir"),
            ("compress_to", "compress_to"),
        ):
            self.map("squeeze", key, f"squeeze.{target}")
        self.drop(
            "squeeze",
            "adapter_path",
            "a campaign analyses its first finished run's adapter; for any other "
            "adapter run `retrain squeeze <adapter dir>`",
        )
        self.drop("squeeze", "source_rank", "read from the adapter itself")
        self.drop("squeeze", "device", "the SVD runs on the CPU")
        if "squeeze" in self.preset.values and not self.campaign:
            self.preset.notes.append(
                "squeeze.* acts in a --multirun (auto-squeeze of the first finished run); "
                "for this run's adapter run `retrain squeeze <run dir>/final`"
            )

    def _logging(self) -> None:
        if self.campaign:
            self.drop(
                "logging",
                "log_dir",
                "a campaign's runs go to <hydra.sweep.dir>/<condition>_s<seed> "
                "(outputs/sweeps/<date>/<time> unless hydra.sweep.dir is set)",
            )
            for key in ("wandb_group", "wandb_run_name", "wandb_tags"):
                self.drop(
                    "logging",
                    key,
                    "a campaign names wandb runs after its grid (group = condition, run name = <condition>_s<seed>)",
                )
        else:
            self.map("logging", "log_dir", "hydra.run.dir")
            for key in ("wandb_group", "wandb_run_name"):
                self.map("logging", key, f"logging.{key}")
            self.map("logging", "wandb_tags", "logging.wandb_tags", _tags)
        for key in ("wandb_project", "wandb_entity"):
            self.map("logging", key, f"logging.{key}")

    def _plugins(self) -> None:
        self.drop(
            "plugins",
            "search_paths",
            "not available: a _target_ is a plain dotted import from where retrain "
            "starts; write plugins' full module paths",
        )
        self.drop("plugins", "strict", "always on: a plugin that fails to load or has the wrong shape stops the run")


def _grams(value: Any) -> list[str]:
    """The original strategic_grams (a list, a JSON array or a comma-separated string) as a list."""
    if isinstance(value, list):
        return [str(gram) for gram in value]
    if not isinstance(value, str):
        raise ConfigError(f"[logging] strategic_grams = {value!r}: expected a JSON array or comma-separated string")
    if value.strip().startswith("["):
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(f"[logging] strategic_grams = {value!r}: not a JSON array ({error})") from None
        return [str(gram) for gram in loaded]
    return [gram.strip() for gram in value.split(",") if gram.strip()]


def _tags(value: Any) -> list[str]:
    """The original comma-separated wandb_tags as a list."""
    if isinstance(value, list):
        return [str(tag) for tag in value]
    if not isinstance(value, str):
        raise ConfigError(f"[logging] wandb_tags = {value!r}: expected a comma-separated string")
    return [tag.strip() for tag in value.split(",") if tag.strip()]


def _conditions() -> Any:
    from retrain.config import algorithm_conditions

    return algorithm_conditions()


def _transform_modes() -> list[str]:
    from retrain.algorithm.config import SEED_TRANSFORMS, mode_name

    return [mode_name(transforms) for transforms in SEED_TRANSFORMS]


def _options(group: str) -> list[str]:
    """The YAML options of a config group of retrain's own conf/."""
    from retrain.config import config_dir

    return sorted(path.stem for path in (Path(config_dir()) / group).glob("*.yaml"))


def _schema_fields(group: str, option: str) -> set[str] | None:
    """The keys of an option's schema (`base_<option>`), None when no schema of that name is registered."""
    import importlib

    from retrain.config import GROUP_SCHEMA_MODULES

    schemas = importlib.import_module(GROUP_SCHEMA_MODULES[group]).SCHEMAS
    schema = schemas.get(f"base_{option}")
    if schema is None:
        return None
    return {f.name for f in dataclasses.fields(schema) if not f.name.startswith("_")}
