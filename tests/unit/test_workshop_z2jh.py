"""deploy/z2jh-values.yaml, the room beyond one box, checked as far as it can be without a cluster: valid YAML whose
every key and type the Zero to JupyterHub chart's own values schema accepts (deploy/z2jh-values.schema.json; the
chart merges its defaults, so required keys are not asked of this file), with the pieces the course needs and the
GPU KV budgets the course's arithmetic gives."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lab_utils.workshop import gpu, sizing

jsonschema = pytest.importorskip("jsonschema")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GiB = gpu.GiB


def _without_required(schema):
    if isinstance(schema, dict):
        return {k: _without_required(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [_without_required(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((DEPLOY / "z2jh-values.yaml").read_text())


def test_every_key_is_one_the_chart_accepts(values):
    schema = _without_required(json.loads((DEPLOY / "z2jh-values.schema.json").read_text()))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(values)]
    assert not errors, errors
    misspelt = dict(values, singleuser={**values["singleuser"], "profilelist": []})  # the schema does catch one
    assert list(jsonschema.Draft7Validator(schema).iter_errors(misspelt))


def test_the_room_gets_the_course_image_culler_board_and_gpu_profiles(values):
    single, hub = values["singleuser"], values["hub"]
    assert single["cmd"][-1] == "lab_utils.workshop.singleuser" and single["defaultUrl"] == "/lab/tree/student"
    assert values["cull"]["enabled"] is True and values["cull"]["timeout"] == 3600
    assert hub["config"]["JupyterHub"]["authenticator_class"] == "native"
    board = next(c for c in hub["extraContainers"] if c["name"] == "board")
    assert board["image"] == f"{single['image']['name']}:{single['image']['tag']}"  # the course image
    assert board["command"][-3:] == ["lab_utils.workshop.board", "--homes", "/srv/checks"]
    assert hub["services"]["board"]["url"].endswith(":8002") and 8002 in hub["networkPolicy"]["allowedIngressPorts"]
    checks = next(m for m in single["storage"]["extraVolumeMounts"] if m["name"] == "lab-checks")
    assert checks["subPath"] == "{username}" and single["extraEnv"]["LAB_CHECKS_LOG"].startswith(checks["mountPath"])
    cache = next(m for m in single["storage"]["extraVolumeMounts"] if m["name"] == "lab-model-cache")
    assert cache["readOnly"] is True and single["extraEnv"]["LAB_UTILS_CACHE"] == cache["mountPath"]

    profiles = {p["display_name"]: p.get("kubespawner_override", {}) for p in single["profileList"]}
    whole, mig = profiles["A GPU share"], profiles["A MIG slice"]
    assert whole["extra_resource_limits"] == {"nvidia.com/gpu": "1"}
    assert [k for k in mig["extra_resource_limits"]] == ["nvidia.com/mig-1g.10gb"]
    # the KV budgets are the course's arithmetic: 8 time-sliced learners on an 80 GB card, one on a 10 GB slice
    assert int(whole["environment"]["LAB_KV_CACHE_MEMORY_BYTES"]) == gpu.GpuRoom(("0",), 80 * GiB, 8).kv_bytes
    assert int(mig["environment"]["LAB_KV_CACHE_MEMORY_BYTES"]) == gpu.GpuRoom(("MIG-s",), 10 * GiB, 1).kv_bytes


def test_the_cpu_share_follows_the_sizing_arithmetic(values):
    single = values["singleuser"]
    def gib(text: str) -> int:  # JupyterHub's byte sizes: G is 1024**3
        return int(float(text.rstrip("G")) * GiB)

    limit = gib(single["memory"]["limit"])
    kv = max(sizing.MIN_KV, min(sizing.MAX_KV, (limit - sizing.KERNEL_BASE) // 2))
    assert int(single["extraEnv"]["LAB_KV_CACHE_MEMORY_BYTES"]) == kv
    assert single["extraEnv"]["OMP_NUM_THREADS"] == str(int(single["cpu"]["limit"]))
    assert gib(single["memory"]["guarantee"]) >= sizing.KERNEL_BASE
