"""Where the LM head's logits are written in fp32 (retrain/model/output_logits.py); tests/test_gpu.py checks the
values on a GPU, whose fp32-output matmul the CPU's kernels do not have."""

from __future__ import annotations

from dataclasses import replace

import torch

from retrain.model.output_logits import use_fp32_logits
from tests.backend.tiny_model import make_backend


def test_on_the_cpu_the_head_keeps_its_own_forward_and_dtype(tiny_spec):
    for dtype, logits_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = make_backend(replace(tiny_spec, dtype=dtype)).model
        use_fp32_logits(model)
        head = model.get_base_model().lm_head
        assert "forward" not in vars(head)
        assert head(torch.zeros(1, head.in_features, dtype=head.weight.dtype)).dtype == logits_dtype
