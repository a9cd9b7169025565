"""Self-check quizzes: a few questions per lab, with the reasoning shown after each answer.

In a lab (widgets only when INTERACTIVE; the plain call works everywhere, including papermill and CI):

    from lab_utils import quiz
    quiz.show("00", interactive=INTERACTIVE)       # widgets, or the questions as text
    quiz.ask("00", "kv_bytes", 23040)              # -> Feedback: correct or not, and why

Multiple-choice answers are letters ("b"); numeric answers are numbers, accepted within a relative tolerance.
"""
from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Question:
    qid: str
    prompt: str
    answer: str | float  # a letter for multiple choice, a number for numeric questions
    explanation: str
    options: tuple[str, ...] = ()  # non-empty: multiple choice
    tol: float = 0.01  # relative tolerance for numeric answers
    unit: str = ""

    @property
    def kind(self) -> str:
        return "choice" if self.options else "numeric"

    def letters(self) -> list[str]:
        return [chr(ord("a") + i) for i in range(len(self.options))]

    def text(self) -> str:
        lines = [f"[{self.qid}] {self.prompt}"]
        lines += [f"   ({ltr}) {opt}" for ltr, opt in zip(self.letters(), self.options)]
        if self.kind == "numeric":
            lines.append(f"   (a number{', in ' + self.unit if self.unit else ''})")
        return "\n".join(lines)


@dataclass(frozen=True)
class Feedback:
    correct: bool
    message: str
    explanation: str

    def __bool__(self) -> bool:
        return self.correct

    def __str__(self) -> str:
        return f"{self.message}\n{self.explanation}"

    __repr__ = __str__

    def _repr_markdown_(self) -> str:
        mark = "✅" if self.correct else "❌"
        return f"{mark} **{self.message}**\n\n{self.explanation}"


def _c(qid: str, prompt: str, options: list[str], answer: str, explanation: str) -> Question:
    """Multiple choice, `answer` a letter of `options` as written; the options are rotated by a fixed amount
    per question so that the right letter is not always the same one."""
    k = zlib.crc32(qid.encode()) % len(options)
    idx = ord(answer) - ord("a")
    return Question(qid, prompt, chr(ord("a") + (idx - k) % len(options)), explanation,
                    tuple(options[k:] + options[:k]))


def _n(qid: str, prompt: str, answer: float, explanation: str, unit: str = "", tol: float = 0.01) -> Question:
    return Question(qid, prompt, float(answer), explanation, (), tol, unit)


# SmolLM2-135M: 30 layers, 3 KV heads of dim 576/9 = 64. K and V, fp16 (2 bytes): 2*30*3*64*2 bytes per token.
_KV_BYTES_FP16 = 2 * 30 * 3 * 64 * 2  # 23040

QUESTIONS: dict[str, list[Question]] = {
    "00": [
        _n("kv_bytes", "SmolLM2-135M has 30 layers and 3 KV heads of dimension 64. How many bytes of KV cache does "
           "one token take in fp16?", _KV_BYTES_FP16,
           "K and V (2) × 30 layers × 3 KV heads × 64 dims × 2 bytes = 23,040 bytes ≈ 22.5 KiB per token. Grouped-"
           "query attention is why it is 3 KV heads, not 9: a 3× smaller cache.", unit="bytes"),
        _c("decode_bound", "At batch size 1, what limits the speed of a large model's decode step on a GPU?",
           ["Peak floating-point throughput", "Memory bandwidth: every weight is read once per step",
            "The tokenizer", "Python's interpreter lock"], "b",
           "Decode does ~2 FLOPs per weight per token but must read every weight from memory each step, so its "
           "arithmetic intensity is ~1 FLOP/byte: far below any GPU's ridge point. Time ≈ bytes ÷ bandwidth. (A model "
           "as small as SmolLM2-135M is bound by kernel-launch overhead on a big GPU instead: CUDA graphs help.)"),
        _c("no_cache", "Generating n tokens without a KV cache (re-running the whole sequence each step) costs…",
           ["About the same as with a cache", "Work that grows linearly in n",
            "Work that grows roughly quadratically in n: every step recomputes all earlier positions",
            "Less memory and less time"], "c",
           "Step t re-processes all t previous tokens, so total work is ~Σt ∝ n². The KV cache stores each "
           "position's keys and values once, so each step processes only the new token."),
        _c("ttft", "Which metric is the time from a request's arrival to its first output token?",
           ["TTFT", "TPOT", "ITL", "E2E latency"], "a",
           "TTFT (time to first token) covers queueing plus prefill. TPOT/ITL measure the gaps between later "
           "tokens (decode), E2E the whole request."),
    ],
    "01": [
        _n("static_util", "A static batch holds 4 requests that need 10, 20, 30 and 100 decode steps. The batch runs "
           "until the longest is done. What fraction of the batch's slot-steps did useful work?", 0.4,
           "The batch runs 100 steps × 4 slots = 400 slot-steps; useful ones are 10+20+30+100 = 160, so 0.4. "
           "Continuous batching refills a finished slot with a waiting request at the next step."),
        _c("iteration_level", "What does continuous batching change compared with static batching?",
           ["It uses a bigger batch", "It schedules per iteration: requests join and leave the running batch at "
            "every decode step", "It skips the prefill", "It caches prompts"], "b",
           "Iteration-level scheduling (Orca) decides the batch at every step, so short requests leave early and "
           "new ones start without waiting for the longest sequence in the batch."),
        _c("batch_tradeoff", "On a memory-bound decode, doubling the number of running sequences usually…",
           ["Halves throughput", "Raises throughput a lot while each step gets only a little slower",
            "Leaves throughput unchanged", "Makes TTFT zero"], "b",
           "The weights are read once per step whatever the batch size, so more sequences share that cost: "
           "throughput rises nearly linearly until compute or KV memory becomes the limit."),
    ],
    "02": [
        _n("blocks_needed", "With a block size of 16 tokens, how many KV blocks does a 100-token sequence need?", 7,
           "ceil(100 / 16) = 7 blocks. Only the last block is partly empty, so waste is < 1 block per sequence.",
           unit="blocks"),
        _n("blocks_waste", "…and how many token slots of those blocks are unused?", 12,
           "7 × 16 = 112 slots for 100 tokens: 12 unused, all in the last block (internal fragmentation only).",
           unit="slots"),
        _c("why_paging", "Why did pre-vLLM systems use only 20–38% of their KV memory for actual tokens?",
           ["GPUs were too small", "They reserved contiguous space for the maximum length of every request "
            "(over-reservation plus internal and external fragmentation)", "Their models were quantized",
            "They had no prefix cache"], "b",
           "A contiguous cache must reserve max_len slots up front. Paging allocates fixed-size blocks on demand "
           "through a block table, so waste falls below 4% (the vLLM paper)."),
        _c("out_of_blocks", "A running sequence needs a new block and none is free. A well-behaved engine…",
           ["Crashes with out-of-memory", "Preempts a sequence (frees its blocks) and resumes it later",
            "Truncates the sequence silently", "Allocates a contiguous buffer"], "b",
           "Preemption frees the victim's blocks; it is later recomputed (this engine can also swap its KV to host "
           "memory and back). vLLM V1 preempts by recompute only (vllm/v1/core/sched/scheduler.py, "
           "_preempt_request: blocks freed, num_computed_tokens = 0); swapping was V0's, and KV offloading to host "
           "memory took its place. Every request still ends finished, aborted or rejected with a reason."),
    ],
    "03": [
        _n("chunk_tokens", "Token budget per step: 512. Three sequences are decoding (1 token each, scheduled first) "
           "and a 2,000-token prompt waits. How many of its prompt tokens go into this step?", 509,
           "Decodes are scheduled first (3 tokens); the prompt gets the remaining 512 − 3 = 509 tokens, and the "
           "rest of it is prefilled in the next steps.", unit="tokens"),
        _c("why_chunk", "What problem does chunked prefill fix?",
           ["Prompts that exceed the context length", "A long prefill stalls every running decode for one very "
            "long step, so inter-token latency spikes", "Low prefix-cache hit rates", "Tokenizer speed"], "b",
           "Splitting prefills into chunks bounds each step's work, so decodes keep flowing alongside prompts "
           "(Sarathi-Serve: 2.6× more capacity under tail-latency SLOs)."),
        _c("chunk_size", "Making the token budget (chunk size) much smaller tends to…",
           ["Lower ITL but raise TTFT and per-step overhead", "Lower both TTFT and ITL for free",
            "Raise ITL", "Change nothing"], "a",
           "Small chunks keep steps short (good for ITL) but a prompt needs more steps to finish its prefill, and "
           "fixed per-step costs are paid more often: a latency/throughput knob, not a free win."),
    ],
    "04": [
        _n("reusable_blocks", "Block size 16; every request starts with the same 100-token system prompt. How many "
           "KV blocks can a new request reuse from the prefix cache?", 6,
           "Only full blocks are cached and shared: floor(100 / 16) = 6 blocks (96 tokens); the last 4 tokens "
           "share a block with the request's own text and are recomputed.", unit="blocks"),
        _c("block_key", "What identifies a cached block so that it is reused only when it is truly the same?",
           ["Its position in memory", "A hash of its tokens together with the hash of all tokens before it",
            "The request id", "The first token in the block"], "b",
           "K/V of a token depends on every token before it, so the key chains the parent block's hash with this "
           "block's tokens: equal keys ⇒ equal prefixes ⇒ equal K/V."),
        _c("eviction", "Which cached blocks may be evicted when memory is needed?",
           ["Any block, including those of running sequences", "Only blocks no running sequence references "
            "(ref count 0), least recently used first", "The most recently used", "None: the cache only grows"],
           "b",
           "Blocks are reference-counted; a block in use cannot be evicted. Free-but-cached blocks stay reusable "
           "until their memory is needed, LRU first."),
    ],
    "05": [
        _n("int4_mb", "Ignoring scales, how many MB (10^6 bytes) do 135 million weights take at 4 bits each?", 67.5,
           "135e6 × 0.5 bytes = 67.5 MB, vs 270 MB in fp16: 4× fewer bytes to read per decode step.", unit="MB"),
        _n("int8_scale", "Symmetric per-tensor int8: the largest |w| is 2.54. What is the scale (w ≈ scale × q)?",
           0.02, "scale = max|w| / 127 = 2.54 / 127 = 0.02, so q = round(w / 0.02) fits in [-127, 127]."),
        _c("why_faster", "Why can weight-only quantization speed up decode even though the matmul runs in fp16?",
           ["Integer math is always faster", "Decode is memory-bound: fewer bytes of weights to read per step",
            "It shortens the prompt", "It removes the KV cache"], "b",
           "Weights are dequantized on the fly; the win is reading 2–4× fewer bytes from memory, which is what "
           "bounds decode. Prefill, being compute-bound, gains little."),
        _c("fp8_formats", "FP8 e4m3 versus e5m2:",
           ["e4m3 has more precision, e5m2 more range", "e4m3 has more range, e5m2 more precision",
            "They are identical", "e5m2 has no exponent"], "a",
           "4 exponent + 3 mantissa bits (max 448) vs 5 + 2 (max 57344): e4m3 for weights and activations, e5m2 "
           "where range matters (e.g. gradients)."),
    ],
    "06": [
        _n("soft_prob", "Logits [2, 0] softened with temperature T = 2: what probability does the first class get?",
           0.7311, "softmax([2, 0] / 2) = softmax([1, 0]) → e / (e + 1) ≈ 0.731 (vs 0.881 at T = 1): higher T "
           "exposes more of the teacher's preferences among wrong answers."),
        _c("kd_loss", "The classic distillation loss is…",
           ["MSE between hidden states only", "KL divergence between the teacher's and the student's "
            "temperature-softened distributions (scaled by T²), often mixed with the hard-label loss",
            "Accuracy on the teacher's argmax", "The teacher's loss"], "b",
           "KL(p_teacher^T ‖ p_student^T) · T² keeps gradient sizes comparable across temperatures (Hinton et al.)."),
        _c("why_draft", "Why distill the speculative draft from the very model it will serve?",
           ["To make the draft larger", "To raise the acceptance rate α: the draft learns the target's "
            "distribution (and shares its tokenizer)", "To skip verification", "To reduce the KV cache"], "b",
           "Speed-up depends on α; a draft that imitates the target is accepted more often, and a shared "
           "tokenizer is required for token-level verification."),
    ],
    "07": [
        _n("expected_tokens", "Acceptance rate α = 0.8, γ = 4 draft tokens per round: expected tokens produced per "
           "target forward pass, (1 − α^(γ+1)) / (1 − α)?", 3.3616,
           "(1 − 0.8^5) / 0.2 = (1 − 0.32768) / 0.2 ≈ 3.36 tokens per verification step (Leviathan et al.)."),
        _c("rejection", "In speculative sampling a draft token x is accepted with probability…",
           ["Always", "min(1, p(x) / q(x)), and on rejection one token is resampled from norm(max(0, p − q))",
            "q(x)", "0.5"], "b",
           "This rejection-sampling rule makes the output distribution exactly the target's p: speculation changes "
           "speed, never the distribution."),
        _c("when_not", "When does speculative decoding stop paying off?",
           ["At batch size 1", "At large batch sizes, where decode becomes compute-bound and verifying k tokens "
            "is no longer almost free", "With greedy sampling", "With short prompts"], "b",
           "Speculation trades spare compute for fewer memory-bound steps; a big batch already uses that compute, "
           "so the extra verified tokens cost real time."),
    ],
    "08": [
        _n("kv_tokens", "With kv_cache_memory_bytes = 128 MiB and 23,040 bytes of KV per token (SmolLM2, fp16), "
           "how many tokens fit in the cache?", 5825,
           "128 × 2^20 / 23040 = 134,217,728 / 23,040 ≈ 5,825 tokens (364 blocks of 16). That caps "
           "max_num_seqs × context length.", unit="tokens"),
        _c("fp8_kv", "Setting kv_cache_dtype='fp8' instead of fp16…",
           ["Halves KV bytes per token, so about twice the tokens (or sequences) fit",
            "Halves the weights", "Doubles the prefill speed", "Changes nothing"], "a",
           "1 byte instead of 2 per element: twice the cache capacity, at a small accuracy cost."),
        _c("budget_knob", "Raising max_num_batched_tokens generally…",
           ["Improves throughput and TTFT but lengthens steps, so ITL gets worse",
            "Improves ITL", "Has no effect with chunked prefill", "Reduces memory use"], "a",
           "A bigger per-step token budget prefills more per step (fewer steps, better utilisation) while every "
           "decode in the step waits longer: the TTFT/throughput vs ITL trade-off."),
    ],
    "09": [
        _n("ridge", "A GPU does 1,000 TFLOP/s and reads 3.35 TB/s. At what arithmetic intensity (FLOP/byte) does "
           "a kernel stop being bandwidth-bound?", 298.5,
           "Ridge point = peak FLOP/s ÷ bandwidth = 1000e12 / 3.35e12 ≈ 299 FLOP/byte. Decode at batch 1 sits "
           "near 1, prefill far above.", unit="FLOP/byte", tol=0.02),
        _n("decode_floor", "135 M parameters in fp16 on that GPU: lower bound on one batch-1 decode step, in "
           "microseconds (weights only)?", 80.6,
           "270e6 bytes / 3.35e12 B/s ≈ 80.6 µs: no kernel can beat reading the weights once.", unit="µs",
           tol=0.02),
        _c("tp", "Tensor parallelism across GPUs…",
           ["Splits each layer's weight matrices across GPUs and all-reduces activations every layer",
            "Puts different layers on different GPUs", "Runs independent copies of the model",
            "Splits the batch only"], "a",
           "TP divides the bytes each GPU reads per step (faster decode) at the cost of communication per layer; "
           "pipeline parallelism splits layers; data parallelism replicates."),
    ],
    "10": [
        _n("kv_transfer", "A 1,000-token prompt on SmolLM2 in fp16 (23,040 bytes of KV per token): how many MB "
           "(10^6 bytes) must move from the prefill worker to the decode worker?", 23.04,
           "1000 × 23,040 = 23.04 MB. Over a 25 GB/s link that is ~1 ms; the transfer must stay small next to "
           "TTFT for disaggregation to pay.", unit="MB"),
        _c("what_gains", "What does prefill/decode disaggregation mainly buy you?",
           ["Higher raw throughput on the same GPUs", "Isolation: prefill no longer interferes with decode, so "
            "TTFT and ITL can be tuned (and scaled) separately", "Smaller models", "No KV cache"], "b",
           "vLLM's docs: disaggregation does not raise throughput; it separates TTFT from ITL. DistServe reports "
           "up to 7.4× the goodput per GPU of colocated serving, against vLLM (then without chunked prefill) and "
           "DeepSpeed-MII (with chunked prefill); against chunked prefill the gain is smaller."),
        _c("ratio", "The workload shifts to much longer prompts with short answers. You should…",
           ["Add decode workers", "Add prefill workers", "Remove the router", "Disable the KV transfer"], "b",
           "Long prompts make prefill the bottleneck (TTFT suffers); the prefill:decode worker ratio follows the "
           "workload's token mix."),
    ],
    "11": [
        _n("recall", "4 documents are relevant; 2 of them appear in the top 5 retrieved. What is recall@5?", 0.5,
           "recall@k = relevant retrieved in top k ÷ all relevant = 2 / 4 = 0.5."),
        _c("followup", "Retrieval that uses only the last user turn fails most on…",
           ["First questions", "Follow-ups like 'and its population?' that refer back to earlier turns",
            "Long documents", "Numeric answers"], "b",
           "The follow-up lacks the entity; the query must carry conversation state (the entity, the user's "
           "constraints) to retrieve the right passage."),
        _c("session_state", "Compared with sending the full history to the retriever and the model, a compact "
           "session state…",
           ["Keeps the constraints that matter with far fewer tokens per query", "Always lowers recall",
            "Needs a bigger model", "Disables the prefix cache"], "a",
           "Full history grows every turn: more tokens per query for the retriever, and for the model more context "
           "to hold and attend to (prefix caching, lab 04, spares it recomputing a re-sent history, not the memory "
           "or the attention). A session state of entities and constraints stays small while keeping follow-ups "
           "answerable."),
    ],
    "12": [
        _n("goodput", "100 requests complete in 50 s; 80 of them meet both the TTFT and the TPOT SLO. Goodput in "
           "requests per second?", 1.6,
           "Goodput counts only requests within SLO: 80 / 50 s = 1.6 req/s (throughput is 2.0 req/s).",
           unit="req/s"),
        _c("sse", "How does an OpenAI-compatible server stream a completion?",
           ["One JSON document at the end", "Server-sent events: 'data: {json chunk}' lines, ending with "
            "'data: [DONE]'", "WebSocket frames", "gRPC"], "b",
           "stream=true returns text/event-stream; each chunk carries the new tokens; '[DONE]' ends the stream."),
        _c("disconnect", "A client disconnects mid-generation. The server should…",
           ["Keep generating to finish the request", "Abort the request in the engine and free its KV blocks",
            "Restart the engine", "Return HTTP 500"], "b",
           "Otherwise abandoned requests keep consuming batch slots and KV memory: a slow leak under load."),
    ],
    "13": [
        _n("bitmask_words", "A grammar bitmask packs one bit per token into int32 words. How many words per row for "
           "SmolLM2's vocabulary of 49,152 tokens?", 1536,
           "49,152 / 32 = 1,536 int32 words (6 KiB) per constrained row, instead of 49,152 booleans.", unit="words"),
        _c("greedy_mask", "After '{\"name\":\"Ana\"' the grammar allows only ',' and '}'. The model's highest logit is "
           "on ' and'. What does greedy decoding pick?",
           ["' and' (the mask only applies to sampling)", "Whichever of ',' and '}' has the higher logit",
            "The end-of-sequence token", "A random allowed token"], "b",
           "The mask sets every forbidden logit to -inf; argmax over what is left is the best allowed token."),
        _c("overlap", "Why can the engine fill the bitmasks while the forward pass runs, but not apply them?",
           ["Applying is cheaper", "Filling needs only the tokens accepted so far; applying needs this step's "
            "logits, which the forward produces", "The GPU cannot apply masks", "Filling is done by the model"], "b",
           "The matcher state is known before the step starts, so its mask can be computed in parallel (vLLM: "
           "execute_model non-blocking, then get_grammar_bitmask); the -inf can only be written into logits that exist."),
        _c("spec", "With speculative decoding, a draft proposes a token the grammar refuses. What happens?",
           ["The grammar is relaxed for that step", "The output becomes invalid", "The guess is rejected (its masked "
            "probability is 0) and the verifier's constrained token replaces it: output unchanged",
            "The request is aborted"], "c",
           "Each verified row gets the mask of the state after the guesses before it, so the verifier samples from the "
           "constrained distribution at every position: speculation stays lossless."),
    ],
    "14": [
        _n("block_kb", "SmolLM2-135M has 30 layers, 3 KV heads of dimension 64. How many kB does one 16-token KV block "
           "take in fp32 (K and V, every layer)?", 737.28,
           "2 (K and V) x 30 layers x 3 heads x 64 x 4 bytes = 46,080 bytes a token; x 16 tokens = 737,280 bytes.",
           unit="kB"),
        _c("exclusive", "The host tier hands a block back to the device and forgets it (exclusive). What does that buy?",
           ["Nothing: it only saves a lookup", "The device pool and the tier hold different blocks, so their capacities "
            "add up and no copy can go stale", "Faster copies", "Fewer prefix-cache hits"], "b",
           "A block lives in exactly one place; the price is copying it out again if the device evicts it again."),
        _c("parent", "Why must promote never evict one of `hits` to make room?",
           ["It would be slower", "Those blocks are the prompt's earlier blocks: evicting one leaves the promoted block "
            "without its parent, and the request would attach a block whose K/V is now someone else's",
            "The tier would overflow", "hits are always referenced"], "b",
           "The walk has already counted them as this prompt's prefix; reusing one of them for the promoted block "
           "overwrites K/V the request will read."),
        _c("gpu_small_model", "On an H200 over PCIe 5 (64 GB/s each way), for which model does copying a prefix back "
           "beat recomputing it by the widest margin?",
           ["SmolLM2-135M", "Llama-3.1-70B", "All equal", "Neither: recomputing always wins"], "b",
           "Recompute grows with parameters (2 x params FLOPs a token); KV bytes grow only with layers x KV heads x head "
           "dim, which GQA keeps small. 70B: ~56x, 8B: ~16x, SmolLM2: ~1.5x."),
        _c("store_sources", "Two prefill workers share a KV store. A conversation's turn 0 ran on worker 0, turn 1 on "
           "worker 1, and turn 2 goes to worker 0 again (nothing evicted). Where does turn 2's prompt come from?",
           ["All recomputed: worker 0 never saw turn 1", "Turn 0's part from worker 0's device, turn 1's additions "
            "from the store, only the new message computed", "All of it from the store", "All of it from worker 0's "
            "device"], "b",
           "The prefix walk takes what the device holds first (turn 0's blocks, which worker 0 computed), then asks "
           "the store for the next blocks, which worker 1 published after its prefill; the new message is computed."),
        _c("store_names", "Why does the shared store name a block by a BLAKE2b chain over its token ids, not by the "
           "engine's own prefix-hash names?",
           ["BLAKE2b is faster", "The engine's names come from Python's hash, which promises nothing across "
            "processes: another worker may name the same tokens otherwise", "To save memory",
            "Names must be 16 bytes for the socket"], "b",
           "The engine's chain starts at hash(None): up to CPython 3.11 it comes from None's address and differs in "
           "every process (constant from 3.12, but Python's hash is no cross-process contract and not collision "
           "resistant). A name another process must find is computed from the tokens alone. vLLM roots its chain "
           "at NONE_HASH (vllm/v1/core/kv_cache_utils.py, init_none_hash): a fixed seed with sha256, its default, "
           "random bytes per process with xxhash, PYTHONHASHSEED where set: instances sharing block names set it "
           "to one value."),
        _n("store_read_mb", "A returning turn reads 12 blocks of 16 tokens of SmolLM2-135M (fp32, 46,080 bytes of K/V "
           "a token) from the store. How many MB cross the store's socket?", 8.85,
           "12 x 16 tokens x 46,080 bytes = 8,847,360 bytes, about 8.85 MB: copied by value through the socket, "
           "where Mooncake would move them over RDMA.", unit="MB"),
    ],
    "15": [
        _n("fanout_prefill", "8 sub-tasks share a 400-token instruction prefix and add 20 tokens each; they are sent in "
           "the same instant to this course's engine (it names a block once the block is computed) with an empty "
           "prefix cache. How many prompt tokens does it compute?", 3360,
           "Admitted in one step, none finds the others' blocks (none is named yet): 8 x 420 = 3,360. Fanned out "
           "after the first's prompt, about 400 + 8 x 20 = 560. vLLM names a block when it schedules it "
           "(vllm/v1/core/kv_cache_manager.py: allocate_slots calls cache_blocks), so there the same-step requests "
           "already share the prefix: also 560.", unit="tokens"),
        _c("cached_bill", "A request's usage says prompt_tokens 1,000, cached_tokens 960. What did the engine "
           "compute for its prompt?",
           ["1,000 tokens", "40 tokens (the rest came from the prefix cache)", "960 tokens", "1,960 tokens"], "b",
           "Cached tokens are not run through the model: only 1,000 - 960 = 40 are prefilled."),
        _c("router_side", "A cascade (the small model answers first, as in FrugalGPT) keeps the small model's answer "
           "when the small model's confidence in it is...",
           ["below the threshold", "at or above the threshold", "exactly the threshold", "unknown: it waits for the "
            "target's answer"], "b",
           "Confident requests stay on the cheap model; doubtful ones go to the target. A signal that needs the "
           "target's answer would cost what the cascade saves (and leaks the answer into the decision). A router "
           "such as RouteLLM decides from the query alone, before any model runs."),
        _n("compress_cost", "Before each request, a compressor scored by the target itself halves a 2,000-token "
           "history (it reads every token's surprisal, then drops the least surprising words). Counting its scoring "
           "pass, how many prompt tokens does the target prefill for one request?", 3000,
           "Scoring is a full prefill of the 2,000 tokens (with their log-probabilities); the compressed prompt then "
           "costs 1,000 more. It pays only when one compressed prompt serves many requests, or when a much smaller "
           "model scores.", unit="tokens"),
    ],
    "16": [
        _n("kv_bytes_call", "SmolLM2-135M has 3 KV heads of dim 64. One layer's decode attention for one sequence at "
           "context 4,096 in bf16 (2 bytes an element): how many bytes of K and V does it read?", 3145728,
           "2 (K and V) x 4,096 positions x 3 heads x 64 dims x 2 bytes = 3,145,728 bytes (3 MiB), for "
           "4 x 4,096 x 9 x 64 = 9.4 MFLOP: a third of a byte per FLOP, far above any GPU's ridge (an H100's is "
           "about 0.0034 bytes per FLOP).", unit="bytes"),
        _c("online_softmax", "Why does the kernel keep a running maximum of the scores?",
           ["to skip blocks whose scores are small", "so exp() never overflows, in one pass over K and V without a "
            "row of scores", "because Triton has no exp() of large numbers on a CPU", "to sort the positions"], "b",
           "Scores of a few hundred overflow float32's exp(); subtracting the maximum keeps every exponential <= 1. "
           "When the maximum grows, what was summed is rescaled by exp(old - new): the result is exact and the "
           "bytes are read once (Milakov and Gimelshein, 2018; FlashAttention)."),
        _c("split_combine", "Two split-KV slices of one head have outputs o1, o2 and log-sum-exps lse1 = 2.0, "
           "lse2 = 2.0 + ln 3. The combined output is...",
           ["(o1 + o2) / 2", "(o1 + 3 o2) / 4", "(3 o1 + o2) / 4", "o2"], "b",
           "Slice k holds the share e^(lse_k) / sum e^(lse) of the softmax mass: 1 : 3 here, so (o1 + 3 o2) / 4. "
           "Averaging the slices is right only when they hold equal mass."),
        _c("split_when", "When does split-KV (FlashDecoding) speed up decode attention on a GPU?",
           ["at large batch and short context", "at small batch and long context, where batch x heads programs "
            "leave most multiprocessors idle", "always by the number of splits", "only under Triton's interpreter"],
           "b",
           "With B x Hq programs of long loops the GPU's SMs idle at batch 1; more programs over slices fill them. "
           "At large batch there are already enough programs and the combine is pure overhead."),
    ],
}


def _lab_key(lab: str | int) -> str:
    key = f"{lab:02d}" if isinstance(lab, int) else str(lab).split("_", 1)[0]
    if key.isdigit():
        key = f"{int(key):02d}"
    if key not in QUESTIONS:
        raise ValueError(f"no quiz for lab {lab!r}; labs with quizzes: {', '.join(QUESTIONS)}")
    return key


def questions(lab: str | int) -> list[Question]:
    return list(QUESTIONS[_lab_key(lab)])


def get(lab: str | int, qid: str) -> Question:
    for q in QUESTIONS[_lab_key(lab)]:
        if q.qid == qid:
            return q
    raise ValueError(f"lab {lab!r} has no question {qid!r}; its questions: "
                     f"{', '.join(q.qid for q in QUESTIONS[_lab_key(lab)])}")


def grade(q: Question, answer: Any) -> Feedback:
    """Check one answer; the explanation always comes back, right or wrong."""
    if q.kind == "choice":
        letters = q.letters()
        given = str(answer).strip().lower().strip("()")
        if given not in letters:
            by_text = [ltr for ltr, opt in zip(letters, q.options) if opt.strip().lower() == given]
            if not by_text:
                return Feedback(False, f"Answer with one of the letters {', '.join(letters)} (got {answer!r}).",
                                q.explanation)
            given = by_text[0]
        if given == q.answer:
            return Feedback(True, f"Correct: ({given}).", q.explanation)
        return Feedback(False, f"Not quite: ({given}) is not the answer.", q.explanation)
    try:
        value = float(str(answer).replace(",", "").replace("_", "")) if isinstance(answer, str) else float(answer)
    except (TypeError, ValueError):
        return Feedback(False, f"Answer with a number (got {answer!r}).", q.explanation)
    target = float(q.answer)
    ok = math.isfinite(value) and math.isclose(value, target, rel_tol=q.tol, abs_tol=1e-9)
    unit = f" {q.unit}" if q.unit else ""
    if ok:
        return Feedback(True, f"Correct: {target:g}{unit}.", q.explanation)
    return Feedback(False, f"Not quite: {value:g}{unit} is off.", q.explanation)


def ask(lab: str | int, qid: str, answer: Any) -> Feedback:
    """`quiz.ask("00", "kv_bytes", 23040)`: grade one answer. The result is truthy when correct."""
    return grade(get(lab, qid), answer)


def as_text(lab: str | int) -> str:
    key = _lab_key(lab)
    body = "\n\n".join(q.text() for q in QUESTIONS[key])
    return (f"Self-check, lab {key}. Answer with quiz.ask({key!r}, '<id>', <answer>): "
            f"a letter or a number.\n\n{body}")


def _interactive_default() -> bool:
    return os.environ.get("LAB_INTERACTIVE", "1") == "1"


def widget(lab: str | int):
    """An ipywidgets panel: one block per question, a Check button, feedback with the explanation."""
    import ipywidgets as w

    blocks = []
    for q in questions(lab):
        prompt = w.HTML(f"<b>{q.prompt}</b>")
        if q.kind == "choice":
            inp = w.RadioButtons(options=[(f"({ltr}) {opt}", ltr) for ltr, opt in zip(q.letters(), q.options)],
                                 value=None, layout=w.Layout(width="auto"))
        else:
            inp = w.Text(placeholder=f"a number{' in ' + q.unit if q.unit else ''}")
        button = w.Button(description="Check", button_style="info")
        feedback = w.HTML()

        def on_click(_btn, q=q, inp=inp, feedback=feedback):
            if inp.value in (None, ""):
                feedback.value = "<i>Pick or type an answer first.</i>"
                return
            fb = grade(q, inp.value)
            color = "#17702c" if fb.correct else "#b00020"
            feedback.value = f"<span style='color:{color}'><b>{fb.message}</b></span><br>{fb.explanation}"

        button.on_click(on_click)
        blocks.append(w.VBox([prompt, inp, button, feedback], layout=w.Layout(margin="0 0 1em 0")))
    return w.VBox(blocks)


def show(lab: str | int, interactive: bool | None = None) -> None:
    """Display the quiz: widgets when interactive (default: env LAB_INTERACTIVE, else on), else plain text."""
    interactive = _interactive_default() if interactive is None else interactive
    if interactive:
        from IPython.display import display

        display(widget(lab))
    else:
        print(as_text(lab))
