"""Token efficiency (lab 15): what agent parallelism, routing between models and shorter contexts buy, and what
they cost.

- `fanout`: N sub-tasks that share a long instruction prefix, run one after another or fanned out at once through
  the engine (the prefix cache computes the shared prefix once, continuous batching decodes them together), with
  the prompt tokens the engine really computed.
- `routing`: a router that sends each request to a small model or the target from a signal known early (the small
  model's confidence in its own answer), and the cost/quality curve as its threshold moves.
- `tasks`: the routing tasks, each with options and a checkable answer.
- `contexts`: a conversation's turn sent as its full history, its last turns, lab 11's session state, or the
  history compressed by dropping the words the target finds least surprising; prompt tokens, time to first token
  and the answers that survive.
"""
