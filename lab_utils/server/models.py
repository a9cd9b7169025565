"""The models one server process serves, by name, each over its own engine.

A request's `model` field picks the engine, as OpenAI's API does (and vLLM's for the names it serves): a client
routes between a small and a large model by naming one, and `/v1/models` lists what it may name. Each model has
its own `Frontend` (engine, loop thread, failure isolation, schema compiler, metrics): a request that fails or
kills one engine leaves the others serving. The first model is the default one (`app.state.frontend`).
"""
from __future__ import annotations

from lab_utils.server.errors import APIError
from lab_utils.server.frontend import Frontend


class ServedModels:
    def __init__(self, frontends: list[Frontend]) -> None:
        names = [fe.model_name for fe in frontends]
        if not frontends or len(set(names)) != len(names):
            raise ValueError(f"served model names must be one or more and distinct, got {names}")
        self.by_name = {fe.model_name: fe for fe in frontends}

    @property
    def default(self) -> Frontend:
        return next(iter(self.by_name.values()))

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def __iter__(self):
        return iter(self.by_name.values())

    def pick(self, name: str) -> Frontend:
        """The model a request names; an unknown name is OpenAI's 404 `model_not_found`."""
        fe = self.by_name.get(name)
        if fe is None:
            served = ", ".join(repr(n) for n in self.by_name)
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return fe

    def listing(self) -> dict:
        """`/v1/models`: OpenAI's model list, with each model's context length (vLLM's `max_model_len`)."""
        return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "owned_by": "lab_utils",
                                            "max_model_len": fe.engine.max_model_len} for fe in self]}

    def dead(self) -> dict[str, BaseException]:
        """The models whose engine failed for good (their requests get 503 until a restart)."""
        return {fe.model_name: fe.aengine.error for fe in self if fe.aengine.error is not None}
