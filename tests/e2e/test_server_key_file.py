"""`serve --api-key-file`: one key per learner (a workshop's api_keys.txt), any listed key accepted, the file read
again as it changes; with the openai client, as learners call the room's shared server."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from _server_utils import KEY, MODEL, UvicornThread, tiny_engine

from lab_utils.server.app import create_app
from lab_utils.server.guard import KeyFile


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys = tmp_path_factory.mktemp("room") / "api_keys.txt"
    keys.write_text("lab-aaa alice\n# a comment line\nlab-bbb bob\n")
    app = create_app(tiny_engine(), MODEL, max_tokens_cap=8, api_key=KEY, api_key_file=str(keys))
    with UvicornThread(app) as srv:
        srv.keys = keys
        yield srv


def _client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def test_each_listed_key_and_the_main_key_are_accepted(keyed):
    for key in ("lab-aaa", "lab-bbb", KEY):
        r = _client(keyed, key).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
        assert r.usage.completion_tokens == 2
    for key in ("lab-ccc", "alice", "# a comment line", "lab-aa"):
        with pytest.raises(openai.AuthenticationError):
            _client(keyed, key).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)


def test_a_learner_added_while_serving_gets_in_and_a_removed_one_is_out(keyed):
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "lab-ccc").models.list()
    time.sleep(0.01)  # a new modification time
    keyed.keys.write_text("lab-bbb bob\nlab-ccc carol\n")
    assert [m.id for m in _client(keyed, "lab-ccc").models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, "lab-aaa").models.list()  # alice's line is gone
    assert httpx.get(keyed.url + "/health").status_code == 200  # outside /v1: no key needed


def test_key_file_reads_first_words_and_a_vanished_file_accepts_none(tmp_path):
    f = tmp_path / "k.txt"
    f.write_text("\n  k1 one\nk2\n#k3\n")
    kf = KeyFile(f)
    assert kf.keys() == ["k1", "k2"] and kf.matches(b"Bearer k2") and not kf.matches(b"Bearer k3")
    os.remove(f)
    assert kf.keys() == [] and not kf.matches(b"Bearer k1")
    with pytest.raises(ValueError, match="no such file"):
        KeyFile(tmp_path / "missing.txt")


def test_serve_refuses_a_missing_key_file_before_loading_a_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lab_utils", "serve", "--model", "tiny-random",
                        "--api-key-file", str(tmp_path / "none.txt")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such file" in r.stderr
