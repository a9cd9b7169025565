"""LLM Serving Lab: the shared package behind the notebooks in `labs/`.

Public API (stable, see DESIGN.md section 4):

    from lab_utils import load_model, LLMEngine, EngineConfig, SamplingParams, SpecConfig

Names are resolved lazily so that `import lab_utils` stays cheap and never needs a GPU.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_model": "lab_utils.models.loader",
    "LLMEngine": "lab_utils.engine.engine",
    "EngineConfig": "lab_utils.engine.config",
    "SamplingParams": "lab_utils.engine.sampling_params",
    "SpecConfig": "lab_utils.engine.config",
    "resolve_device": "lab_utils.device",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lab_utils' has no attribute {name!r}")
