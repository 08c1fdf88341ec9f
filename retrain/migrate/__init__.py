"""From the seeds' TOML configs to Hydra presets (`retrain migrate-config`).

`seeds` lists the TOML format, `translate` maps it key by key onto retrain's config, `preset`
holds and writes the result. The table of what becomes what: docs/migrate-config.md.
"""
