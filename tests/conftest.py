"""Shared fixtures: models are loaded once per session (SmolLM2 takes ~1 s from the prepared folder)."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2():
    from lab_utils import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny64():
    """The 2-layer random model in float64: batching cannot flip a greedy argmax through rounding."""
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu", dtype=torch.float64)
