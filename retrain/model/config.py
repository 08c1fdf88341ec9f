"""Schema of the `model` config group (conf/model/*.yaml start from `base_model`).

The model's schema is `ModelSpec` itself: the dataclass the option instantiates.
"""

from __future__ import annotations

from retrain.model.spec import ModelSpec

SCHEMAS: dict[str, type] = {"base_model": ModelSpec}
