"""set_training: the same modes as nn.Module.train, and overrides of `train` still run."""

from __future__ import annotations

import torch

from retrain.model.train_mode import set_training
from tests.backend.tiny_model import make_backend


def test_every_module_takes_the_mode_as_with_train(tiny_spec):
    model = make_backend(tiny_spec).model
    for training in (False, True, False):
        set_training(model, training)
        assert {module.training for module in model.modules()} == {training}


def test_dropout_follows_the_mode():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    x = torch.ones(4, 8)
    set_training(model, False)
    assert torch.equal(model(x), model(x))
    set_training(model, True)
    assert not torch.equal(model(x), model(x))


class Counting(torch.nn.Module):
    """A module whose `train` does more than set the flag."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []
        self.inner = torch.nn.Linear(2, 2)

    def train(self, mode: bool = True) -> Counting:
        self.calls.append(mode)
        return super().train(mode)


def test_a_module_that_overrides_train_gets_its_train_called():
    counting = Counting()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), counting)
    set_training(model, False)
    set_training(model, True)
    assert counting.calls == [False, True] and counting.inner.training
