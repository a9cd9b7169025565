// y = x W^T (+ bias) for a few rows of x: the GEMM of a decode step, behind lab_utils/engine/cpu_linear.py.
//
// A decode step multiplies a handful of rows (one per running sequence, or k+1 for a speculative verify) by every
// weight of the model. With so few rows the product is bound by reading the weights from memory, not by
// arithmetic, and a general GEMM's packing and blocking only get in the way. This kernel reads each weight row
// once, straight from the model's own [out, in] layout, and multiplies it into all the rows of x while it sits in
// registers / L1:
//
//   for a block of NR weight rows (w_0 .. w_NR-1):          (spread over the threads)
//     for each tile of up to 4 rows of x:                   (x stays in L1)
//       acc[m][r] += x_m[k:k+8] * w_r[k:k+8]  for k in steps of 8 (AVX2 FMA), then y[m, n+r] = sum(acc[m][r])
//
// and prefetches the next block's weight rows while it computes. Measured on a 2-core AVX2 VM against oneDNN's
// packed GEMM over SmolLM2-135M's 30 layers + lm head (weights from memory, benchmarks/small_m_gemm.py, 2 threads):
// 1.2-1.3x faster from 1 to 16 rows, 1.1x at 32-64 rows (then both near the FMA peak). Several weights reading the
// same x (q/k/v, gate/up) are one call whose outputs sit side by side, as the fused linear's would.
//
// W8A8 (`small_m_linear_w8a8`, lab_utils/quant/linear.py's W8A8Linear): x is rounded to int8 here, one scale per
// 32 inputs of a row (absmax / 127), and each 32 weights cost one byte dot product instead of four widen-convert-FMA
// sequences: |x| (u8) times the weight with x's sign (vpsignb) summed in pairs (vpmaddubsw; |x|, |w| <= 127 keeps
// each pair <= 32258, no int16 saturation), then in fours (vpmaddwd), then converted and scaled by the group's
// scale (one FMA). Weights must lie in [-127, 127] (symmetric INT8, as Int8Linear stores them: vpsignb cannot negate
// -128). The weight-only INT8 kernel is bound by the widening (~11 GB/s on one core of the 2-core VM); this one
// reads ~14 GB/s there (a plain streaming read: ~20).
//
// The AVX2 + FMA path is compiled where the build has them (x86-64 with -mavx2 -mfma, cpu_kernels.py's flags); on
// other CPUs (ARM, old x86) a plain loop computes the same products so the module still builds, and
// `small_m_vectorized` is false so the engine keeps oneDNN there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SMALL_M_AVX2 1
#else
#define SMALL_M_AVX2 0
#endif

namespace {

// W8A8: x rounded to int8 in groups of kGroup inputs per row, q = round(x * (1 / s)), s = absmax * (1 / 127) (s = 1
// for an all-zero group): what lab_utils.quant.linear.quantize_groups_int8 computes, operation for operation.
constexpr int64_t kGroup = 32;

struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<uint8_t> abs;  // [M, K] |q|
  std::vector<float> scale;  // [M, K / kGroup]
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantizedRows out{std::vector<int8_t>(M * K), std::vector<uint8_t>(M * K), std::vector<float>(M * K / kGroup)};
  for (int64_t g = 0; g < M * K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float absmax = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) absmax = std::max(absmax, std::fabs(xg[i]));
    const float s = absmax > 0.f ? absmax * (1.f / 127.f) : 1.f;
    const float inv = 1.f / s;
    out.scale[g] = s;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xg[i] * inv)));
      out.q[g * kGroup + i] = static_cast<int8_t>(v);
      out.abs[g * kGroup + i] = static_cast<uint8_t>(std::fabs(v));
    }
  }
  return out;
}

#if SMALL_M_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 weights as floats: float32 as they are, int8 widened (the per-row scale is applied to the finished sums)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// y[m, r] (row stride ldy) = x_m . w_r for MR rows of x (stride K) and NR rows of w (stride K); K % 8 == 0.
// PREFETCH: also pull the next NR weight rows into cache (done by the first tile of a block only).
template <typename T, int MR, int NR, bool PREFETCH>
inline void tile(const float* x, const T* w, float* y, int64_t K, int64_t ldy) {
  constexpr int64_t kLine = 64 / sizeof(T);  // weights in one 64-byte cache line
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = load8(w + r * K + k);
    if (PREFETCH && k % kLine == 0)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * K + k), _MM_HINT_T0);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = hsum(acc[m][r]);
}

template <typename T, int MR, int NR>
inline void tile_maybe_prefetch(bool prefetch, const float* x, const T* w, float* y, int64_t K, int64_t ldy) {
  if (prefetch) tile<T, MR, NR, true>(x, w, y, K, ldy);
  else tile<T, MR, NR, false>(x, w, y, K, ldy);
}

// all M rows of x against NR weight rows: tiles of 4 rows, then the 1-3 left; the first tile prefetches
template <typename T, int NR>
void weight_rows(const float* x, const T* w, float* y, int64_t M, int64_t K, int64_t ldy) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_maybe_prefetch<T, 4, NR>(m == 0, x + m * K, w, y + m * ldy, K, ldy);
  const bool first = m == 0;
  switch (M - m) {
    case 3: tile_maybe_prefetch<T, 3, NR>(first, x + m * K, w, y + m * ldy, K, ldy); break;
    case 2: tile_maybe_prefetch<T, 2, NR>(first, x + m * K, w, y + m * ldy, K, ldy); break;
    case 1: tile_maybe_prefetch<T, 1, NR>(first, x + m * K, w, y + m * ldy, K, ldy); break;
    default: break;
  }
}

// W8A8: MR rows of quantized x (ax = |q|, sq = q, sx = one scale per 32 inputs) against NR int8 weight rows
template <int MR, int NR, bool PREFETCH>
inline void tile_w8a8(const QuantizedRows& x, int64_t m0, const int8_t* w, float* y, int64_t K, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t G = K / kGroup;
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  // the next block's NR rows follow this block's in memory (one weight, or the next one): prefetch that range
  // linearly, as much of it per step as this step reads (measured 1.2x faster than row-by-row prefetching)
  const char* ahead = reinterpret_cast<const char*>(w) + NR * K;
  for (int64_t k = 0, g = 0; k < K; k += kGroup, ++g) {
    if (PREFETCH)
      for (int64_t off = (k * NR) & ~63; off < (k + kGroup) * NR; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    for (int m = 0; m < MR; ++m) {
      const int64_t row = (m0 + m) * K + k;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.abs.data() + row));
      const __m256i sgn = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row));
      const __m256 scale = _mm256_broadcast_ss(x.scale.data() + (m0 + m) * G + g);
      for (int r = 0; r < NR; ++r) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k));
        const __m256i pairs = _mm256_maddubs_epi16(a, _mm256_sign_epi8(wv, sgn));  // |x| * (w with x's sign)
        const __m256i quads = _mm256_madd_epi16(pairs, ones);
        acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quads), scale, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) y[m * ldy + r] = hsum(acc[m][r]);
}

template <int MR, int NR>
inline void tile_w8a8_maybe_prefetch(bool prefetch, const QuantizedRows& x, int64_t m0, const int8_t* w, float* y,
                                     int64_t K, int64_t ldy) {
  if (prefetch) tile_w8a8<MR, NR, true>(x, m0, w, y, K, ldy);
  else tile_w8a8<MR, NR, false>(x, m0, w, y, K, ldy);
}

template <int NR>
void weight_rows_w8a8(const QuantizedRows& x, const int8_t* w, float* y, int64_t M, int64_t K, int64_t ldy) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile_w8a8_maybe_prefetch<2, NR>(m == 0, x, m, w, y + m * ldy, K, ldy);
  if (m < M) tile_w8a8_maybe_prefetch<1, NR>(m == 0, x, m, w, y + m * ldy, K, ldy);
}

#else
// portable fallback: the same products, one dot product at a time (not tuned; the engine does not use it)
template <typename T, int NR>
void weight_rows(const float* x, const T* w, float* y, int64_t M, int64_t K, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(w[r * K + k]);
      y[m * ldy + r] = acc;
    }
}

template <int NR>
void weight_rows_w8a8(const QuantizedRows& x, const int8_t* w, float* y, int64_t M, int64_t K, int64_t ldy) {
  const int64_t G = K / kGroup;
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) dot += int32_t(x.q[m * K + k]) * int32_t(w[r * K + k]);
        acc += static_cast<float>(dot) * x.scale[m * G + g];
      }
      y[m * ldy + r] = acc;
    }
}
#endif

// how many weight rows a block takes: as many as keep MR x NR accumulators in AVX2's 16 registers
int rows_per_block(int64_t M) { return M == 1 ? 8 : M == 2 ? 6 : M == 3 ? 4 : 3; }
// W8A8 tiles need 5 more registers (x's bytes, its signs, its scale, the weights, ones): 1 x 8 or 2 x 4 accumulators
// (tiles of 2 rows of x; 4-row tiles with 2 weight rows measured 10-15 % slower from 16 rows on, no faster below)
int rows_per_block_w8a8(int64_t M) { return M == 1 ? 8 : 4; }

template <typename T>
struct Block {
  const T* w;      // first weight row
  int64_t col;     // its output column
  int rows;        // NR, or 1 for the rows left at the end of a weight
};

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(x.size(-1) % 8 == 0, "small_m_linear needs in_features divisible by 8 (AVX2 lanes), got ",
              x.size(-1));
}

const float* checked_vector(const c10::optional<at::Tensor>& v, int64_t n, const char* name) {
  if (!v.has_value() || !v->defined()) return nullptr;
  TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == n, name,
              " must be a contiguous float32 vector of ", n, " (the outputs), got ", v->sizes());
  return v->data_ptr<float>();
}

// the weights cut into blocks of NR rows (and single rows at the end of each weight), in output-column order
template <typename T>
std::vector<Block<T>> make_blocks(const std::vector<at::Tensor>& weights, int NR, int64_t K) {
  std::vector<Block<T>> blocks;
  int64_t col = 0;
  for (const auto& w : weights) {
    const T* wp = w.data_ptr<T>();
    const int64_t n = w.size(0);
    int64_t r = 0;
    for (; r + NR <= n; r += NR) blocks.push_back({wp + r * K, col + r, NR});
    for (; r < n; ++r) blocks.push_back({wp + r * K, col + r, 1});
    col += n;
  }
  return blocks;
}

// out[m, r] *= scale[col + r] (if given), += bias[col + r] (if given), for one block's columns
inline void scale_bias(float* out, int64_t M, int rows, int64_t col, int64_t N, const float* scale, const float* bias) {
  if (scale == nullptr && bias == nullptr) return;
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < rows; ++r) {
      float& v = out[m * N + r];
      if (scale != nullptr) v *= scale[col + r];
      if (bias != nullptr) v += bias[col + r];
    }
}

at::Tensor output_for(const at::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return at::empty(sizes, x.options());
}

// y = x @ cat(weights).T, then y *= scale (per output column, if given) and y += bias (if given)
template <typename T>
at::Tensor run(const at::Tensor& x, const std::vector<at::Tensor>& weights, const float* scale, const float* bias,
               int64_t N) {
  const int64_t K = x.size(-1), M = x.numel() / K;
  auto y = output_for(x, N);
  if (M == 0 || N == 0) return y;
  const int NR = rows_per_block(M);
  const std::vector<Block<T>> blocks = make_blocks<T>(weights, NR, K);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block<T>& blk = blocks[i];
      float* out = yp + blk.col;
      if (blk.rows == 1) weight_rows<T, 1>(xp, blk.w, out, M, K, N);
      else if (NR == 8) weight_rows<T, 8>(xp, blk.w, out, M, K, N);
      else if (NR == 6) weight_rows<T, 6>(xp, blk.w, out, M, K, N);
      else if (NR == 4) weight_rows<T, 4>(xp, blk.w, out, M, K, N);
      else weight_rows<T, 3>(xp, blk.w, out, M, K, N);
      scale_bias(out, M, blk.rows, blk.col, N, scale, bias);
    }
  });
  return y;
}

// y = (quantized x @ cat(qweights).T) * scale (+ bias), x rounded to int8 per group of 32 inputs first
at::Tensor run_w8a8(const at::Tensor& x, const std::vector<at::Tensor>& qweights, const float* scale,
                    const float* bias, int64_t N) {
  const int64_t K = x.size(-1), M = x.numel() / K;
  auto y = output_for(x, N);
  if (M == 0 || N == 0) return y;
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
  const int NR = rows_per_block_w8a8(M);
  const std::vector<Block<int8_t>> blocks = make_blocks<int8_t>(qweights, NR, K);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block<int8_t>& blk = blocks[i];
      float* out = yp + blk.col;
      if (blk.rows == 1) weight_rows_w8a8<1>(xq, blk.w, out, M, K, N);
      else if (NR == 8) weight_rows_w8a8<8>(xq, blk.w, out, M, K, N);
      else weight_rows_w8a8<4>(xq, blk.w, out, M, K, N);
      scale_bias(out, M, blk.rows, blk.col, N, scale, bias);
    }
  });
  return y;
}

}  // namespace

bool small_m_vectorized() { return SMALL_M_AVX2; }

// x [..., K] float32 contiguous; weights: [N_i, K] each -> y [..., sum N_i] = x @ cat(weights).T (+ bias [sum N_i])
at::Tensor small_m_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                          const c10::optional<at::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(!weights.empty(), "small_m_linear needs at least one weight");
  const int64_t K = x.size(-1);
  int64_t N = 0;
  for (const auto& w : weights) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 2,
                "weights must be contiguous float32 CPU [out, in] matrices");
    TORCH_CHECK(w.size(1) == K, "weight has in_features ", w.size(1), " but x has ", K);
    N += w.size(0);
  }
  return run<float>(x, weights, nullptr, checked_vector(bias, N, "bias"), N);
}

namespace {
int64_t checked_int8_outputs(const at::Tensor& x, const std::vector<at::Tensor>& qweights, const char* name) {
  TORCH_CHECK(!qweights.empty(), name, " needs at least one weight");
  int64_t N = 0;
  for (const auto& q : qweights) {
    TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() == 2,
                "qweights must be contiguous int8 CPU [out, in] matrices");
    TORCH_CHECK(q.size(1) == x.size(-1), "qweight has in_features ", q.size(1), " but x has ", x.size(-1));
    N += q.size(0);
  }
  return N;
}
}  // namespace

// the same for weight-only INT8 linears (lab_utils/quant/linear.py's Int8Linear): qweights int8 [N_i, K] each,
// one float32 scale per output row (scale [sum N_i]) -> y = (x @ cat(qweights).T) * scale (+ bias). A quarter of
// the fp32 bytes to read.
at::Tensor small_m_linear_int8(const at::Tensor& x, const std::vector<at::Tensor>& qweights, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& bias) {
  check_x(x);
  const int64_t N = checked_int8_outputs(x, qweights, "small_m_linear_int8");
  const float* s = checked_vector(scale, N, "scale");
  TORCH_CHECK(s != nullptr, "scale is required (one float32 per output row)");
  return run<int8_t>(x, qweights, s, checked_vector(bias, N, "bias"), N);
}

// W8A8 (lab_utils/quant/linear.py's W8A8Linear): the same weights and scale, x rounded to int8 here per group of 32
// inputs of each row, integer dot products -> y = sum over groups (x_q . q) * s_x, times scale (+ bias).
at::Tensor small_m_linear_w8a8(const at::Tensor& x, const std::vector<at::Tensor>& qweights, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& bias) {
  check_x(x);
  TORCH_CHECK(x.size(-1) % kGroup == 0, "small_m_linear_w8a8 needs in_features divisible by ", kGroup,
              " (one activation scale per 32 inputs), got ", x.size(-1));
  const int64_t N = checked_int8_outputs(x, qweights, "small_m_linear_w8a8");
  const float* s = checked_vector(scale, N, "scale");
  TORCH_CHECK(s != nullptr, "scale is required (one float32 per output row)");
  return run_w8a8(x, qweights, s, checked_vector(bias, N, "bias"), N);
}
