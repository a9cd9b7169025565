"""Token efficiency (lab 15): what agent parallelism and routing between models buy, and what they cost.

- `fanout`: N sub-tasks that share a long instruction prefix, run one after another or fanned out at once through
  the engine (the prefix cache computes the shared prefix once, continuous batching decodes them together), with
  the prompt tokens the engine really computed.
- `routing`: a router that sends each request to a small model or the target from a signal known early (the small
  model's confidence in its own answer), and the cost/quality curve as its threshold moves.
- `tasks`: the routing tasks, each with options and a checkable answer.
"""
