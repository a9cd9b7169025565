"""Lab 16 in SMOKE with a wrong kernel injected stops at the kernel's check with its named mistake; without Triton
every kernel cell says "skipped: needs triton" and nothing is claimed (never a false pass)."""
from __future__ import annotations

import os
import re

import nbformat
import pytest
from inject import assert_fails_at_check

from lab_utils.paths import REPO_ROOT

pytestmark = pytest.mark.notebooks

LAB = REPO_ROOT / "labs" / "16_write_the_kernel.ipynb"

# the last block's empty slots take part: no mask on positions past the context
TAIL_UNMASKED = """
b = tl.program_id(0)
h = tl.program_id(1)
ctx = tl.load(ctx_ptr + b)
d = tl.arange(0, D)
t = tl.arange(0, BLOCK)
q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
m = tl.zeros([], dtype=tl.float32) - float("inf")
l = tl.zeros([], dtype=tl.float32)
acc = tl.zeros([D], dtype=tl.float32)
for j in range(0, tl.cdiv(ctx, BLOCK)):
    blk = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
    rows = (blk * BLOCK + t)[:, None] * stride_kt + (h // GROUP) * stride_kh + d[None, :]
    k = tl.load(k_ptr + rows).to(tl.float32)
    scores = tl.sum(k * q[None, :], 1) * scale
    m_new = tl.maximum(m, tl.max(scores, 0))
    p = tl.exp(scores - m_new)
    alpha = tl.exp(m - m_new)
    acc = acc * alpha + tl.sum(p[:, None] * tl.load(v_ptr + rows).to(tl.float32), 0)
    l = l * alpha + tl.sum(p, 0)
    m = m_new
tl.store(o_ptr + b * stride_ob + h * stride_oh + d, acc / l)
"""


def test_an_unmasked_tail_fails_at_the_kernel_check(tmp_path):
    from lab_utils.kernels import triton_env

    if not triton_env.available():
        pytest.skip(triton_env.SKIP)
    assert_fails_at_check(LAB, "def paged_decode_kernel(", TAIL_UNMASKED, "likely mistake: tail_not_masked",
                          "lab16.check_paged_decode(", tmp_path)
    assert not (tmp_path / "my_engine" / "kernel.py").exists()


def test_without_triton_nothing_is_claimed(tmp_path, monkeypatch):
    import papermill as pm

    for k, v in {"LAB_SMOKE": "1", "LAB_INTERACTIVE": "0", "LAB_LEARNER_DIR": str(tmp_path / "my_engine"),
                 "LAB_TRITON": "off", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        monkeypatch.setenv(k, v)  # the notebook's kernel and bench-kernel's child inherit them
    out = tmp_path / "executed.ipynb"
    pm.execute_notebook(str(LAB), str(out), cwd=str(tmp_path), kernel_name="python3", progress_bar=False,
                        execution_timeout=600)
    nb = nbformat.read(out, as_version=4)
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    for cell in ("lab16.check_paged_decode(", "lab16.check_paged_decode_split(", "check_kernel_in_engine(",
                 "bench-kernel", "assert_claims("):
        (src,) = [c for c in nb.cells if c.cell_type == "code" and cell in c.source]
        said = "".join(o.get("text", "") for o in src.get("outputs", []))
        assert "skipped: needs triton" in said, f"the cell with {cell} said: {said[:500]}"
    assert "PASS" not in text and not re.search(r"check_\w+ passed", text), text[-3000:]
    assert not os.path.exists(tmp_path / "my_engine" / "kernel.py")
