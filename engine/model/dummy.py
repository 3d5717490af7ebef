"""`dummy:<name>` models: a real architecture (engine/dummy_models.py) with random
weights made directly on the device, for performance runs where no checkpoint can
be downloaded.

Weights are drawn from N(0, 0.02) (norm weights around 1), in the engine's dtype,
by a generator on the device seeded with the engine's seed, so two runs with the
same seed (and device) serve the same model. Nothing is read from disk and no
host copy of the weights is ever made: an 8B model fills an H100 in seconds.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.dummy_models import DUMMY_PREFIX, dummy_model
from engine.model.arch import ModelArch, parameter_shapes
from engine.outputs import LoadReport

# Standard deviation of the random weights (transformers' usual initializer range).
WEIGHT_STD = 0.02


def dummy_weights(
    model: str, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[Any, dict[str, torch.Tensor], LoadReport]:
    """The transformers config of `model` ("dummy:<name>"), its parameters (our names,
    random, on `device` in `dtype`) and how long making them took."""
    from transformers import AutoConfig

    spec = dummy_model(model)
    if spec is None:
        raise ValueError(f"{model!r} is not a {DUMMY_PREFIX}<name> model")
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    start = time.perf_counter()
    state = random_state_dict(ModelArch.from_hf_config(config), dtype, device, seed)
    report = LoadReport("dummy", "", 0, len(state), sum(t.nbytes for t in state.values()),
                        time.perf_counter() - start)
    return config, state, report


def random_state_dict(
    arch: ModelArch, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every parameter of `arch`, random, made on `device` in `dtype`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in parameter_shapes(arch).items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.normal_(1.0, WEIGHT_STD, generator=generator)
        else:
            tensor.normal_(0.0, WEIGHT_STD, generator=generator)
        state[name] = tensor
    return state
