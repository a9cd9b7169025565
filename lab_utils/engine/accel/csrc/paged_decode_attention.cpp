// Decode attention that reads the paged KV cache in place: the CPU kernel behind
// lab_utils/engine/cpu_attention.py.
//
// The PyTorch path gathers every sequence's keys and values into a padded [B, L, Hkv, D] copy, then calls
// scaled_dot_product_attention on it: ~8 kernels a layer per group of rows, each a few microseconds of dispatch
// and a pass over memory, for what is at batch 1-16 a few thousand multiply-adds. Here one call does a whole
// layer: for each (sequence, KV head) task it walks the sequence's block table, scores the G = Hq / Hkv query
// heads that share this KV head against each key (grouped-query attention: each key is read once for G
// queries), takes the softmax and sums the values. Tasks are spread over ATen's thread pool. This is the
// shape of vLLM's CPU paged_attention_v1 kernel, in plain C++ the compiler vectorises (no intrinsics).
//
// Exact maths of the reference `paged_attention_reference`, one query per row (a sequence with several new
// tokens is several rows, each with its own context length: its causal mask); float32 only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, bool rows_strided = false) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
  if (rows_strided) {  // [R, H, D] whose rows may be a slice of wider rows (q out of the fused q/k/v output)
    TORCH_CHECK(t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)), name, " must be contiguous within a row");
  } else {
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  }
}

}  // namespace

// q [R, Hq, D] (rows may be strided), k_cache / v_cache [S, Hkv, D] (one layer's slots),
// block_tables [R, max_blocks] int32, context_lens [R] int32 -> out [R, Hq, D]. Row r attends to its tokens 0 .. context_lens[r] - 1, which sit at
// slot block_tables[r][t / block_size] * block_size + t % block_size.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
  check(q, "q", at::kFloat, 3, /*rows_strided=*/true);
  check(k_cache, "k_cache", at::kFloat, 3);
  check(v_cache, "v_cache", at::kFloat, 3);
  check(block_tables, "block_tables", at::kInt, 2);
  check(context_lens, "context_lens", at::kInt, 1);
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), max_blocks = block_tables.size(1);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must have one shape");
  TORCH_CHECK(k_cache.size(2) == D, "head_dim differs: q ", D, ", cache ", k_cache.size(2));
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads (", Hq, ") must be a multiple of KV heads (", Hkv, ")");
  TORCH_CHECK(block_tables.size(0) == R && context_lens.size(0) == R, "one block table and length per row");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= max_blocks * block_size, "row ", r, ": context length ", lens[r],
                " outside 1..", max_blocks * block_size, " (its block table)");
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < R * max_blocks; ++i) {
    TORCH_CHECK(tables[i] >= 0 && (tables[i] + 1) * block_size <= S, "block id ", tables[i],
                " outside the cache (", S / block_size, " blocks)");
  }

  auto out = at::empty({R, Hq, D}, q.options());
  const int64_t q_row = q.stride(0);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = Hq / Hkv;
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // [G, context]: this task's attention weights
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, h = task % Hkv;
      const int64_t L = lens[r];
      const int32_t* table = tables + r * max_blocks;
      const float* qr = qp + r * q_row + h * G * D;  // the G query heads that read KV head h
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {  // scores = q . k * scale
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const float* k = kp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qr + g * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
          scores[g * L + t] = acc * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the context, max subtracted
        float* s = scores.data() + g * L;
        const float m = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      float* orow = op + (r * Hq + h * G) * D;
      std::fill(orow, orow + G * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {  // out = sum_t p_t v_t
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const float* v = vp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* og = orow + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) og[d] += p * v[d];
        }
      }
    }
  });
  return out;
}
