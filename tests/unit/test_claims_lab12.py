"""Negative controls for lab 12's claims: a good run passes, each perturbed measurement fails its claim."""
from __future__ import annotations

import pytest

from lab_utils.checks import lab12


def good(**change) -> dict:
    r = dict(disconnect=dict(kv_during=0.004, running_during=1.0, kv_after=0.0, running_after=0.0, aborted=1.0,
                             freed_s=0.08, your_loop=True),
             expected_tokens=[16, 16, 16, 16], got_tokens=[16, 16, 16, 16], n_requests=4, server_ttft_count=4.0,
             server_ttft_mean_s=0.84, client_ttft_mean_s=0.86, kv_usage_after=0.0)
    r.update(change)
    return r


def test_a_good_run_passes(capsys):
    lab12.assert_claims(good())
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("change, message", [
    (dict(got_tokens=[16, 15, 16, 16]), "every request streamed every token"),     # a dropped SSE chunk
    *[(dict(disconnect={**good()["disconnect"], **d}), "a client that hung up") for d in (
        dict(aborted=0.0, running_after=1.0, kv_after=0.004),   # a loop that never aborts: decodes for nobody
        dict(kv_after=0.002),                                   # aborted, but blocks kept
        dict(your_loop=False),                                  # the server ran the reference loop
        dict(kv_during=0.0))],                                  # nothing was held: the measurement saw nothing
    (dict(got_tokens=[16, 16, 16]), "every request streamed every token"),         # a lost request
    (dict(server_ttft_count=5.0), "counted each of the 4"),                        # a warm-up counted in
    (dict(server_ttft_count=3.0), "counted each of the 4"),
    (dict(server_ttft_mean_s=0.95), "client's mean TTFT is at least the server's"),  # a server clock started late
    (dict(kv_usage_after=0.125), "no KV memory is held"),                          # blocks leaked by an abort
])
def test_each_claim_fails_on_a_wrong_measurement(change, message):
    with pytest.raises(AssertionError, match=message):
        lab12.assert_claims(good(**change), show=False)
