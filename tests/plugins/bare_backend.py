"""A user backend that declares nothing at all (no hooks here or on its module)."""


class BareBackend:
    """Gets retrain's conservative defaults."""
