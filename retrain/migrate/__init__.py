"""From TOML configs of the original retrain to Hydra presets (`retrain migrate-config`).

`seeds` lists that TOML format (the original TOML format, docs/migrate-config.md), `translate` maps it key by key onto retrain's config, `preset`
holds and writes the result. The table of what becomes what: docs/migrate-config.md.
"""
