"""Structured output: a request's output is valid JSON for a schema, matches a regex, is one of a list of
strings, or follows a grammar, by construction (lab 13).

- `params.py`: what a request asks for (`StructuredOutputParams`, vLLM's `structured_outputs` fields);
- `schema.py`: which JSON-schema keywords are enforced, and the refusals for the rest;
- `hook.py`: the engine's step hook: grammar compilation, one matcher per request, bitmasks per step;
- `tasks.py`: lab 13's workload, small "reply in JSON" tasks and the validity check.
"""
