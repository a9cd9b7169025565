"""The engine's optional features, built from its config as step hooks (`hooks.py`): the one place that names
them. The step itself only calls the hooks.

- speculative decoding (lab 07, `config.speculative`): plans guesses for decodes, verifies them;
- structured output (lab 13, per request `SamplingParams.structured_output`): masks logits by a grammar.

The order is the order the step calls them: guesses are planned before the grammar's masks start filling, so
the grammar sees (and cuts) them.
"""
from __future__ import annotations

from lab_utils.engine.hooks import Hooks

# stats every engine reports, None while the feature is off (tools read them without checking the config)
STATS_WHEN_OFF = {"spec_acceptance_rate": None}


def build_hooks(engine) -> Hooks:
    """Set `engine.spec` (None without speculation) and `engine.structured`, and return them as the step's hooks."""
    from lab_utils.structured.hook import StructuredOutputs

    hooks = Hooks()
    engine.spec = None
    if engine.config.speculative is not None:
        from lab_utils.speculative.hook import SpecDecoder

        # the runner's model (its packed lm head on a CPU); lab 07's parts; the draft follows the CPU switches
        engine.spec = SpecDecoder(engine.config.speculative, engine.runner.model, engine.device,
                                  engine.block_manager, engine.max_model_len, engine.kv_cache,
                                  parts=engine.parts, engine_config=engine.config)
        hooks.append(engine.spec)
    # grammar masks for the requests that ask for them (xgrammar loads on first use)
    engine.structured = StructuredOutputs(engine.tokenizer, engine.model.config.vocab_size, engine.eos_ids)
    hooks.append(engine.structured)
    return hooks
