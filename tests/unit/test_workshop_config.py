"""The workshop's hub config and the room's arithmetic: what each learner gets, and what the hub is told."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from traitlets.config import Config

from lab_utils.workshop import sizing
from lab_utils.workshop.config import WorkshopOptions, render, write

GiB, MiB = sizing.GiB, sizing.MiB


def test_the_room_size_sets_each_share_by_the_documented_arithmetic():
    s = sizing.share(10, ram=64 * GiB, cores=16)
    reserve = int(6.4 * GiB)  # 10% of RAM is more than 2 GiB
    assert s.mem_bytes == (64 * GiB - reserve) // 10
    assert (s.cpu, s.threads) == (1.6, 1)
    assert s.kv_bytes == min(sizing.MAX_KV, (s.mem_bytes - sizing.KERNEL_BASE) // 2)
    assert s.env() == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LAB_KV_CACHE_MEMORY_BYTES": str(s.kv_bytes)}
    alone = sizing.share(1, ram=64 * GiB, cores=16)
    assert (alone.threads, alone.kv_bytes) == (16, sizing.MAX_KV)
    assert sizing.share(4, ram=64 * GiB, cores=16).threads == 4


def test_a_room_too_big_for_the_box_is_refused_with_what_fits():
    with pytest.raises(ValueError, match=r"learners=40: .* this box holds at most 7"):
        sizing.share(40, ram=24 * GiB, cores=2)
    with pytest.raises(ValueError, match="at least 1"):
        sizing.share(0)


def _load(text: str) -> Config:
    c = Config()
    exec(compile(text, "jupyterhub_config.py", "exec"), {"get_config": lambda: c})  # noqa: S102 (as the hub does)
    return c


def _options(tmp_path: Path, **kw) -> WorkshopOptions:
    return WorkshopOptions(state=tmp_path / "state", homes=tmp_path / "homes", cache=tmp_path / "cache",
                           labs=Path("labs").resolve(), share=sizing.share(4, ram=32 * GiB, cores=8),
                           admins=["teach"], **kw)


def test_the_config_binds_loopback_approves_accounts_and_limits_each_learner(tmp_path):
    o = _options(tmp_path, unix_users=False)
    c = _load(render(o))
    hub = c.JupyterHub
    assert (hub.ip, hub.hub_ip) == ("127.0.0.1", "127.0.0.1")
    assert hub.authenticator_class == "lab_utils.workshop.native_auth.WorkshopNativeAuthenticator"
    assert c.NativeAuthenticator.open_signup is False and c.Authenticator.admin_users == {"teach"}
    assert hub.spawner_class == "simple" and c.SimpleLocalProcessSpawner.home_dir_template.endswith("homes/{username}")
    assert c.Spawner.cmd[1:] == ["-m", "lab_utils.workshop.singleuser"]
    env = c.Spawner.environment
    assert env["LAB_UTILS_CACHE"] == str(tmp_path / "cache") and env["OMP_NUM_THREADS"] == "2"
    assert int(env["LAB_KV_CACHE_MEMORY_BYTES"]) == o.share.kv_bytes and c.Spawner.mem_limit == o.share.mem_bytes
    services = {s["name"]: s for s in hub.services}
    assert services["idle-culler"]["command"][1:3] == ["-m", "jupyterhub_idle_culler"]
    assert services["board"]["command"][-2:] == ["--homes", str(tmp_path / "homes")]
    culler_role = next(r for r in hub.load_roles if r["name"] == "idle-culler")
    assert "delete:servers" in culler_role["scopes"]
    assert not any("board" in r.get("services", []) for r in hub.load_roles)  # the board gets no extra rights


def test_a_workshop_code_and_unix_users_when_asked(tmp_path):
    c = _load(render(_options(tmp_path, code="room-42-code", unix_users=True, ip="10.0.0.5")))
    assert (c.JupyterHub.ip, c.JupyterHub.authenticator_class) == ("10.0.0.5", "shared-password")
    shared = c.SharedPasswordAuthenticator
    assert shared.user_password == "room-42-code" and len(shared.admin_password) >= 32  # JupyterHub's minimum
    assert c.JupyterHub.spawner_class == "localprocess" and callable(c.Spawner.pre_spawn_hook)
    with pytest.raises(ValueError, match="at least 8"):
        _options(tmp_path, code="short")
    with pytest.raises(ValueError, match="admin 'Teach Er'"):
        WorkshopOptions(state=tmp_path, homes=tmp_path, cache=tmp_path, labs=tmp_path, share=o_share(),
                        admins=["Teach Er"])


def o_share() -> sizing.Share:
    return sizing.share(2, ram=16 * GiB, cores=4)


def test_write_keeps_the_config_private(tmp_path):
    path = write(_options(tmp_path, code="room-42-code"))
    assert path.stat().st_mode & 0o077 == 0 and (tmp_path / "homes").is_dir()


def test_workshop_command_writes_the_config_and_needs_an_instructor(tmp_path):
    base = [sys.executable, "-m", "lab_utils", "workshop", "--state", str(tmp_path / "s"), "--homes",
            str(tmp_path / "h"), "--learners", "1", "--write-only"]
    run = subprocess.run(base + ["--admin", "teach"], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "1 learners" in run.stdout and (tmp_path / "s" / "jupyterhub_config.py").exists()
    run = subprocess.run(base, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "--admin" in run.stderr


def test_the_learners_engine_takes_the_rooms_kv_budget(monkeypatch):
    from lab_utils.course.learner_parts import engine_config

    monkeypatch.delenv("LAB_KV_CACHE_MEMORY_BYTES", raising=False)
    assert engine_config("02").kv_cache_memory_bytes is None
    monkeypatch.setenv("LAB_KV_CACHE_MEMORY_BYTES", str(300 * MiB))
    assert engine_config("04").kv_cache_memory_bytes == 300 * MiB
    assert engine_config("04", kv_cache_memory_bytes=GiB).kv_cache_memory_bytes == GiB  # a lab's own size wins
    assert engine_config("04", num_gpu_blocks=16).kv_cache_memory_bytes is None
    monkeypatch.setenv("LAB_KV_CACHE_MEMORY_BYTES", "lots")
    with pytest.raises(ValueError, match="LAB_KV_CACHE_MEMORY_BYTES='lots'"):
        engine_config("01")


def test_the_workshop_code_logs_learners_in_and_only_the_instructors_password_makes_an_admin(tmp_path):
    import asyncio

    shared = pytest.importorskip("jupyterhub.authenticators.shared", reason="skipped: jupyterhub not installed")
    c = _load(render(_options(tmp_path, code="room-42-code", unix_users=False)))
    auth = shared.SharedPasswordAuthenticator(config=c)

    def login(name: str, password: str):
        return asyncio.run(auth.authenticate(None, {"username": name, "password": password}))

    assert login("ada", "room-42-code")["name"] == "ada"
    assert login("ada", "wrong-code-1") is None
    assert login("teach", "room-42-code") is None  # an instructor needs the instructors' password
    assert login("teach", c.SharedPasswordAuthenticator.admin_password)["admin"] is True
