"""200 concurrent streams with faults: ~20 % of clients leave mid-stream, ~5 % of requests are malformed.
Every well-formed stream gets its tokens, every malformed request a 4xx, and no KV block is left held."""
from __future__ import annotations

import httpx
from _server_utils import KEY, MODEL, H, UvicornThread, tiny_engine, wait_idle

from lab_utils.server.app import create_app
from lab_utils.server.fault_load import run_fault_load


def test_200_streams_with_disconnects_and_malformed_requests():
    engine = tiny_engine(max_num_seqs=64, max_num_batched_tokens=512)
    app = create_app(engine, MODEL, max_tokens_cap=64, api_key=KEY)
    with UvicornThread(app) as srv:
        before = engine.stats()
        res = run_fault_load(srv.url, MODEL, n=200, max_tokens=8, headers=H, timeout_s=240)
        print(f"fault load: {res}")
        assert res["problems"] == [], "\n".join(res["problems"][:10])
        assert (res["num_full"], res["num_left"], res["num_malformed"]) == (150, 40, 10)
        assert res["ttft_p50_ms"] is not None and res["ttft_p99_ms"] >= res["ttft_p50_ms"]
        wait_idle(engine)
        engine.block_manager.check_all_free()
        after = engine.stats()
        ended = (after["num_finished"] - before["num_finished"]) + (after["num_aborted"] - before["num_aborted"])
        assert ended == 190, f"{190 - ended} of the 190 well-formed requests never ended"
        assert httpx.get(srv.url + "/health").status_code == 200
        assert app.state.async_engine.num_step_failures == 0
