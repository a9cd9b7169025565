"""Where K and V actually live: one pool of slots per layer, addressed by slot = block_id * block_size + offset
(`paging.slot`).

`kv_cache_dtype` trades precision for capacity: fp8 stores 1 byte per value (cast with scale 1, as vLLM does
by default), int8 stores 1 byte plus one fp32 scale per (token, head) (`paging.bytes_per_token` counts them).
The fp8 write and read go through `fp8_encode` / `fp8_decode` (lab 05's learner writes their own; the engine
passes them in).
"""
from __future__ import annotations

import torch

from lab_utils.engine.kv.paging import KV_CACHE_DTYPES, KV_SCALE_DTYPE, slot

FP8_MAX = 448.0


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """Values -> FP8 E4M3 bit patterns as uint8: saturate at ±448 (E4M3 has no inf), round to nearest even."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_decode(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 E4M3 bit patterns (uint8) -> their values in `dtype` (exact: every E4M3 value fits fp16/bf16/fp32)."""
    return bits.view(torch.float8_e4m3fn).to(dtype)


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 compute_dtype: torch.dtype, store_dtype: torch.dtype, device: torch.device,
                 fp8_codec: tuple | None = None) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.compute_dtype, self.store_dtype = compute_dtype, store_dtype
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=store_dtype, device=device)
        self.v = torch.zeros(shape, dtype=store_dtype, device=device)
        self.quantized = store_dtype == torch.int8
        # (encode, decode) of an fp8 cache: values <-> uint8 bit patterns (default: the functions above)
        self.fp8_encode, self.fp8_decode = fp8_codec or (fp8_encode, fp8_decode)
        if self.quantized:
            self.k_scale = torch.ones(shape[:3], dtype=KV_SCALE_DTYPE, device=device)
            self.v_scale = torch.ones(shape[:3], dtype=KV_SCALE_DTYPE, device=device)

    @property
    def nbytes(self) -> int:
        n = self.k.nbytes + self.v.nbytes
        return n + (self.k_scale.nbytes + self.v_scale.nbytes if self.quantized else 0)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.quantized:
            scale = x.abs().amax(-1).to(KV_SCALE_DTYPE).clamp(min=1e-8) / 127.0
            return torch.round(x.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale
        if self.store_dtype == torch.float8_e4m3fn:
            bits = self.fp8_encode(x)
            if not (isinstance(bits, torch.Tensor) and bits.dtype == torch.uint8 and bits.shape == x.shape):
                raise ValueError(f"the fp8 encoder must return uint8 bit patterns of shape {tuple(x.shape)}, got "
                                 f"{type(bits).__name__} {getattr(bits, 'dtype', '')} {tuple(getattr(bits, 'shape', ()))}")
            return bits, None
        return x.to(self.store_dtype), None

    def _raw(self, t: torch.Tensor) -> torch.Tensor:
        """fp8 tensors as bytes: CPU kernels for index_copy_/gather do not cover float8 (the bits are the same)."""
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [N, Hkv, D] for the N tokens of this step go to their slots."""
        kq, ks = self._encode(k)
        vq, vs = self._encode(v)
        self._raw(self.k[layer]).index_copy_(0, slots, self._raw(kq))
        self._raw(self.v[layer]).index_copy_(0, slots, self._raw(vq))
        if self.quantized:
            self.k_scale[layer].index_copy_(0, slots, ks)
            self.v_scale[layer].index_copy_(0, slots, vs)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K, V at `slots` (any shape S) -> [*S, Hkv, D] in the compute dtype.

        `index_select` on the flat slots, not `cache[slots]`: the same rows, but a plain row copy (advanced
        indexing with a 2-D index was 3-10x slower on CPU at batch 32-64 on the 2-core course VM)."""
        flat = slots.reshape(-1)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, flat).view(*slots.shape, *t.shape[1:])

        if self.store_dtype == torch.float8_e4m3fn:
            return (self.fp8_decode(rows(self._raw(self.k[layer])), self.compute_dtype).to(self.compute_dtype),
                    self.fp8_decode(rows(self._raw(self.v[layer])), self.compute_dtype).to(self.compute_dtype))
        k = rows(self._raw(self.k[layer])).view(self.store_dtype)
        v = rows(self._raw(self.v[layer])).view(self.store_dtype)
        if self.quantized:
            k = k.float() * rows(self.k_scale[layer]).unsqueeze(-1)
            v = v.float() * rows(self.v_scale[layer]).unsqueeze(-1)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    # -- swap (preemption by copying to host memory) ---------------------------------------------
    def _slots_of(self, block_ids: list[int]) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        return slot(table, torch.arange(len(block_ids) * self.block_size, device=table.device), self.block_size)

    def copy_out(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        s = self._slots_of(block_ids)
        saved = {"k": self._raw(self.k)[:, s].to("cpu"), "v": self._raw(self.v)[:, s].to("cpu")}
        if self.quantized:
            saved.update(k_scale=self.k_scale[:, s].to("cpu"), v_scale=self.v_scale[:, s].to("cpu"))
        return saved

    def copy_in(self, block_ids: list[int], saved: dict[str, torch.Tensor]) -> None:
        s = self._slots_of(block_ids)
        n = saved["k"].shape[1]
        s = s[:n]
        for name, t in saved.items():
            self._raw(getattr(self, name))[:, s] = t.to(self.k.device)
