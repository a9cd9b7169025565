"""Speculative decoding: proposers (draft model, n-gram lookup, Medusa heads, EAGLE head), the verifier, and
the engine hook that turns a decode step into a verify step. `make_proposer` builds the one a config asks for."""
from __future__ import annotations

import importlib

from lab_utils.speculative.base import Proposal, Proposer

__all__ = ["Proposal", "Proposer", "make_proposer"]

_HEADS = {"medusa": ("lab_utils.speculative.medusa", "MedusaProposer"), "eagle": ("lab_utils.speculative.eagle", "EagleProposer")}


def make_proposer(spec_config, target_model, device, parts=None, engine_config=None) -> Proposer:
    """The proposer for `spec_config.method` ("draft" | "ngram" | "medusa" | "eagle"). `parts`: the engine's
    (`EngineParts`); a quantized draft is built with its lab-05 quantizers. `engine_config`: the engine's (a draft
    model follows its CPU switches)."""
    method = spec_config.method
    if method == "ngram":
        from lab_utils.speculative.ngram import NgramProposer

        return NgramProposer(spec_config, target_model, device)
    if method == "draft":
        from lab_utils.speculative.draft import DraftModelProposer

        return DraftModelProposer(spec_config, target_model, device, parts=parts, engine_config=engine_config)
    if method in _HEADS:
        module, cls = _HEADS[method]
        return getattr(importlib.import_module(module), cls)(spec_config, target_model, device)
    raise ValueError(f"SpecConfig.method={method!r} is invalid: must be one of draft, ngram, medusa, eagle")
