"""The Triton source of the reference paged decode kernel. Imports triton at the top: import it through
`paged_decode_triton`, which finds Triton first (`triton_env.load`)."""
import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, o_ptr, lse_ptr,
                        stride_qb, stride_qh, stride_kt, stride_kh, stride_tb,
                        stride_ob, stride_oh, stride_os, scale, blocks_per_split,
                        GROUP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: query head `h` of sequence `b` over blocks [s * blocks_per_split, ...) of its context.
    Writes that slice's normalised output and its log-sum-exp (the split-KV combine weighs slices by it)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // GROUP  # grouped-query attention: GROUP query heads share one KV head
    ctx = tl.load(ctx_ptr + b)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    m = tl.zeros([], dtype=tl.float32) - float("inf")
    l = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    n_blocks = tl.cdiv(ctx, BLOCK)
    start = s * blocks_per_split
    end = tl.minimum(start + blocks_per_split, n_blocks)
    t = tl.arange(0, BLOCK)
    for j in range(start, end):
        blk = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
        valid = j * BLOCK + t < ctx  # the last block is partly filled
        rows = (blk * BLOCK + t)[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + rows, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l = l * alpha + tl.sum(p, 0)
        m = m_new
    has = l > 0  # a split past the end of a short context holds nothing
    out = acc / tl.where(has, l, 1.0)
    o_off = b * stride_ob + h * stride_oh + s * stride_os
    tl.store(o_ptr + o_off + d, out, mask=dmask)
    tl.store(lse_ptr + (b * tl.num_programs(1) + h) * tl.num_programs(2) + s,
             tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf")))
