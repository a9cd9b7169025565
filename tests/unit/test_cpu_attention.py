"""The compiled CPU decode-attention kernel (cpu_attention): same maths as the reference, same engine tokens."""
from __future__ import annotations

import pytest
import torch

from lab_utils import load_model
from lab_utils.engine.attention import (
    AttentionMetadata,
    PagedAttention,
    paged_attention_reference,
)
from lab_utils.engine.accel.cpu_attention import MAX_KERNEL_QUERIES, CpuDecodeAttention
from lab_utils.engine.accel.cpu_kernels import cpu_kernels, cpu_kernels_status
from lab_utils.checks.teacher_forced import assert_same_up_to_rounding
from lab_utils.engine.kv.kv_cache import KVCache

# No compiler here means the engine runs the PyTorch path (tested everywhere else); these tests then have
# nothing to test, and say so rather than pass.
needs_kernel = pytest.mark.skipif(cpu_kernels() is None, reason=f"needs the compiled kernel: {cpu_kernels_status()}")


def paged_layout(lens: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Block tables for sequences of `lens` tokens over shuffled, disjoint blocks (as the block manager hands out)."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(perm[used:used + k])
        used += k
    return tables


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_equals_reference(hq, hkv, block_size):
    torch.manual_seed(0)
    d, num_blocks = 32, 300 // block_size + 8
    lens = [1, block_size, block_size + 1, 37, 200]
    tables = paged_layout(lens, block_size, num_blocks)
    k_cache = torch.randn(num_blocks * block_size, hkv, d)
    v_cache = torch.randn(num_blocks * block_size, hkv, d)
    q = torch.randn(len(lens), hq, d)
    want = paged_attention_reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), block_size)
    got = cpu_kernels().paged_decode_attention(q, k_cache, v_cache, padded(tables),
                                              torch.tensor(lens, dtype=torch.int32), block_size, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_reads_strided_query_rows():
    """q is a slice of the fused q/k/v output in the engine: rows strided, heads contiguous."""
    torch.manual_seed(1)
    lens, bs = [5, 40], 16
    tables = paged_layout(lens, bs, 8)
    k_cache, v_cache = torch.randn(128, 2, 16), torch.randn(128, 2, 16)
    wide = torch.randn(2, 6, 16)  # 4 query heads, then 2 more (k in the engine)
    q = wide[:, :4]
    assert not q.is_contiguous()
    args = (k_cache, v_cache, padded(tables), torch.tensor(lens, dtype=torch.int32), bs, 0.25)
    torch.testing.assert_close(cpu_kernels().paged_decode_attention(q, *args),
                               cpu_kernels().paged_decode_attention(q.contiguous(), *args))


@needs_kernel
def test_kernel_rejects_bad_input_by_name():
    k_cache = v_cache = torch.zeros(64, 2, 8)
    q, table, lens = torch.zeros(1, 4, 8), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    kern = cpu_kernels().paged_decode_attention
    with pytest.raises(RuntimeError, match="block id 9 outside the cache"):
        kern(q, k_cache, v_cache, torch.tensor([[0, 9]], dtype=torch.int32), lens, 16, 1.0)
    with pytest.raises(RuntimeError, match="context length 40 outside"):
        kern(q, k_cache, v_cache, table, torch.tensor([40], dtype=torch.int32), 16, 1.0)
    with pytest.raises(RuntimeError, match="q must be Float"):
        kern(q.double(), k_cache, v_cache, table, lens, 16, 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        kern(torch.zeros(1, 3, 8), k_cache, v_cache, table, lens, 16, 1.0)


@needs_kernel
@pytest.mark.parametrize("chunk", [20, 12])
def test_mixed_step_equals_paged_attention(chunk):
    """Decode rows and a 3-token verify through the kernel, a 20-token prefill chunk through SDPA, in one step =
    PagedAttention's step (and = the kernel-only step when the chunk is short enough for the kernel too)."""
    torch.manual_seed(2)
    bs, hq, hkv, d = 4, 6, 2, 16
    ctx, q_lens = [9, 1, chunk + 6, 6, 11], [1, 1, chunk, 1, 3]  # sequence 2: a prefill chunk; 4: a verify
    tables = paged_layout(ctx, bs, 16)
    n = sum(q_lens)
    q, k, v = torch.randn(1, n, hq, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)

    def cache():
        c = KVCache(1, 16, bs, hkv, d, torch.float32, torch.float32, torch.device("cpu"))
        c.k.normal_(generator=torch.Generator().manual_seed(3))
        c.v.normal_(generator=torch.Generator().manual_seed(4))
        return c

    meta = AttentionMetadata.build(tables, ctx, q_lens, bs, torch.device("cpu"))
    want_cache, got_cache = cache(), cache()
    want = PagedAttention(want_cache, meta)(0, q, k, v)
    attn = CpuDecodeAttention(got_cache, tables, ctx, q_lens, bs)
    if chunk > MAX_KERNEL_QUERIES:  # 3 decode rows + 3 verify rows in the kernel; the chunk through SDPA
        assert attn.other is not None and len(attn.lens) == 6
    else:  # every row in the kernel
        assert attn.other is None and len(attn.lens) == 6 + chunk
    got = attn(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache.k, want_cache.k)  # every new token's K/V written to its slot
    torch.testing.assert_close(got_cache.v, want_cache.v)


@needs_kernel
def test_engine_scores_tokens_alike_with_and_without_the_kernel(monkeypatch, tiny_cpu_engine_run):
    """Teacher-forced (the kernel sums in another order than PyTorch's SDPA): same logits to float round-off."""
    eng, tokens, with_kernel = tiny_cpu_engine_run(score="own")
    assert eng.runner.cpu_decode_kernel
    monkeypatch.setenv("LAB_CPU_KERNELS", "0")
    eng, _, without = tiny_cpu_engine_run(score=tokens)
    assert not eng.runner.cpu_decode_kernel
    assert "LAB_CPU_KERNELS=0" in cpu_kernels_status()
    assert_same_up_to_rounding(without, with_kernel, "the paged decode kernel")


def test_kernel_only_for_float32_caches_on_cpu():
    from lab_utils.engine.accel.cpu_attention import kernel_usable

    cpu = torch.device("cpu")
    fp8 = KVCache(1, 4, 4, 1, 8, torch.float32, torch.float8_e4m3fn, cpu)
    bf16 = KVCache(1, 4, 4, 1, 8, torch.bfloat16, torch.bfloat16, cpu)
    assert not kernel_usable(fp8, cpu) and not kernel_usable(bf16, cpu)
    fp32 = KVCache(1, 4, 4, 1, 8, torch.float32, torch.float32, cpu)
    assert kernel_usable(fp32, cpu) == (cpu_kernels() is not None)
    assert not kernel_usable(fp32, torch.device("cuda"))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (3, 5, 64), (33, 17)])
def test_layer_ops_equal_pytorch(shape):
    """RMSNorm, residual add + RMSNorm and SwiGLU's silu-mul (cpu_fused's kernels) = PyTorch's ops."""
    torch.manual_seed(5)
    x, delta, w = torch.randn(shape), torch.randn(shape), torch.rand(shape[-1]) + 0.5
    kern = cpu_kernels()
    want = torch.nn.functional.rms_norm(x, shape[-1:], w, 1e-5)
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    total, normed = kern.add_rms_norm(x, delta, w, 1e-5)
    torch.testing.assert_close(total, x + delta)
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(x + delta, shape[-1:], w, 1e-5),
                               rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1]) * 4
    i = shape[-1]
    torch.testing.assert_close(kern.silu_mul(gate_up), torch.nn.functional.silu(gate_up[..., :i]) * gate_up[..., i:],
                               rtol=1e-5, atol=1e-5)
    extreme = torch.tensor([[-200.0, -90.0, -50.0, 0.0, 50.0, 90.0, 200.0, 3.0] + [1.0] * 8])  # finite everywhere
    torch.testing.assert_close(kern.silu_mul(extreme), torch.nn.functional.silu(extreme[:, :8]))
    with pytest.raises(RuntimeError, match="weight must be"):
        kern.rms_norm(x, torch.ones(shape[-1] + 1), 1e-5)
    with pytest.raises(RuntimeError, match="must be even"):
        kern.silu_mul(torch.zeros(2, 7))


@needs_kernel
def test_fused_view_same_with_and_without_the_kernels(monkeypatch):
    from lab_utils.engine.accel.cpu_view import pack_linears

    model, _ = load_model("tiny-random", device="cpu", dtype=torch.float32)
    view, _ = pack_linears(model)
    ids = torch.tensor([[5, 17, 99, 3, 40, 41]])
    with torch.inference_mode():
        want = model.hidden_states(ids)
        got = view.hidden_states(ids)
        monkeypatch.setenv("LAB_CPU_KERNELS", "0")
        without = view.hidden_states(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(without, want, rtol=1e-4, atol=1e-4)
