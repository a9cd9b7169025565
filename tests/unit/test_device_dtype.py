"""resolve_dtype: the labs' DTYPE parameter (LAB_DTYPE) as a torch dtype, per device."""
import pytest
import torch

from lab_utils.device import resolve_dtype


def test_auto_is_fp32_on_cpu():
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32


def test_auto_is_bf16_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16


@pytest.mark.parametrize("name,want", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                       ("float16", torch.float16), ("BF16", torch.bfloat16),
                                       ("torch.float32", torch.float32), (torch.float16, torch.float16)])
def test_names(name, want):
    assert resolve_dtype(name, "cpu") is want


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="LAB_DTYPE=bfloat16"):
        resolve_dtype("int8", "cpu")
