"""A GPU box shared by the room, as the written hub config sets it: each learner's device (round-robin), their GPU
KV budget by the documented arithmetic, and the shared lab server with each learner's API key. No GPU needed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from lab_utils.workshop import gpu, sizing
from lab_utils.workshop.api_keys import KEY_FILE_FLAG, LearnerKeys
from lab_utils.workshop.config import WorkshopOptions, render

GiB, MiB = gpu.GiB, gpu.MiB


def _load(text: str) -> Config:
    c = Config()
    exec(compile(text, "jupyterhub_config.py", "exec"), {"get_config": lambda: c})  # noqa: S102 (as the hub does)
    return c


def _options(tmp_path: Path, **kw) -> WorkshopOptions:
    return WorkshopOptions(state=tmp_path / "state", homes=tmp_path / "homes", cache=tmp_path / "cache",
                           labs=Path("labs").resolve(), share=sizing.share(4, ram=32 * GiB, cores=8),
                           admins=["teach"], unix_users=False, **kw)


def _spawner(uid: int, name: str) -> SimpleNamespace:
    return SimpleNamespace(user=SimpleNamespace(id=uid, name=name))


def test_the_gpu_share_follows_the_documented_arithmetic():
    room = gpu.GpuRoom(("0",), 141 * GiB, 10)  # one H200, ten learners
    assert room.per_device == 10
    assert room.share_bytes == int(0.9 * 141 * GiB) // 10
    assert room.kv_bytes == min(gpu.MAX_GPU_KV, (room.share_bytes - gpu.GPU_BASE) // 2) == 4 * GiB
    mig = gpu.GpuRoom(tuple(f"MIG-{i}" for i in range(7)), 18 * GiB, 14, server=True)  # 7 x 1g.18gb slices
    assert (mig.seats, mig.per_device) == (15, 3)
    assert mig.kv_bytes == (int(0.9 * 18 * GiB) // 3 - gpu.GPU_BASE) // 2
    assert mig.server_kv_bytes == int(0.9 * 18 * GiB) // 3 - gpu.GPU_BASE


def test_learners_are_given_devices_round_robin_after_the_servers_seat():
    room = gpu.GpuRoom(("0", "1", "MIG-a1b2"), 80 * GiB, 9)
    assert [room.device_for(k) for k in range(1, 7)] == ["0", "1", "MIG-a1b2", "0", "1", "MIG-a1b2"]
    served = gpu.GpuRoom(("0", "1"), 80 * GiB, 9, server=True)  # the server holds a seat on device 0
    assert [served.device_for(k) for k in range(1, 5)] == ["1", "0", "1", "0"]


def test_a_room_too_big_for_its_gpus_and_bad_device_names_are_refused():
    with pytest.raises(ValueError, match=r"these devices hold at most 13 learners"):
        gpu.GpuRoom(("0",), 24 * GiB, 40)
    with pytest.raises(ValueError, match="a device index"):
        gpu.GpuRoom(("cuda:0",), 80 * GiB, 2)
    with pytest.raises(ValueError, match="named twice"):
        gpu.GpuRoom(("0", "0"), 80 * GiB, 2)
    with pytest.raises(ValueError, match="at least one device"):
        gpu.GpuRoom((), 80 * GiB, 2)


def test_the_config_gives_each_learner_a_device_and_the_gpu_kv_budget(tmp_path):
    room = gpu.GpuRoom(("0", "1"), 80 * GiB, 4)
    c = _load(render(_options(tmp_path, gpu=room)))
    env = c.Spawner.environment
    assert env["LAB_KV_CACHE_MEMORY_BYTES"] == str(room.kv_bytes)  # the GPU budget replaces the CPU one
    assert [env["CUDA_VISIBLE_DEVICES"](_spawner(k, f"l{k}")) for k in (1, 2, 3)] == ["0", "1", "0"]
    assert "OPENAI_API_KEY" not in env and "llm-server" not in {s["name"] for s in c.JupyterHub.services}


@pytest.mark.parametrize("per_learner", [False, True])
def test_one_shared_server_and_each_learners_key(tmp_path, per_learner):
    o = _options(tmp_path, gpu=gpu.GpuRoom(("0", "1"), 80 * GiB, 4, server=True), serve_model="smollm2-135m",
                 serve_port=8123, per_learner_keys=per_learner)
    o.state.mkdir(parents=True)
    c = _load(render(o))
    env = c.Spawner.environment
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8123/v1"
    server = next(s for s in c.JupyterHub.services if s["name"] == "llm-server")
    cmd = server["command"]
    assert cmd[1:6] == ["-m", "lab_utils", "serve", "--model", "smollm2-135m"]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert int(cmd[cmd.index("--kv-cache-memory-bytes") + 1]) == o.gpu.server_kv_bytes
    assert server["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert server["environment"]["LAB_UTILS_CACHE"] == str(o.cache)
    keys = LearnerKeys(o.state / "api_keys.txt", o.key_secret)
    learner_key = env["OPENAI_API_KEY"] if per_learner else env["LAB_LEARNER_API_KEY"]
    ada, bob = learner_key(_spawner(2, "ada")), learner_key(_spawner(3, "bob"))
    assert ada != bob and ada == learner_key(_spawner(2, "ada")) == keys.key_for("ada")
    assert keys.names() == {"ada": ada, "bob": bob}  # written once each, private to the hub's user
    assert (o.state / "api_keys.txt").stat().st_mode & 0o077 == 0
    if per_learner:
        assert cmd[cmd.index(KEY_FILE_FLAG) + 1] == str(o.state / "api_keys.txt") and "--api-key" not in cmd
    else:  # the server checks one key: every learner sends the room's
        assert env["OPENAI_API_KEY"] == o.room_key == cmd[cmd.index("--api-key") + 1]


def test_the_keys_flag_is_detected_from_the_servers_own_parser(tmp_path):
    from lab_utils.workshop.api_keys import serve_takes_key_file

    o = _options(tmp_path, serve_model="smollm2-135m")
    assert o.per_learner_keys is serve_takes_key_file()


def test_workshop_command_takes_the_gpu_settings(tmp_path):
    base = [sys.executable, "-m", "lab_utils", "workshop", "--state", str(tmp_path / "s"), "--homes",
            str(tmp_path / "h"), "--learners", "6", "--admin", "teach", "--write-only"]
    run = subprocess.run(base + ["--gpus", "0,MIG-a1b2", "--gpu-mem", "40", "--serve", "smollm2-135m"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert "gpu: 7 seat(s) on 2 device(s) of 40 GiB" in run.stdout and "server: smollm2-135m" in run.stdout
    text = (tmp_path / "s" / "jupyterhub_config.py").read_text()
    assert "devices=('0', 'MIG-a1b2')" in text and '"llm-server"' in text
