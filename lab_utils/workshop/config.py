"""The jupyterhub_config.py of a one-box workshop, written from a few choices (`WorkshopOptions`).

What it sets up:
- the hub on 127.0.0.1 by default (`ip`: the room's interface; put TLS in front, see docs/INSTRUCTOR.md);
- accounts: NativeAuthenticator (learners sign up, an instructor approves them at /hub/authorize) or, with a
  shared workshop code, one password for the room (anyone with it may log in as any learner; the instructors
  have their own); admins are the instructors;
- each learner's server in their own home (`homes/<name>`), as their own Unix user when the hub runs as root
  (created at first spawn), else as the hub's user (SimpleLocalProcessSpawner: no isolation between learners'
  files, for a trial or a test only); the learner copies are written at spawn and never overwritten
  (`lab_utils.workshop.singleuser`); one shared model cache (LAB_UTILS_CACHE) the learners only read;
- per-learner memory, CPU, torch threads and KV budget from the room's size (`lab_utils.workshop.sizing`);
- on a GPU box, each learner's device (CUDA_VISIBLE_DEVICES, round-robin over devices or MIG slices) and GPU KV
  budget (`lab_utils.workshop.gpu`), and one shared `lab_utils serve` for labs 08 and 12 with each learner's own
  API key in OPENAI_API_KEY (`lab_utils.workshop.api_keys`);
- jupyterhub-idle-culler and the instructor's board (admins only) as hub services.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.workshop.gpu import GpuRoom
from lab_utils.workshop.sizing import Share

USERNAME = r"^[a-z][a-z0-9_-]{0,31}$"  # safe as a Unix user name and a folder name


@dataclass
class WorkshopOptions:
    state: Path  # the hub's database, cookie secret, config and logs
    homes: Path  # one folder per learner
    cache: Path  # the prepared models (LAB_UTILS_CACHE), shared and read-only for learners
    labs: Path  # the labs the learner copies are made from
    share: Share
    admins: list[str] = field(default_factory=list)
    ip: str = "127.0.0.1"
    port: int = 8000
    hub_port: int = 8081
    proxy_api_port: int = 8001
    board_port: int = 8002
    code: str | None = None  # a shared workshop code instead of sign-up with approval
    admin_password: str | None = None  # with a code: the instructors' password (generated when not given)
    unix_users: bool | None = None  # one Unix user per learner; default: when the hub runs as root
    cull_after_s: int = 3600
    python: str = sys.executable
    gpu: GpuRoom | None = None  # a GPU box: each learner's device and GPU KV budget
    serve_model: str | None = None  # one shared `lab_utils serve` of this model for labs 08 and 12
    serve_port: int = 8003
    key_secret: str | None = None  # derives each learner's API key (generated when not given)
    room_key: str | None = None  # the one key while the server checks only one (generated when not given)
    per_learner_keys: bool | None = None  # default: when `lab_utils serve` takes a file of keys

    def __post_init__(self) -> None:
        import re

        for name in self.admins:
            if not re.match(USERNAME, name):
                raise ValueError(f"admin {name!r}: names are lower-case letters, digits, '-' or '_' ({USERNAME})")
        if self.code is not None and len(self.code) < 8:
            raise ValueError(f"workshop code of {len(self.code)} characters: use at least 8")
        if self.code is not None and self.admin_password is None:
            import secrets

            self.admin_password = secrets.token_urlsafe(32)
        if self.unix_users is None:
            self.unix_users = os.geteuid() == 0
        if self.serve_model is not None:
            import secrets

            from lab_utils.workshop.api_keys import serve_takes_key_file

            self.key_secret = self.key_secret or secrets.token_urlsafe(32)
            self.room_key = self.room_key or "lab-" + secrets.token_hex(20)
            if self.per_learner_keys is None:
                self.per_learner_keys = serve_takes_key_file()


def render(o: WorkshopOptions) -> str:
    """The config file's text (plain Python, readable and editable by the instructor)."""
    py = o.python
    env = {"LAB_UTILS_CACHE": str(o.cache), "LAB_LABS_DIR": str(o.labs), "HF_HUB_OFFLINE": "1", **o.share.env()}
    if o.code is not None:
        auth = f"""c.JupyterHub.authenticator_class = "shared-password"  # one workshop code for every learner
c.SharedPasswordAuthenticator.user_password = {o.code!r}
c.SharedPasswordAuthenticator.admin_password = {o.admin_password!r}  # the instructors' own
c.Authenticator.allow_all = True"""
    else:
        auth = """# learners sign up; an admin approves at /hub/authorize (NativeAuthenticator, its login mended for JupyterHub 6)
c.JupyterHub.authenticator_class = "lab_utils.workshop.native_auth.WorkshopNativeAuthenticator"
c.NativeAuthenticator.open_signup = False
c.NativeAuthenticator.minimum_password_length = 8
c.Authenticator.allow_all = True  # approval is NativeAuthenticator's own gate"""
    if o.unix_users:
        spawner = f"""c.JupyterHub.spawner_class = "localprocess"  # each learner is their own Unix user
import pwd, subprocess
def _create_unix_user(spawner):
    name = spawner.user.name
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--home-dir", f"{o.homes}/{{name}}", "--shell", "/bin/bash",
                        name], check=True)
c.Spawner.pre_spawn_hook = _create_unix_user"""
    else:
        spawner = f"""c.JupyterHub.spawner_class = "simple"  # all learners run as this Unix user: no file isolation
c.SimpleLocalProcessSpawner.home_dir_template = "{o.homes}/{{username}}\""""
        if os.geteuid() == 0:
            spawner += '\nc.Spawner.args = ["--allow-root"]  # a trial as root: the learners run as root too'

    text = f'''"""JupyterHub for a one-box workshop, written by `python -m lab_utils workshop` (rerun it to change this)."""
c = get_config()  # noqa: F821

c.JupyterHub.ip = {o.ip!r}
c.JupyterHub.port = {o.port}
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {o.hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{o.proxy_api_port}"
c.ConfigurableHTTPProxy.pid_file = "{o.state}/proxy.pid"
c.JupyterHub.db_url = "sqlite:///{o.state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{o.state}/jupyterhub_cookie_secret"
c.JupyterHub.cleanup_servers = True

{auth}
c.Authenticator.admin_users = {set(o.admins)!r}
c.Authenticator.username_pattern = {USERNAME!r}

{spawner}
c.Spawner.cmd = [{py!r}, "-m", "lab_utils.workshop.singleuser"]
c.Spawner.default_url = "/lab/tree/student"
c.Spawner.environment = {env!r}
# {o.share}; enforced by spawners with cgroups (systemdspawner, KubeSpawner), advisory with local processes
c.Spawner.mem_limit = {o.share.mem_bytes}
c.Spawner.cpu_limit = {o.share.cpu}
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 90

c.JupyterHub.services = [
    {{"name": "idle-culler", "command": [{py!r}, "-m", "jupyterhub_idle_culler", "--timeout={o.cull_after_s}"]}},
    {{"name": "board", "url": "http://127.0.0.1:{o.board_port}", "display": True, "oauth_no_confirm": True,
      "command": [{py!r}, "-m", "lab_utils.workshop.board", "--homes", "{o.homes}"]}},
]
c.JupyterHub.load_roles = [
    {{"name": "idle-culler", "services": ["idle-culler"],
      "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}},
]
'''
    return text + _render_gpu(o) + _render_server(o)


def _render_gpu(o: WorkshopOptions) -> str:
    if o.gpu is None:
        return ""
    g = o.gpu
    return f'''
# A shared GPU box: {g}
from lab_utils.workshop.gpu import GpuRoom
_gpu = GpuRoom(devices={g.devices!r}, device_bytes={g.device_bytes}, learners={g.learners}, server={g.server})
c.Spawner.environment["CUDA_VISIBLE_DEVICES"] = lambda spawner: _gpu.device_for(spawner.user.id)  # round-robin
c.Spawner.environment["LAB_KV_CACHE_MEMORY_BYTES"] = "{g.kv_bytes}"  # this learner's GPU KV budget
'''


def _render_server(o: WorkshopOptions) -> str:
    if o.serve_model is None:
        return ""
    cmd = [o.python, "-m", "lab_utils", "serve", "--model", o.serve_model, "--host", "127.0.0.1",
           "--port", str(o.serve_port)]
    env = {"LAB_UTILS_CACHE": str(o.cache), "HF_HUB_OFFLINE": "1"}
    if o.gpu is not None:
        cmd += ["--device", "cuda", "--kv-cache-memory-bytes", str(o.gpu.server_kv_bytes)]
        env["CUDA_VISIBLE_DEVICES"] = o.gpu.devices[0]
    keys = f"{o.state}/api_keys.txt"
    if o.per_learner_keys:
        from lab_utils.workshop.api_keys import KEY_FILE_FLAG

        cmd += [KEY_FILE_FLAG, keys]
        learner_key = "lambda spawner: _keys.key_for(spawner.user.name)  # each learner's own"
    else:
        cmd += ["--api-key", o.room_key]
        learner_key = (f"{o.room_key!r}  # the room's one key: `lab_utils serve` checks one\n"
                       f'c.Spawner.environment["LAB_LEARNER_API_KEY"] = lambda spawner: '
                       f"_keys.key_for(spawner.user.name)  # each learner's own, for a server that takes a file")
    return f'''
# One shared `lab_utils serve` for labs 08 and 12; each learner's key in OPENAI_API_KEY ({keys})
from lab_utils.workshop.api_keys import LearnerKeys
_keys = LearnerKeys({keys!r}, {o.key_secret!r})
c.Spawner.environment["OPENAI_BASE_URL"] = "http://127.0.0.1:{o.serve_port}/v1"
c.Spawner.environment["OPENAI_API_KEY"] = {learner_key}
c.JupyterHub.services.append({{"name": "llm-server", "command": {cmd!r}, "environment": {env!r}}})
'''


def write(o: WorkshopOptions) -> Path:
    """Write the config (and the folders it names) under `o.state`; returns its path."""
    o.state.mkdir(parents=True, exist_ok=True, mode=0o700)
    o.homes.mkdir(parents=True, exist_ok=True)
    path = o.state / "jupyterhub_config.py"
    path.write_text(render(o), encoding="utf-8")
    path.chmod(0o600)  # it may hold the workshop code
    return path
