"""The OpenAPI schema the server publishes (/openapi.json) says exactly what it accepts and answers.

FastAPI's schema from the request models (schemas.py), plus what only the running app knows: the JSON answers'
shapes (RESPONSES: usage with cached prompt tokens, the model that served), the error object for every status
each route can answer (HTTP_ERRORS), the token-id bounds of this model's vocabulary (prompt ids
and logit_bias keys), and the content types of the answers that are not JSON (SSE streams, /metrics' text).
schemathesis checks the server against it (tests/e2e/test_server_fuzz.py).
"""
from __future__ import annotations

from lab_utils.server.guard import document_errors

HEAD_ERRORS = [408, 431]  # the request's head too slow or too large (http_limits.py): any path, before the app
GENERATION_ERRORS = [400, 401, 404, 413, 500, 503, *HEAD_ERRORS]
HTTP_ERRORS = {"/v1/completions": GENERATION_ERRORS, "/v1/chat/completions": GENERATION_ERRORS,
               "/v1/models": [401, 413, *HEAD_ERRORS], "/health": [413, 500, *HEAD_ERRORS],
               "/metrics": [413, *HEAD_ERRORS]}
NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
COUNT = {"type": "integer", "minimum": 0}
# the JSON answers: the fields a client reads (usage, the model that served it), as OpenAI's objects
RESPONSES = {
    "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens",
                                             "prompt_tokens_details"],
              "properties": {"prompt_tokens": COUNT, "completion_tokens": COUNT, "total_tokens": COUNT,
                             "prompt_tokens_details": {
                                 "type": "object", "required": ["cached_tokens"],
                                 "properties": {"cached_tokens": {
                                     **COUNT, "description": "prompt tokens the prefix cache served (whole KV "
                                                             "blocks), not computed again"}}}}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"},
                                  "created": {"type": "integer"},
                                  "model": {"type": "string", "description": "the model that served it"},
                                  "choices": {"type": "array", "items": {
                                      "type": "object", "required": ["index", "text", "finish_reason"],
                                      "properties": {"index": COUNT, "text": {"type": "string"},
                                                     "finish_reason": NULLABLE_STRING}}},
                                  "usage": {"$ref": "#/components/schemas/Usage"}}},
    "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion"},
                                      "created": {"type": "integer"},
                                      "model": {"type": "string", "description": "the model that served it"},
                                      "choices": {"type": "array", "items": {
                                          "type": "object", "required": ["index", "message", "finish_reason"],
                                          "properties": {"index": COUNT, "finish_reason": NULLABLE_STRING,
                                                         "message": {"type": "object", "required": ["role", "content"],
                                                                     "properties": {"role": {"const": "assistant"},
                                                                                    "content": NULLABLE_STRING}}}}},
                                      "usage": {"$ref": "#/components/schemas/Usage"}}},
    "ModelList": {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "items": {
                      "type": "object", "required": ["id", "object", "owned_by"],
                      "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                     "owned_by": {"type": "string"}, "max_model_len": COUNT}}}}},
}
ANSWERS = {("/v1/completions", "post"): "Completion", ("/v1/chat/completions", "post"): "ChatCompletion",
           ("/v1/models", "get"): "ModelList"}
# each event's data: a chunk (JSON) or, last, the text [DONE]
SSE = {"text/event-stream": {"schema": {"description": "server-sent events: chunks, then `data: [DONE]`"}}}


def below(n: int) -> str:
    """A regex matching the decimal numbers 0 .. n-1 (leading zeros allowed), for n >= 1."""
    top = str(n - 1)
    alts = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []  # fewer digits than n - 1
    for i, digit in enumerate(top):  # as many digits: the same prefix, then a smaller digit, then any
        if digit != "0":
            alts.append(f"{top[:i]}[0-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    alts.append(top)
    return "^0*(" + "|".join(alts) + ")$"


def publish(spec: dict, vocab_size: int) -> dict:
    """FastAPI's `spec` completed with what this app answers and this model accepts."""
    spec = document_errors(spec, HTTP_ERRORS)
    schemas = spec["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest"):
        bias = schemas[name]["properties"]["logit_bias"]["anyOf"][0]
        bias["propertyNames"] = {"pattern": below(vocab_size)}
    for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:  # [ids] and [[ids], ...]
        items = branch.get("items", {})
        ids = items.get("items", {}) if items.get("type") == "array" else items
        if ids.get("type") == "integer":
            ids.update(minimum=0, maximum=vocab_size - 1)
    schemas.update(RESPONSES)
    paths = spec["paths"]
    for (path, method), name in ANSWERS.items():
        paths[path][method]["responses"]["200"]["content"]["application/json"]["schema"] = {
            "$ref": f"#/components/schemas/{name}"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        paths[path]["post"]["responses"]["200"]["content"].update(SSE)
        paths[path]["post"]["responses"]["200"]["description"] = "the answer (JSON), or with stream: true its chunks"
    paths["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return spec
