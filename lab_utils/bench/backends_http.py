"""`http` backend: any OpenAI-compatible server (vLLM's, the lab's), timed on the client like `vllm bench serve`.

Each request is sent when its arrival time comes, as a streaming `/v1/completions` call; the client stamps
every server-sent chunk when it arrives, so TTFT includes the network, queueing and prefill, and ITL is the
gap between chunks as a user would see them. Prompts go as token ids (what vLLM and the lab server accept),
so the server sees exactly the workload's tokens; `prompt_mode="text"` sends the decoded text instead.
Greedy with `ignore_eos` (a vLLM extension the lab server mirrors), so each request asks for `output_len`
tokens. Token ids come back with `return_token_ids` where the server supports it; otherwise each non-empty
chunk counts as one token and the server's `usage.completion_tokens` is checked against that count.
"""
from __future__ import annotations

import asyncio
import json
import math

from lab_utils.bench.backends import Backend, BenchRun, RequestResult
from lab_utils.bench.workload import Workload
from lab_utils.device import now


class HTTPBackend(Backend):
    name = "http"

    def __init__(self, model: str = "smollm2-135m", base_url: str = "http://127.0.0.1:8000",
                 served_model: str | None = None, prompt_mode: str = "ids", max_concurrency: int | None = None,
                 timeout_s: float = 600.0, api_key: str | None = None, args=None) -> None:
        import os

        if args is not None:  # the bench CLI: --base-url, else $OPENAI_BASE_URL, else the default
            base_url = getattr(args, "base_url", None) or os.environ.get("OPENAI_BASE_URL", "").removesuffix("/v1") or base_url
            max_concurrency = getattr(args, "max_concurrency", None) or max_concurrency
        if prompt_mode not in ("ids", "text"):
            raise ValueError(f"prompt_mode={prompt_mode!r} is invalid: must be 'ids' or 'text'")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} is invalid: must be None or >= 1")
        self.model_name = str(model)
        self.base_url = base_url.rstrip("/")
        self.prompt_mode, self.max_concurrency, self.timeout_s = prompt_mode, max_concurrency, timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.served_model = served_model or self._first_model()

    def _first_model(self) -> str:
        """The id the server serves (vLLM names a model by the path it was started with)."""
        import httpx

        try:
            r = httpx.get(f"{self.base_url}/v1/models", headers=self.headers, timeout=10.0)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise RuntimeError(f"no OpenAI-compatible server answers at {self.base_url}/v1/models ({exc})") from exc

    def describe(self) -> dict:
        return dict(base_url=self.base_url, served_model=self.served_model, prompt_mode=self.prompt_mode,
                    max_concurrency=self.max_concurrency, endpoint="/v1/completions", stream=True)

    def metrics_text(self) -> str:
        """The server's `/metrics` page (Prometheus text), e.g. vLLM's `vllm:time_to_first_token_seconds`."""
        import httpx

        r = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return r.text

    def run(self, workload: Workload, warmup: bool = True) -> BenchRun:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._run(workload, warmup))
        # called from a running event loop (a Jupyter kernel): give the client its own loop in a worker thread
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, self._run(workload, warmup)).result()

    def _body(self, w, max_tokens: int) -> dict:
        return {"model": self.served_model,
                "prompt": list(w.prompt_token_ids) if self.prompt_mode == "ids" else w.prompt,
                "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}

    async def _run(self, workload: Workload, warmup: bool) -> BenchRun:
        import httpx

        limits = httpx.Limits(max_connections=self.max_concurrency or max(len(workload), 1) + 1)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=self.headers) as client:
            if warmup:
                await self._one(client, workload.requests[0], now(), max_tokens=2)
            sem = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None
            t0 = now()

            async def send(w) -> RequestResult:
                delay = t0 + w.arrival_time - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is None:
                    return await self._one(client, w, t0 + w.arrival_time)
                async with sem:  # a request that waits for a slot is still late from its arrival time
                    return await self._one(client, w, t0 + w.arrival_time)

            results = await asyncio.gather(*(send(w) for w in workload.requests))
        done = [r.finish_time for r in results if r.finish_time is not None]
        return BenchRun(self.name, self.model_name, list(results), t0, max(done) if done else now(), self.describe())

    async def _one(self, client, w, arrival: float, max_tokens: int | None = None) -> RequestResult:
        res = RequestResult(w.request_id, arrival, w.input_len)
        usage_tokens = None
        chunks_without_ids = 0
        try:
            async with client.stream("POST", f"{self.base_url}/v1/completions",
                                     json=self._body(w, max_tokens or w.output_len)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")[:300]
                    res.error = f"HTTP {resp.status_code}: {body}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    t = now()
                    msg = json.loads(data)
                    if msg.get("usage"):
                        usage_tokens = msg["usage"].get("completion_tokens")
                    for ch in msg.get("choices") or []:
                        ids = ch.get("token_ids")
                        if ids is not None:
                            n = len(ids)
                            res.output_token_ids.extend(int(x) for x in ids)
                        else:
                            n = 1 if ch.get("text") else 0
                            chunks_without_ids += n
                        if n:
                            res.first_token_time = res.first_token_time or t
                            res.token_times.extend([t] * n)
                        if ch.get("finish_reason"):
                            res.finish_reason = ch["finish_reason"]
                            res.finish_time = t
        except Exception as exc:  # network errors end this request with a reason; the run goes on
            res.error = f"{type(exc).__name__}: {exc}"
            return res
        if res.finish_time is None and res.token_times:
            res.finish_time = res.token_times[-1]
        if usage_tokens is not None and usage_tokens != len(res.token_times):
            if chunks_without_ids:  # text-only server: chunk count is a lower bound, spread the rest evenly
                res.token_times = _stretch(res.token_times, usage_tokens)
            else:
                res.error = f"server reported {usage_tokens} tokens but streamed {len(res.token_times)}"
        return res


def _stretch(times: list[float], n: int) -> list[float]:
    """`n` timestamps from `len(times)` chunk arrivals: a chunk holding several tokens stamps them all at its time."""
    if not times or n <= len(times):
        return times[:n]
    per = n / len(times)
    out = []
    for i, t in enumerate(times):
        out.extend([t] * (math.floor((i + 1) * per) - math.floor(i * per)))
    return out
