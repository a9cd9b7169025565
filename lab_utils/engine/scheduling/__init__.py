"""The scheduling policies: who runs in this step, and how many of their tokens.

Every policy returns a `SchedulerOutput`: a list of (request, number of tokens to compute). A prefill chunk is
"n prompt tokens", a decode is "1 token", so one forward pass can mix them. One module per policy, each a
function of the `Scheduler` (`self`), which binds it as a method and gives it the shared admission and
preemption code (`lab_utils/engine/scheduler.py`):

- `static.py`:          static batching, the baseline (a batch runs until all of it has finished);
- `continuous.py`:      continuous batching (Orca), prefill-first as in nano-vllm (lab 01);
- `chunked_prefill.py`: chunked prefill and vLLM V1's token budget: running requests first, then new prompts,
                        in one mixed batch (lab 03).
"""
