"""The original TOML format (docs/migrate-config.md): every section and key of the original retrain's
annotated config, the `[campaign]` section of campaign TOMLs, and the values its modes take. A key outside these tables is an unknown key.
"""

from __future__ import annotations

# [backend] keys from before [backend.options]: old name -> option name
LEGACY_PRIME_RL_KEYS: dict[str, str] = {
    "prime_rl_transport": "transport",
    "prime_rl_zmq_host": "zmq_host",
    "prime_rl_zmq_port": "zmq_port",
    "prime_rl_zmq_hwm": "zmq_hwm",
    "prime_rl_strict_advantages": "strict_advantages",
    "prime_rl_sync_wait_s": "sync_wait_s",
    "prime_rl_sync_poll_s": "sync_poll_s",
}

SECTIONS: dict[str, frozenset[str]] = {
    "backend": frozenset({"backend", "devices", "adapter_path", "options", *LEGACY_PRIME_RL_KEYS}),
    "model": frozenset({"model", "base_url", "lora_rank"}),
    "algorithm": frozenset(
        {
            "algorithm_mode",
            "advantage_mode",
            "transform_mode",
            "uncertainty_kind",
            "surprisal_mask_rho",
            "entropy_mask_rho",
            "params",
            "advantage_params",
            "transform_params",
        }
    ),
    "plugins": frozenset({"search_paths", "strict"}),
    "training": frozenset(
        {
            "seed",
            "max_steps",
            "batch_size",
            "group_size",
            "max_tokens",
            "temperature",
            "top_p",
            "lr",
            "weight_decay",
            "max_examples",
            "save_every",
        }
    ),
    "optimizer": frozenset({"beta1", "beta2", "eps"}),
    "lora": frozenset({"alpha", "dropout"}),
    "gtpo": frozenset({"beta"}),
    "hicra": frozenset({"alpha"}),
    "sepa": frozenset({"steps", "schedule", "delay_steps", "correct_rate_gate"}),
    "planning": frozenset({"detector", "model", "threshold"}),
    "inference": frozenset({"engine", "url", "attention_kernel", "dtype", "kv_cache_dtype", "prefix_caching"}),
    "data": frozenset({"source"}),
    "environment": frozenset({"provider", "id", "args", "max_turns", "auto_install"}),
    "reward": frozenset({"type", "judge_model", "custom_module", "custom_function"}),
    "backpressure": frozenset(
        {
            "enabled",
            "warmup_steps",
            "ema_decay",
            "throttle_margin",
            "increase_margin",
            "min_batch_size",
            "max_batch_size",
            "peak_gflops",
            "peak_bw_gb_s",
        }
    ),
    "squeeze": frozenset(
        {
            "min_variance_retention",
            "adapter_path",
            "source_rank",
            "target_ranks",
            "output_path",
            "compress_to",
            "device",
        }
    ),
    "resume": frozenset({"from"}),
    "logging": frozenset(
        {"log_dir", "wandb_project", "wandb_run_name", "wandb_entity", "wandb_group", "wandb_tags", "strategic_grams"}
    ),
    "campaign": frozenset({"seeds", "max_steps", "conditions", "parallel", "max_workers", "stagger_seconds"}),
}

# free-form tables: any key is the plugin's or the backend's own
FREE_TABLES = frozenset(
    {
        ("backend", "options"),
        ("algorithm", "params"),
        ("algorithm", "advantage_params"),
        ("algorithm", "transform_params"),
        ("environment", "args"),
    }
)

# what an original TOML config gets when it leaves the key out (where it decides what the preset must say)
DEFAULT_ADVANTAGE = "maxrl"
DEFAULT_TRANSFORM = "gtpo_sepa"
DEFAULT_SEEDS = (42, 101, 202, 303, 404, 505, 606, 707)
DEFAULT_CONDITIONS = (
    ("grpo", "none"),
    ("maxrl", "none"),
    ("maxrl", "gtpo"),
    ("maxrl", "gtpo_hicra"),
    ("maxrl", "gtpo_sepa"),
)

# the original reward types with an option of the same name; "custom" becomes reward._target_
REWARD_TYPES = ("match", "math", "judge")
# the original [data] sources with a data option of the same name
DATA_SOURCES = ("math", "gsm8k")


def unknown_keys(toml: dict[str, object]) -> list[str]:
    """Every key of `toml` outside the original TOML format, as `[section] key` (or `[section]`)."""
    unknown = []
    for section, table in toml.items():
        known = SECTIONS.get(section)
        if known is None or not isinstance(table, dict):
            unknown.append(f"[{section}]" if isinstance(table, dict) else section)
            continue
        unknown += [f"[{section}] {key}" for key in table if key not in known]
    return unknown
