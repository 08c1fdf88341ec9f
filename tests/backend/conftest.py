from tests.backend.tiny_model import tiny_model_dir, tiny_spec  # noqa: F401  (fixtures)
