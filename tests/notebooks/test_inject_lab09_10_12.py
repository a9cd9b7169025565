"""A wrong learner part injected into labs 09, 10 and 12 stops the lab at the exercise's check, with the check's
named mistake: an AssertionError raised by the check cell, before the lab starts rank processes, P/D workers or
the server with the learner's part in them."""
from __future__ import annotations

import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

LABS = REPO_ROOT / "labs"

# lab 09: KV heads and intermediate units split evenly (3 KV heads over 2 ranks: one head lost)
EVEN_SPLIT = """
n_kv, n_i = w["k_proj"].shape[0] // head_dim, w["gate_proj"].shape[0]
kv0, kv1 = rank * (n_kv // world_size), (rank + 1) * (n_kv // world_size)
i0, i1 = rank * (n_i // world_size), (rank + 1) * (n_i // world_size)
q0, q1 = kv0 * heads_per_kv * head_dim, kv1 * heads_per_kv * head_dim
k0, k1 = kv0 * head_dim, kv1 * head_dim
return {"q_proj": w["q_proj"][q0:q1], "k_proj": w["k_proj"][k0:k1], "v_proj": w["v_proj"][k0:k1],
        "o_proj": w["o_proj"][:, q0:q1], "gate_proj": w["gate_proj"][i0:i1], "up_proj": w["up_proj"][i0:i1],
        "down_proj": w["down_proj"][:, i0:i1]}
"""

# lab 10: the prompt's KV taken from the start of the cache, as if its blocks were the first ones
CONTIGUOUS_EXPORT = """
return {name: t[:, :num_tokens].cpu() for name, t in cache.items()}
"""

# lab 12: a streaming loop that never aborts (a client that leaves keeps its request decoding, and its blocks)
NO_ABORT = """
async for out in outputs:
    yield f"data: {json.dumps(to_chunk(out))}\\n\\n"
yield "data: [DONE]\\n\\n"
"""


@pytest.mark.parametrize("lab, marker, body, message, check", [
    ("09_gpu_scaling", "def shard_weights(", EVEN_SPLIT, "first ranks take one more", "lab09.check_shard_weights("),
    ("10_pd_disaggregation", "def export_kv(", CONTIGUOUS_EXPORT, "blocks are scattered", "lab10.check_export_kv("),
    ("12_capstone_server", "async def stream_sse(", NO_ABORT, "still running in the engine",
     "lab12.check_stream_sse("),
])
def test_wrong_part_fails_at_its_check(lab, marker, body, message, check, tmp_path):
    assert_fails_at_check(LABS / f"{lab}.ipynb", marker, body, message, check, tmp_path)
