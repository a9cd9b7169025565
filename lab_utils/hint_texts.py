"""The three levels of help for each exercise, by exercise id (`<lab>.<function>`): the idea, the steps in
words, pseudo-code. Read through `lab_utils.hints.hint`; tests/unit/test_hints.py holds level 1 to a measured
distance from the solution's code and checks that level 3 is not Python."""
from __future__ import annotations

HINTS: dict[str, tuple[str, str, str]] = {
    # ------------------------------------------------------------------------------------------- lab 00
    "00.rope": (
        "Every pair (i, i + D/2) of a head is a 2-D point to turn by an angle: the token's position times a "
        "frequency that shrinks as i grows. rotate_half does the swap-and-negate half of a 2-D rotation, so the "
        "rotation is x times the cosine plus rotate_half(x) times the sine, the angles broadcast over the heads.",
        "1. D is the size of x's last axis.\n"
        "2. Build the D/2 frequencies theta^(-2i/D), i = 0 .. D/2 - 1, in float32.\n"
        "3. Multiply the positions [B, T] by them: angles [B, T, D/2].\n"
        "4. Repeat the angles to D (both halves of the head share them) and add a head axis: [B, T, 1, D].\n"
        "5. Combine x with the cosines and rotate_half(x) with the sines, cast to x's dtype.",
        "D ← size of x's last axis\n"
        "freq[i] ← 1 / theta^(2i / D)                 for i in 0 … D/2 − 1\n"
        "angle[b, t, i] ← positions[b, t] · freq[i]\n"
        "angle ← angle joined with itself on the last axis, plus a head axis      → [B, T, 1, D]\n"
        "answer  x · cos(angle) + rotate_half(x) · sin(angle)       (cos and sin in x's dtype)",
    ),
    "00.cached_attention": (
        "Two things happen: the cache grows by one row (the new token's K/V after the old ones), then it is plain "
        "scaled dot-product attention of one query over all S + 1 keys. The twist is grouped-query attention: each "
        "KV head serves Hq // Hkv neighbouring query heads, so repeat it that many times.",
        "1. Put the new K after the cached K on the sequence axis (dim 1); the same for V.\n"
        "2. group = Hq // Hkv; repeat each KV head group times on the head axis, copies side by side "
        "(0, 0, 0, 1, 1, 1, ...), so query head h meets KV head h // group.\n"
        "3. Scores: the query's dot product with every key, per head, divided by sqrt(D): [B, Hq, 1, S + 1].\n"
        "4. Softmax over the keys.\n"
        "5. Weighted sum of the values: [B, 1, Hq, D].\n"
        "6. Return it with the two grown caches.",
        "K ← k_cache followed by k_new on the sequence axis;   V ← likewise\n"
        "group ← Hq / Hkv\n"
        "K_rep, V_rep ← every KV head repeated `group` times in place          (head axis)\n"
        "score[b, h, k] ← Σ_d q[b, 0, h, d] · K_rep[b, k, h, d] / √D\n"
        "weight ← softmax of score over k\n"
        "out[b, 0, h, :] ← Σ_k weight[b, h, k] · V_rep[b, k, h, :]\n"
        "answer ⟨out, K, V⟩",
    ),
    # ------------------------------------------------------------------------------------------- lab 01
    "01.schedule_continuous": (
        "A step is either all prefill or all decode (prefill first). Clear out the finished requests, then admit "
        "waiting prompts strictly in arrival order while they fit; only when nobody could be admitted does every "
        "running request get its next token.",
        "1. Start an empty SchedulerOutput.\n"
        "2. Keep only the running requests that are not done.\n"
        "3. The budget is max_num_batched_tokens. While someone waits and a slot is free: look at the head of the "
        "queue; its need is its tokens minus those already computed. If the need exceeds the budget or the "
        "capacity check refuses it, stop (nobody overtakes). Otherwise start it and use the count start gives "
        "back, not your own (a cache may already hold part of the prompt); schedule that count and spend it.\n"
        "4. If anything was admitted, that is the step.\n"
        "5. Otherwise, for each running request (walk a copy: making room may change the list) that is still "
        "RUNNING, ask make_room for one more token and schedule one token if it agrees.",
        "out ← empty step\n"
        "running ← running without the finished requests\n"
        "budget ← token budget\n"
        "while the queue is not empty and fewer than max_num_seqs run:\n"
        "    head ← first in queue;   need ← head's tokens − head's computed tokens\n"
        "    stop admitting when need > budget or the capacity check refuses ⟨head, need⟩\n"
        "    got ← start(head, need)                    ← keep what start answers\n"
        "    out gets ⟨head, got⟩;   budget ← budget − got\n"
        "if out has pairs: answer out\n"
        "for each r in a copy of running:\n"
        "    when r is RUNNING and make_room(r, its computed + 1, out) agrees: out gets ⟨r, 1⟩\n"
        "answer out",
    ),
    "01.stop_reason": (
        "Check the reasons in priority order and answer with the first that holds: first what the token is (an "
        "end-of-sequence token the request does not ignore, or one of its own stop tokens), then how long the "
        "request has become (its output budget, then the model's context length).",
        "1. Take the request's sampling parameters.\n"
        "2. The token is an end-of-sequence id and the request does not ignore EOS: \"stop\".\n"
        "3. The token is one of the request's stop token ids: \"stop\" (even when EOS is ignored).\n"
        "4. The output tokens (the prompt does not count) have reached max_tokens: \"length\".\n"
        "5. All tokens together have reached max_model_len: \"length\".\n"
        "6. Otherwise None.",
        "params ← the request's sampling parameters\n"
        "token ∈ eos_ids and EOS not ignored          → \"stop\"\n"
        "token ∈ the request's stop token ids          → \"stop\"\n"
        "output tokens so far ≥ max_tokens             → \"length\"\n"
        "all tokens so far ≥ max_model_len             → \"length\"\n"
        "otherwise                                     → None",
    ),
    # ------------------------------------------------------------------------------------------- lab 02
    "02.grow": (
        "Work out how many blocks are missing before taking any: all or nothing means you decide first, then "
        "act. A table that already covers num_tokens needs nothing.",
        "1. Blocks needed for num_tokens (the manager has a helper for the ceiling division) minus the blocks "
        "the table already holds: the missing count.\n"
        "2. If the pool has fewer free blocks than that, answer False at once, having taken nothing.\n"
        "3. Otherwise take one block from the manager per missing block (its helper sets the reference count, "
        "and in lab 04 evicts when it must) and add each at the end of the table.\n"
        "4. Answer True.",
        "missing ← blocks needed for num_tokens − length of req's table\n"
        "missing > free blocks → False                 (nothing taken)\n"
        "repeat missing times:  req's table gets a freshly taken block at its end\n"
        "→ True",
    ),
    "02.release": (
        "A block is reusable only when its last user lets go: count down, and act only at zero.",
        "1. Find the Block object of block_id in the manager's list of blocks.\n"
        "2. Lower its reference count by one.\n"
        "3. If the count is now zero, give the id to the manager's recycle method (it decides between the free "
        "list and the cache). Never recycle a block someone still uses.",
        "b ← the manager's block number block_id\n"
        "b's reference count ← one less\n"
        "b's count is now zero → recycle block_id",
    ),
    "02.make_room": (
        "A loop: try to grow; each time it fails, free memory by preempting the youngest running request, note "
        "it, and try again. The only way out without room is that the request you make room for was itself the "
        "youngest.",
        "1. Ask the block manager to grow req to num_tokens.\n"
        "2. If that failed: the victim is the last of the running list (the newest). Preempt it with the "
        "scheduler's own method and note it in the step's list of preempted requests.\n"
        "3. If the victim was req itself, answer False (it gave way).\n"
        "4. Otherwise go back to 1.\n"
        "5. Once the grow succeeds, answer True.",
        "loop until the manager manages to grow req to num_tokens:\n"
        "    v ← newest running request\n"
        "    preempt v;   note v among out's preempted\n"
        "    v is the request we make room for → False\n"
        "→ True",
    ),
    "02.preempt": (
        "Undo the admission so that the request can come back later: out of the batch, its memory given back, "
        "and back at the head of the queue (it was admitted before everyone still waiting); two counters record "
        "that it happened. What it keeps depends on the engine's preemption mode: recompute forgets the work done "
        "and redoes it from the tokens; swap keeps the work, so its KV has to be copied somewhere else before "
        "the blocks that hold it are handed to others.",
        "1. Take req out of the running list.\n"
        "2. Count the preemption on the scheduler and in the request's own metrics.\n"
        "3. Look at the engine's configuration: which preemption mode is it?\n"
        "4. Swap: first have the scheduler's swap-out hook copy req's KV to host memory (it reads req's blocks), "
        "then free the blocks through the block manager; the computed-token count stays, the status becomes "
        "swapped.\n"
        "5. Recompute: free the blocks through the block manager; the computed-token count goes back to zero (its "
        "KV is gone) and the status back to waiting.\n"
        "6. Either way, put it at the front of the waiting deque, not at the back.",
        "running ← running without req\n"
        "scheduler's preemption count + 1;   req's metrics preemption count + 1\n"
        "mode is swap →\n"
        "    copy req's KV to host memory (the swap-out hook)      ← while req still holds its blocks\n"
        "    the block manager frees everything req holds;   status ← SWAPPED   (computed tokens stay)\n"
        "otherwise →\n"
        "    the block manager frees everything req holds\n"
        "    req: computed tokens ← 0,  status ← WAITING\n"
        "waiting ← req ahead of everyone",
    ),
    "02.slot_mapping": (
        "Each sequence contributes only the positions this step computes: its last query_len positions before "
        "context_len. A position's slot is the first slot of its physical block plus its offset inside the "
        "block.",
        "1. Walk the three lists together, one sequence at a time.\n"
        "2. The positions computed this step run from context length minus query length up to context length "
        "minus one.\n"
        "3. For each position: logical block = position // block size, offset = the remainder; the physical "
        "block is the table's entry for that logical block; slot = physical block × block size + offset.\n"
        "4. Append the slots, in that order, to one flat list and return it.",
        "slots ← empty list\n"
        "for each sequence ⟨table, ctx, q⟩:\n"
        "    for each position p from ctx − q up to ctx − 1:\n"
        "        slots gets  table[⌊p / block_size⌋] · block_size + (p mod block_size)\n"
        "answer slots",
    ),
    "02.gather_kv": (
        "The same slot formula as in slot_mapping, for every position of the sequence from 0; then one indexing "
        "operation with all the slots at once picks the rows in token order.",
        "1. For each position p from 0 to context_len - 1, its slot through the block table.\n"
        "2. Make the slots one long integer tensor on the cache's device.\n"
        "3. Index the cache's first axis with it: the rows come back in the order of the slots, token order.",
        "slot(p) ← table[⌊p / block_size⌋] · block_size + (p mod block_size)\n"
        "index ← integer tensor of slot(p) for p = 0 … context_len − 1          (on the cache's device)\n"
        "answer  the cache's rows picked by index",
    ),
    # ------------------------------------------------------------------------------------------- lab 03
    "03.schedule_token_budget": (
        "The budget is shared and the running batch has first claim: decodes and unfinished prefills before "
        "anyone new. New prompts fill what is left, the last one taking only a chunk; nobody new joins a step in "
        "which memory was so short that someone was preempted.",
        "1. An empty output; drop finished requests from running; the budget is the token budget.\n"
        "2. For each running request, oldest first (walk a copy): stop when the budget is spent; skip it if it "
        "is no longer RUNNING (preempted a moment ago); its share is the smaller of its tokens left and the "
        "budget; if make_room grows it to its computed tokens plus the share, schedule it and spend the share.\n"
        "3. If the output lists a preempted request, return it now.\n"
        "4. While someone waits, budget remains and a slot is free: the head's share is the smaller of its tokens "
        "left and the budget; stop if it cannot start with that; otherwise start it, schedule the count start "
        "answers (a prefix-cache hit makes it smaller) and spend that.\n"
        "5. Return the output.",
        "out ← empty step;   running ← running without finished;   budget ← token budget\n"
        "for each r in a copy of running, oldest first:\n"
        "    stop once budget ≤ 0;   skip r unless RUNNING\n"
        "    share ← min(r's tokens left, budget)\n"
        "    make_room(r, r's computed + share, out) agrees → out gets ⟨r, share⟩, budget ← budget − share\n"
        "out lists preempted requests → answer out\n"
        "while the queue is not empty, budget > 0 and a slot is free:\n"
        "    head ← first in queue;   share ← min(head's tokens left, budget)\n"
        "    stop when head cannot start with share\n"
        "    got ← start(head, share);   out gets ⟨head, got⟩;   budget ← budget − got\n"
        "answer out",
    ),
    # ------------------------------------------------------------------------------------------- lab 04
    "04.hash_block": (
        "A block's name must stand for the whole prefix up to it, not only for its own tokens: make the parent's "
        "name part of what you hash. Python's built-in hash takes tuples.",
        "1. Put the parent's name and the block's token tuple together in one tuple.\n"
        "2. Return the built-in hash of that pair (None or an int, and a tuple of ints: both hashable).",
        "answer  the built-in hash of the pair ⟨parent_hash, token_ids⟩",
    ),
    "04.match_prefix": (
        "Walk the prompt block by block, naming each block the way commit_full_blocks names it (chained from the "
        "previous name), and look each name up; the first miss ends the prefix. Mind the off switch, the limit "
        "that leaves one prompt token to compute, and that a name found is only a candidate until the stored "
        "tokens agree.",
        "1. Prefix caching off: answer an empty list.\n"
        "2. Look at (prompt tokens - 1) // block size blocks at most.\n"
        "3. Start with no parent name. For block i: its tokens are prompt ids i·B up to (i+1)·B, as a tuple; its "
        "name is hash_block(previous name, those tokens); look the name up in hash_to_block.\n"
        "4. No entry, or that block's stored token_ids differ: stop.\n"
        "5. Otherwise collect the block id and carry the name on.\n"
        "6. Answer the collected ids.",
        "caching off → []\n"
        "found ← [];   name ← nothing\n"
        "for i in 0 … (prompt length − 1) div B − 1:\n"
        "    ids ← tuple of the prompt ids from i·B up to (i+1)·B\n"
        "    name ← hash_block(name, ids)\n"
        "    bid ← what hash_to_block holds for name (maybe nothing)\n"
        "    stop when nothing, or block bid's stored ids ≠ ids\n"
        "    found gets bid\n"
        "answer found",
    ),
    "04.commit_full_blocks": (
        "Name blocks in the same chained way match_prefix looks them up, over req.token_ids (prompt and "
        "output) and only as far as tokens are computed. A name once given stays, and a name already in the map "
        "belongs to the first block that got it.",
        "1. Caching off: do nothing.\n"
        "2. The full blocks are the first (computed tokens // block size).\n"
        "3. Walk them in order with a running parent name, from none: block i's tokens are token_ids i·B up to "
        "(i+1)·B as a tuple; chain the name with hash_block.\n"
        "4. Fetch the Block object of the table's i-th id.\n"
        "5. If it has no name yet, store the name and the token tuple on it, and register name → its id in "
        "hash_to_block without overwriting an entry that is already there. Keep chaining the name through "
        "blocks that were already named.",
        "caching off → stop\n"
        "parent ← nothing\n"
        "for i in 0 … (computed tokens div B) − 1:\n"
        "    ids ← tuple of req's token ids from i·B up to (i+1)·B\n"
        "    parent ← hash_block(parent, ids)\n"
        "    blk ← block object of table entry i\n"
        "    blk has no name yet →\n"
        "        blk's name ← parent;   blk's ids ← ids\n"
        "        hash_to_block maps parent → blk's id, unless parent is there already",
    ),
    "04.recycle": (
        "A block whose name the cache can still find is worth keeping, since someone may ask for those tokens "
        "again; anything else is plain free memory. 'Can still find' means the name map points at this very "
        "block, not at a copy of the same tokens.",
        "1. Get the Block object.\n"
        "2. It has a name and the name map's entry for that name is this block id: add the id at the most "
        "recent end of the evictable OrderedDict (the value does not matter).\n"
        "3. Otherwise clear its name (None) and its token ids (an empty tuple), and push the id on the free "
        "list.",
        "blk ← block object of block_id\n"
        "blk has a name and hash_to_block maps that name to block_id →\n"
        "    evictable gets block_id at its newest end\n"
        "otherwise →\n"
        "    blk's name ← nothing;   blk's ids ← empty\n"
        "    the free list gets block_id",
    ),
    "04.evict": (
        "recycle adds at the end of the OrderedDict, so the least recently used block is at its front. Taking a "
        "block out of the cache means its name must no longer lead anywhere.",
        "1. Pop the oldest item of evictable (an OrderedDict can pop from its front).\n"
        "2. Get its Block.\n"
        "3. If the name map still maps its name to this id, delete that entry.\n"
        "4. Clear the block's name and token ids.\n"
        "5. Return the id.",
        "bid ← the oldest entry, popped off evictable\n"
        "blk ← block object of bid\n"
        "hash_to_block maps blk's name to bid → remove that entry\n"
        "blk's name ← nothing;   blk's ids ← empty\n"
        "answer bid",
    ),
    # ------------------------------------------------------------------------------------------- lab 05
    "05.encode_e4m3": (
        "Sign first, then the magnitude. A magnitude lives in a binade [2^e, 2^(e+1)) holding 8 steps of "
        "2^(e-3); subnormals use the smallest normal binade's spacing. Rounding the magnitude to a whole number of "
        "steps gives the mantissa, unless the rounding carries into the next binade.",
        "1. NaN: 0x7F.\n"
        "2. The sign bit is 0x80 when x is negative (copysign also catches -0.0).\n"
        "3. Clamp |x| to 448; a zero is just the sign.\n"
        "4. e = the binade exponent of |x| (math.frexp's exponent minus one), never below -6.\n"
        "5. steps = |x| / 2^(e-3), rounded (Python's round is half to even).\n"
        "6. 16 steps means the rounding carried: the next binade, 8 steps.\n"
        "7. Fewer than 8 steps: subnormal, the byte is the sign with the steps.\n"
        "8. Otherwise the sign, (e + 7) shifted left by 3, and steps - 8.",
        "NaN → 0x7F\n"
        "s ← 0x80 when x is negative (−0.0 too), else 0\n"
        "a ← min(|x|, 448);   a is zero → s\n"
        "e ← max(binade exponent of a, −6)             (a ∈ [2^e, 2^(e+1)))\n"
        "k ← round-half-even(a / 2^(e−3))\n"
        "k = 16 → e ← e + 1, k ← 8\n"
        "k < 8 → s OR k                                (subnormal)\n"
        "otherwise → s OR ((e + 7) shifted left by 3) OR (k − 8)",
    ),
    "05.quantize_per_channel_int8": (
        "Symmetric quantization with one scale per output row: the row's largest magnitude lands exactly on 127, "
        "so nothing clips and the grid is as fine as it can be.",
        "1. Per row, the largest absolute value (keep the axis so that it stays [out, 1]).\n"
        "2. scale = that / 127, but 1 where the row is all zero (a zero scale would divide by zero).\n"
        "3. Divide w by its row's scale, round to nearest, clamp to ±127.\n"
        "4. Cast to int8 and return (q, scale).",
        "amax[r] ← max over row r of |w|                    (shape out × 1)\n"
        "scale[r] ← amax[r] / 127, or 1 when amax[r] is 0\n"
        "q ← round(w ÷ scale) limited to −127 … 127, as int8\n"
        "answer ⟨q, scale⟩",
    ),
    "05.dequantize_int8": (
        "Dequantization undoes the division: every integer times its row's scale; broadcasting takes care of "
        "'its row'.",
        "1. Convert q to float32.\n"
        "2. Multiply by scale; its [out, 1] shape stretches along each row.\n"
        "3. Return the product.",
        "answer  q as float32 × scale          (scale's out × 1 spread over each row)",
    ),
    "05.quantize_per_group_int4": (
        "As per-channel INT8, but per group of inputs and to ±7, with one more care: the layer keeps the scale in "
        "fp16, so the integers must be computed against the fp16 value, and that value must not be smaller than "
        "the exact one (or the largest weight of the group would need an eighth step).",
        "1. View w as [out, groups, group_size], in float32.\n"
        "2. Per group, the largest |value| / 7, or 1 for an all-zero group (keep the last axis for broadcasting).\n"
        "3. Convert the scale to fp16; where the fp16 value came out below the float32 one, move it up to the "
        "next fp16 number (torch.nextafter towards +inf).\n"
        "4. q = the group divided by the fp16 scale (as float32), rounded, clamped to ±7, int8, in w's shape.\n"
        "5. Return q and the fp16 scale without the kept axis: [out, groups].",
        "g ← w in float32, viewed as out × groups × group_size\n"
        "s ← (max over each group of |g|) / 7, or 1 for an all-zero group\n"
        "h ← s in fp16, moved up to the next fp16 value wherever h < s\n"
        "q ← round(g ÷ h) limited to −7 … 7, as int8, viewed as out × in\n"
        "answer ⟨q, h as out × groups⟩",
    ),
    "05.dequantize_int4": (
        "Each integer is multiplied by the scale of its group: reshape so that a group is one axis, and "
        "broadcasting does the rest.",
        "1. Convert q to scale's dtype.\n"
        "2. View it as [out, groups, group_size].\n"
        "3. Multiply by the scale with a trailing axis added ([out, groups, 1]).\n"
        "4. View the product back as [out, in].",
        "g ← q in scale's dtype, viewed as out × groups × group_size\n"
        "answer  (g × scale with one more trailing axis) viewed as out × in",
    ),
    "05.fp8_encode": (
        "torch rounds to E4M3 for you (the dtype torch.float8_e4m3fn); what the pool cannot do is store float8, "
        "so you keep the bytes. Two traps: E4M3 has no infinity (saturate first), and converting to uint8 is not "
        "reinterpreting as uint8.",
        "1. Clamp x to [-448, 448].\n"
        "2. Cast to torch.float8_e4m3fn (round to nearest, ties to even).\n"
        "3. Reinterpret the bytes as uint8 with .view (.to would convert the numbers and lose the bits).\n"
        "4. Return that.",
        "answer  x limited to ±448 → cast to float8 e4m3fn → the same bytes seen as uint8",
    ),
    "05.fp8_decode": (
        "Exercise 1 backwards, with tensor operations: pull the three bit fields out with shifts and masks, "
        "compute the magnitude for normal and for subnormal bytes, pick per element, then apply the sign.",
        "1. Widen the bytes to an int32 tensor so shifts are safe.\n"
        "2. sign = bit 7; exponent = bits 6..3 (shift right by 3, mask 15); mantissa = bits 2..0 (mask 7).\n"
        "3. Normal: (8 + mantissa) · 2^(exponent - 10), the same as (1 + m/8) · 2^(e - 7).\n"
        "4. Subnormal (exponent 0): mantissa · 2^-9.\n"
        "5. Pick per element, negate where the sign is 1, convert to dtype.",
        "b ← bits widened to int32\n"
        "sign ← b shifted right by 7;   e ← (b shifted right by 3) AND 15;   m ← b AND 7\n"
        "v ← m · 2^−9 where e = 0, else (8 + m) · 2^(e − 10)\n"
        "answer  −v where sign is 1, else v, in dtype",
    ),
    # ------------------------------------------------------------------------------------------- lab 06
    "06.kd_loss": (
        "Soften both distributions with the same temperature, compare them with KL in the teacher → student "
        "direction, average over positions, and rescale by T² so that the loss does not fade as T grows. Stay "
        "in log space: it does not underflow.",
        "1. Teacher log-probabilities: log-softmax of teacher logits / T over the vocabulary axis; the same for "
        "the student.\n"
        "2. Teacher probabilities: the exponential of its log-probabilities.\n"
        "3. Per row: the sum over the vocabulary of p · (log p - log q).\n"
        "4. The mean over rows.\n"
        "5. Times T².",
        "log_p ← log-softmax(teacher / T) over the vocabulary\n"
        "log_q ← log-softmax(student / T) over the vocabulary\n"
        "kl[row] ← Σ_v e^log_p · (log_p − log_q)\n"
        "answer  T² · mean of kl over the rows",
    ),
    # ------------------------------------------------------------------------------------------- lab 07
    "07.residual": (
        "After a rejection, sample only where the target wants more than the draft offered: the positive part of "
        "p - q, renormalised. Guard the case where nothing is positive.",
        "1. Subtract q from p and clip the negatives to 0.\n"
        "2. Sum it.\n"
        "3. If the sum is zero, return p unchanged.\n"
        "4. Otherwise divide by the sum.",
        "r ← elementwise max(p − q, 0)\n"
        "answer  p when Σ r is 0, else r / Σ r",
    ),
    "07.accept_reject": (
        "Walk the guesses left to right; each faces its own uniform u[i] against its acceptance ratio. The first "
        "rejection ends the walk and says which row's residual to sample from; surviving them all earns the "
        "bonus row.",
        "1. For each guess, with its index i and token x: the acceptance probability is min(1, the target's "
        "probability of x in row i / the draft's probability of x in row i).\n"
        "2. If u[i] is not below it, the guess is rejected: return (i, the residual of row i of p and q).\n"
        "3. If the walk ends, every guess was kept: return (k, row k of p).",
        "for each position i with guess x:\n"
        "    a ← min(1, p at ⟨i, x⟩ ÷ q at ⟨i, x⟩)\n"
        "    u[i] ≥ a → answer ⟨i, residual(row i of p, row i of q)⟩\n"
        "answer ⟨k, row k of p⟩",
    ),
    "07.verify_greedy": (
        "Greedy means the target would have taken its argmax at every position. Compare the guesses with those "
        "argmaxes one by one; the first disagreement is replaced by the target's choice, and if there is none, "
        "the last row gives one token more.",
        "1. Take the argmax of every row of logits (k + 1 tokens).\n"
        "2. For each guess in order: if it differs from the argmax at its position, return the guesses before it "
        "followed by that argmax.\n"
        "3. All agreed: return every guess followed by the argmax of row k.",
        "best ← argmax of each row of logits, as a list\n"
        "for each position i with guess x:\n"
        "    x differs from best[i] → answer  the guesses before i, then best[i]\n"
        "answer  all the guesses, then best[k]",
    ),
    "07.rollback": (
        "Three things go back: the guesses come off the token list, the computed count forgets the rejected "
        "guesses (the kept ones' KV is valid), and the block table shrinks to what the computed tokens plus the "
        "one token this step adds need, the extra blocks given back through the manager.",
        "1. Remove the last num_guesses entries of the token list, in place.\n"
        "2. Lower the computed-token count by the rejected guesses (num_guesses - num_accepted).\n"
        "3. Blocks to keep: those needed for the computed count + 1 (the manager's helper).\n"
        "4. Release every block past those, last first, through the manager (one reference each).\n"
        "5. Cut the table down to the kept blocks, in place.",
        "token list ← without its last num_guesses entries                (the same list object)\n"
        "computed ← computed − (num_guesses − num_accepted)\n"
        "keep ← blocks needed for computed + 1\n"
        "each block id after the first keep ones, last first → release it\n"
        "block table ← its first keep entries                             (the same list object)",
    ),
    # ------------------------------------------------------------------------------------------- lab 08
    "08.goodput": (
        "Goodput is a count divided by time: decide for every request whether its user was happy (it produced "
        "something, and each latency is within its limit where a limit is given), count the happy ones, divide "
        "by the duration.",
        "1. For each request: skip it if it produced no token.\n"
        "2. TTFT = first token time - arrival time, in milliseconds; a TTFT limit given and exceeded: skip.\n"
        "3. A TPOT limit given and two or more tokens: TPOT = (last - first token time) / (tokens - 1), in ms; "
        "exceeded: skip.\n"
        "4. Count the request.\n"
        "5. Divide the count by duration_s.",
        "good ← 0\n"
        "for each request with token times t:\n"
        "    skip it when t is empty\n"
        "    skip it when a TTFT limit exists and (first of t − arrival) in ms > that limit\n"
        "    skip it when a TPOT limit exists, t has ≥ 2 entries and (last − first)/(entries − 1) in ms > it\n"
        "    good ← good + 1\n"
        "answer good ÷ duration_s",
    ),
    "08.sweep_max_num_seqs": (
        "Run each setting once, score each run with your goodput under the SLO, and pick the winner with a "
        "tie-break towards less memory.",
        "1. For each value n: one run from run_at(n) (it runs a whole workload: once per n).\n"
        "2. Score it: the goodput of its requests over its duration, with the two SLOs.\n"
        "3. Keep the scores in a dict by n.\n"
        "4. best = the n with the highest score; between equal scores the smaller n (compare (score, -n)).\n"
        "5. Return (best, the dict).",
        "scores ← empty map\n"
        "for each value v:\n"
        "    r ← run_at(v), called once\n"
        "    scores[v] ← goodput of r's requests over r's duration, same SLOs\n"
        "best ← the v with the largest ⟨scores[v], −v⟩\n"
        "answer ⟨best, scores⟩",
    ),
    # ------------------------------------------------------------------------------------------- lab 09
    "09.kv_capacity_tokens": (
        "The weights are paid once in total, however many GPUs share them; everything else the engine may use "
        "is KV cache. Turn those bytes into whole tokens, and never answer a negative capacity.",
        "1. Usable bytes: GPUs × memory per GPU × utilization.\n"
        "2. Subtract the weights, once.\n"
        "3. Floor-divide what is left by the KV bytes per token.\n"
        "4. Clamp at 0 and return an int.",
        "left ← GPUs · memory per GPU · utilization − weight bytes\n"
        "answer  the larger of 0 and ⌊left ÷ KV bytes per token⌋, as an int",
    ),
    "09.shard_weights": (
        "Split two counts over the ranks as evenly as possible, the first ranks taking the remainder: KV heads "
        "and intermediate units. Every slice follows from what this rank owns: rows for the column-parallel "
        "matrices, columns for the row-parallel ones.",
        "1. A helper: of n items each rank gets n // world_size, plus one for the first n % world_size ranks; "
        "this rank's range starts at the sum of the earlier ranks' sizes.\n"
        "2. KV heads: k_proj's rows / head_dim; take this rank's range of heads. Intermediate units: gate_proj's "
        "rows; take this rank's range.\n"
        "3. k and v rows: the head range × head_dim. q rows: the head range × heads_per_kv × head_dim (the query "
        "heads that share those KV heads).\n"
        "4. gate and up: the unit range of rows.\n"
        "5. o_proj: q's range of columns; down_proj: the unit range of columns.\n"
        "6. Return a dict with all seven names.",
        "range_of(n): sizes ← n div W for every rank, + 1 for the first (n mod W) ranks\n"
        "             answer ⟨sum of the sizes before this rank, that + this rank's size⟩\n"
        "heads ← range_of(rows of k_proj ÷ head_dim);   units ← range_of(rows of gate_proj)\n"
        "q rows ← heads scaled by heads_per_kv · head_dim;   k, v rows ← heads scaled by head_dim\n"
        "q, k, v, gate, up ← their ranges of rows;   o ← q's range of columns;   down ← units' range of columns",
    ),
    "09.row_parallel": (
        "A row-parallel layer's product on one rank is only its share of the sum over the input features; the "
        "collective adds up the shares of all the ranks.",
        "1. Multiply this rank's x by the transpose of its weight slice: a partial [.., out].\n"
        "2. Pass the partial to all_reduce, which sums it over the ranks.\n"
        "3. Return what all_reduce returns.",
        "answer  all_reduce applied to (x times weight transposed)",
    ),
    "09.ring_allreduce_time": (
        "A ring all-reduce is a reduce-scatter then an all-gather: each phase moves (n - 1)/n of the data "
        "through every device's link. The time is bytes moved over bandwidth; one device has nothing to "
        "exchange.",
        "1. A single device: 0.0.\n"
        "2. Bytes each device sends: two phases × (n - 1)/n × num_bytes.\n"
        "3. Divide by link_bw.",
        "n = 1 → 0.0\n"
        "otherwise → two phases × (n − 1)/n × num_bytes ÷ link_bw",
    ),
    # ------------------------------------------------------------------------------------------- lab 10
    "10.roofline_time": (
        "Compute and memory traffic overlap, so the slower of the two sets the step; the fixed overhead comes on "
        "top.",
        "1. Compute time: FLOPs / peak FLOP/s.\n"
        "2. Memory time: bytes / bandwidth.\n"
        "3. Take the larger.\n"
        "4. Add the overhead.",
        "answer  the larger of ⟨flops ÷ peak, bytes ÷ bandwidth⟩ + overhead",
    ),
    "10.export_kv": (
        "The request's tokens are scattered over blocks: compute each token's slot (lab 02's formula), pick "
        "those slots from every tensor along the slot axis in one indexing operation, and bring the result to "
        "the CPU.",
        "1. For t from 0 to num_tokens - 1, its slot through the block table.\n"
        "2. Make the slots an integer tensor.\n"
        "3. For each name and tensor of the cache: index axis 1 with the slots (on the tensor's device) and move "
        "the result to the CPU.\n"
        "4. Return the dict of results.",
        "slots ← integer tensor of  table[⌊t / block_size⌋] · block_size + (t mod block_size)\n"
        "        for t = 0 … num_tokens − 1\n"
        "answer  { name: that tensor's slots along axis 1, on the CPU   for each name, tensor of the cache }",
    ),
    "10.request_meta": (
        "The header is what the decode side needs to continue the request and keep its latency honest: who it "
        "is, what it asked for, the token already produced, and the timestamps its TTFT is made of.",
        "1. Identity: request_id.\n"
        "2. What it asked for: its prompt token ids as a list, its sampling params.\n"
        "3. What the prefill produced: the last token id.\n"
        "4. Timing, from the request's metrics: arrival_time, first_token_time, first_scheduled_time.\n"
        "5. num_cached_tokens.\n"
        "Put them in one dict under those eight names.",
        "m ← the request's metrics\n"
        "answer a map:  request_id → its id;   prompt_token_ids → its prompt as a list;   params → its params;\n"
        "               arrival_time, first_token_time, first_scheduled_time → from m;\n"
        "               first_token → the last of its tokens;   num_cached_tokens → its count",
    ),
    "10.resume_prefilled": (
        "Make the fresh request look exactly like the one the prefill worker ended with, and let the scheduler's "
        "swap-in path bring its KV in.",
        "1. Append the first token to the token list.\n"
        "2. Count the prompt's tokens as computed (the prompt length; the new token is not computed yet).\n"
        "3. Set the status to SWAPPED and hang kv on the request as its swapped KV.",
        "the request's tokens gain first_token at their end\n"
        "its computed count ← its prompt length\n"
        "its status ← SWAPPED;   its swapped KV ← kv",
    ),
    "10.import_kv": (
        "The mirror of export_kv: the same slots for the tokens received, but written into the pool instead of "
        "read from it, in place, on the pool's device.",
        "1. n = the number of tokens received (axis 1 of any received tensor).\n"
        "2. The slots of tokens 0..n - 1 through this request's block table.\n"
        "3. For each name and received tensor: assign it into the cache tensor of that name at those slots on "
        "axis 1, moved to the cache's device.",
        "n ← size of kv[\"k\"] along axis 1\n"
        "slots ← integer tensor of  table[⌊t / block_size⌋] · block_size + (t mod block_size)  for t < n\n"
        "for each name, tensor of kv:  cache[name] at slots (axis 1) ← tensor, on the cache's device",
    ),
    "10.goodput": (
        "Pair each request's TTFT with its TPOT, count the pairs within both limits (seconds against "
        "milliseconds: convert), and divide by the duration; a missing TPOT cannot miss.",
        "1. Walk the two lists together.\n"
        "2. A request is good when its TTFT in ms is at most the TTFT limit, and its TPOT is NaN or, in ms, at "
        "most the TPOT limit.\n"
        "3. Count the good ones and divide by duration_s.",
        "good ← the number of pairs ⟨t, p⟩ with t·1000 ≤ TTFT limit and (p is NaN or p·1000 ≤ TPOT limit)\n"
        "answer good ÷ duration_s",
    ),
    # ------------------------------------------------------------------------------------------- lab 11
    "11.update_state": (
        "Decide first whether the message starts a new topic or continues the current one, merge accordingly, "
        "and only then apply the 'not X' constraints and the size cap.",
        "1. Extract the message's entities and constraints.\n"
        "2. New topic on the first turn, or when the message names entities and does not refer back: the "
        "message's entities, constraints and goal.\n"
        "3. Otherwise: the message's entities, then the state's entities not among them; the state's "
        "constraints, then the message's new ones; the state's goal.\n"
        "4. Remove every entity X for which a constraint \"not X\" exists.\n"
        "5. Keep the first MAX_ENTITIES.\n"
        "6. Return a new SessionState with the turn one higher.",
        "E, C ← the message's entities and constraints\n"
        "first turn, or E non-empty and no reference back →\n"
        "    entities ← E;  constraints ← C;  goal ← the message's\n"
        "otherwise →  entities ← E then the old ones not in E;  constraints ← old then new;  goal ← old goal\n"
        "drop each entity X with \"not X\" among the constraints;   keep at most MAX_ENTITIES\n"
        "answer  a SessionState of these, turn + 1",
    ),
    "11.layout_prompt": (
        "What never changes between turns goes first and what changes every turn after it: the prefix cache only "
        "reuses the common beginning of two prompts.",
        "1. The order: the system prompt, each history entry oldest first, the session state, each passage, the "
        "new message.\n"
        "2. Join all of them with a blank line between parts.",
        "answer  blank-line-joined sequence: system, every history entry in order, state, every passage, message",
    ),
    # ------------------------------------------------------------------------------------------- lab 12
    "12.stream_sse": (
        "The loop is easy; the exit is the lesson. A client that leaves shows up as an exception inside your "
        "generator (cancellation, or close), not as a normal end, so the clean-up must run however the generator "
        "ends, and only when the request had not finished.",
        "1. Remember whether the finished output was seen (not yet).\n"
        "2. In a try block: for each output (async for), yield the SSE event of its chunk (the data line with "
        "the JSON, then a blank line); if it is the finished one, note it and leave the loop. Then yield the "
        "[DONE] event.\n"
        "3. In the finally block: if the finished output was not seen, call abort().",
        "done ← no\n"
        "try:\n"
        "    for each out arriving from outputs (asynchronously):\n"
        "        send  \"data: \" + JSON text of to_chunk(out) + blank line\n"
        "        out is finished → done ← yes, leave the loop\n"
        "    send  \"data: [DONE]\" + blank line\n"
        "finally, however we leave:  not done → abort()",
    ),
    "12.parse_sse": (
        "Only lines that begin with the data: field carry events; the rest is framing. The end marker is a data "
        "line too, so look for it before decoding JSON.",
        "1. For each line: skip it unless it starts with \"data:\".\n"
        "2. Take what follows the prefix, trimmed.\n"
        "3. If it is [DONE], stop.\n"
        "4. Otherwise decode it as JSON and collect it.",
        "events ← []\n"
        "for each line:\n"
        "    skip it unless it begins with data:\n"
        "    payload ← the rest of the line after data:, trimmed\n"
        "    payload is [DONE] → stop\n"
        "    events gets the JSON-decoded payload\n"
        "answer events",
    ),
    "12.latencies": (
        "The client only has arrival times: the first one, measured from sending, is the TTFT; the spacing "
        "between neighbours is the inter-token latency.",
        "1. TTFT: the first arrival minus the send time.\n"
        "2. ITLs: for each pair of neighbouring arrivals, the later minus the earlier (one fewer than arrivals).\n"
        "3. Return both.",
        "answer ⟨first arrival − send_time, [next − previous for each neighbouring pair of arrivals]⟩",
    ),
    # ------------------------------------------------------------------------------------------- lab 13
    "13.apply_token_bitmask": (
        "Unpack each 32-bit word into 32 booleans (bit j of word w is token 32·w + j), line them up with the "
        "vocabulary, cut the padding, and mask with them.",
        "1. Shift every word right by 0..31 (broadcast over a new last axis) and keep the lowest bit: "
        "[n, words, 32].\n"
        "2. Flatten the last two axes: [n, 32·words], in token order.\n"
        "3. Keep the first V columns, as booleans.\n"
        "4. Fill the logits where the bit is 0 with -inf, out of place, on the logits' device.",
        "bits[i, w, j] ← (bitmask[i, w] shifted right by j) AND 1          for j = 0 … 31\n"
        "allowed ← bits flattened over ⟨w, j⟩, first V columns, as booleans\n"
        "answer  logits with −inf wherever allowed is false             (a new tensor)",
    ),
    "13.advance_matcher": (
        "A grammar matcher advances one token at a time; stop at the first token it refuses.",
        "1. For each token in order, call accept_token with it (as a plain int).\n"
        "2. If it returns False, return False at once.\n"
        "3. If all were accepted, return True.",
        "for each token t, in order:\n"
        "    the matcher refuses t → False\n"
        "→ True",
    ),
    # ------------------------------------------------------------------------------------------- lab 14
    "14.promote": (
        "The tier answers only for the exact block (name and tokens) and hands its copy over once; the device "
        "block it lands in must come from somewhere that is not this prompt's own prefix, and afterwards it must "
        "look like any cached block nobody uses yet.",
        "1. No tier, or the tier does not hold this name with these tokens: nothing to promote.\n"
        "2. With no free block, the new one would push out a cached block: the prompt's earlier blocks (in hits) "
        "must not be that one. Give up if only they are cached; else make them the newest in the LRU order.\n"
        "3. Take the entry out of the tier first (a full tier may drop entries when the device evicts), then a "
        "device block, and copy the saved K/V into it.\n"
        "4. Give the block its name and tokens, no references, a place in the name table and the newest place in "
        "the LRU order; return it.",
        "tier missing, or it lacks ⟨name, ids⟩ → nothing\n"
        "no free block:\n"
        "    cached prefix blocks ← those of hits that are cached\n"
        "    every cached block is one of them → nothing\n"
        "    move each of them to the newest end of the LRU order\n"
        "saved ← the tier's entry, taken out (the tier tells its policy)\n"
        "b ← a fresh device block;  restore saved into b\n"
        "b gets name and ids, zero references; the name table points at b; b is the newest cached block\n"
        "answer b",
    ),
    # ------------------------------------------------------------------------------------------- lab 15
    "15.fan_out": (
        "A prefix cache only finds blocks that are already computed, so requests that enter in the same step all "
        "miss it. Let one sub-task go first until its prompt is done; the others then find the shared part cached "
        "and still run in the same steps as the first.",
        "1. Queue the first prompt alone and keep stepping; collect every finished output by its request id.\n"
        "2. Stop stepping alone once any step's outputs include the first request: its prompt has been computed.\n"
        "3. Queue every other prompt, remembering the ids in prompt order.\n"
        "4. Step until every id has a finished output, then answer the outputs in the order of the ids.",
        "finished ← empty map from id to output\n"
        "a ← id of the first prompt, queued alone\n"
        "repeat a step, keeping the finished outputs, until one of its outputs belongs to a\n"
        "ids ← a, then the ids of the other prompts, each queued now\n"
        "repeat a step, keeping the finished outputs, until every id is finished\n"
        "answer  the finished outputs of ids, in that order",
    ),
    "15.prompt_usage": (
        "A token the prefix cache served was never run through the model: what the engine computed is what was "
        "sent minus what was found.",
        "1. Add up the prompt lengths of the outputs.\n"
        "2. Add up what each output reports as served from the cache.\n"
        "3. The computed tokens are the difference; answer the three under their names.",
        "P ← total prompt length over the outputs;  C ← total cached count over the outputs\n"
        "answer  prompt_tokens P, cached_tokens C, computed_tokens P − C",
    ),
    "15.route": (
        "Turn the small model's scores into probabilities over the options; how sure it is equals the probability of "
        "its favourite. Sure enough keeps the request on the small model. Nothing about the right answer may enter.",
        "1. Subtract the largest score from each (so nothing overflows) and exponentiate.\n"
        "2. The confidence is 1 over the sum of those numbers (the favourite's share).\n"
        "3. Compare it with the threshold: at or above it the small model answers, below it the target does.",
        "m ← largest score\n"
        "confidence ← 1 / (sum over the scores s of e^(s − m))\n"
        "answer  small if confidence reaches the threshold, otherwise target",
    ),
    # ------------------------------------------------------------------------------------------- lab 16
    "16.paged_decode_kernel": (
        "One program owns one output row. It walks its sequence's blocks once, and keeps three running numbers "
        "instead of a row of scores: the largest score so far, the sum of exponentials measured against it, and "
        "the value rows weighted the same way. A larger maximum shrinks what came before by the exponential of "
        "the difference. Masked positions get minus infinity before anything else sees them.",
        "1. Read the program's sequence and query head from the two grid axes; its KV head is the query head "
        "divided (integer) by GROUP.\n"
        "2. Load the sequence's context length and its query row as float32.\n"
        "3. Start the maximum at minus infinity, the sum at 0, the accumulator at zeros of length D.\n"
        "4. For each block index up to the context divided by BLOCK, rounded up: load the block id from the "
        "table's row of this sequence (its row stride), build the addresses of its BLOCK slots for the KV head, "
        "and mark which positions are below the context length.\n"
        "5. Load the keys (masked), score them against the query, times scale, minus infinity where masked.\n"
        "6. New maximum; weights = exponentials of the scores against it; correction = exponential of old minus "
        "new maximum; rescale the sum and accumulator by it, then add the weights and the weighted values.\n"
        "7. After the loop store the accumulator divided by the sum.",
        "b, h ← the program's two ids;   kv ← h div GROUP;   n ← context of b\n"
        "m ← −∞;   s ← 0;   acc ← zero vector of D\n"
        "for every block j of b while j · BLOCK < n:\n"
        "    phys ← table[b, j];   slots ← phys · BLOCK + (0 … BLOCK−1);   ok ← j · BLOCK + (0 … BLOCK−1) < n\n"
        "    x ← (K[slots, kv] · q[b, h]) · scale, −∞ where not ok\n"
        "    m' ← max(m, max x);   w ← e^(x − m');   c ← e^(m − m')\n"
        "    acc ← acc · c + Σ w · V[slots, kv];   s ← s · c + Σ w;   m ← m'\n"
        "out[b, h] ← acc ÷ s",
    ),
    "16.paged_decode_split_kernel": (
        "The same walk as exercise 1, over a slice of the blocks instead of all of them: the third grid axis "
        "picks the slice. What the slice hands on is its normalised output and one number that says how much "
        "softmax mass it holds: its maximum plus the logarithm of its sum.",
        "1. As exercise 1, plus the split index from the third grid axis.\n"
        "2. The slice starts at split index times blocks_per_split and ends blocks_per_split later, or at the "
        "sequence's last block if that comes first; it may be empty.\n"
        "3. Run exercise 1's loop over the slice only.\n"
        "4. If the sum stayed 0 the slice was empty: store zeros and minus infinity. Otherwise store the "
        "accumulator over the sum, and the maximum plus the log of the sum, at the slice's place (its strides).",
        "b, h, sp ← the program's three ids\n"
        "first ← sp · blocks_per_split;   last ← min(first + blocks_per_split, blocks of b)\n"
        "run the online-softmax walk over blocks first … last − 1 → m, s, acc\n"
        "if s = 0:   o[b, h, sp] ← 0;   lse[b, h, sp] ← −∞\n"
        "else:       o[b, h, sp] ← acc ÷ s;   lse[b, h, sp] ← m + ln s",
    ),
    "16.combine_splits": (
        "Each slice's output is a softmax over its own positions. The whole softmax gives slice k the share "
        "e^(lse_k) of the total e^(lse) summed over slices; that share, computed stably, is a softmax over the "
        "slices' log-sum-exps.",
        "1. Turn the log-sum-exps into weights that sum to 1 over the split axis (a softmax over that axis; an "
        "empty slice's minus infinity gives weight 0).\n"
        "2. Multiply each slice's output by its weight (add a trailing axis to broadcast over D).\n"
        "3. Sum over the split axis.",
        "w[b, h, k] ← e^(lse[b, h, k]) ÷ Σ_k' e^(lse[b, h, k'])      (stably: subtract the largest first)\n"
        "answer  Σ_k w[b, h, k] · o[b, h, k, :]",
    ),
}
