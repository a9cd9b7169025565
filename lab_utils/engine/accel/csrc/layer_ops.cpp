// The small element-wise steps of a Llama layer, one pass over memory each: the CPU kernels behind
// lab_utils/engine/cpu_fused.py.
//
// In PyTorch, RMSNorm on a CPU is six kernels (pow, mean, add, rsqrt, mul, mul), the residual add before it one
// more, and SwiGLU's silu(gate) * up two: at decode batch sizes each is a few microseconds of dispatch and an
// OpenMP fork/join for a few thousand numbers. Here the residual add and the norm are one pass, and silu-mul is
// one pass. Rows are spread over ATen's thread pool. Same maths as the reference (`LlamaRMSNorm`, SwiGLU),
// float32 only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() >= 1 && t.is_contiguous(), name, " must be contiguous");
}

// out = x / sqrt(mean(x^2) + eps) * weight, for one row of H numbers
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

// x [..., H], weight [H] -> RMSNorm(x) * weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t H = x.size(-1), N = x.numel() / H;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "weight must be [", H, "], got ", weight.sizes());
  auto out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * H, w, op + r * H, H, static_cast<float>(eps));
  });
  return out;
}

// residual stream x and a layer's output delta [..., H] -> (x + delta, RMSNorm(x + delta) * weight): the add
// that closes one sub-layer and the norm that opens the next, in one pass
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_rows(weight, "weight");
  TORCH_CHECK(x.sizes() == delta.sizes(), "x and delta must have one shape: ", x.sizes(), " vs ", delta.sizes());
  const int64_t H = x.size(-1), N = x.numel() / H;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "weight must be [", H, "], got ", weight.sizes());
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* s = sp + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) s[i] = xp[r * H + i] + dp[r * H + i];
      rms_norm_row(s, w, op + r * H, H, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

// gate_up [..., 2I] (gate then up, as the fused gate/up linear writes them) -> silu(gate) * up [..., I]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1), N = gate_up.numel() / two_i, I = two_i / 2;
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even (gate, then up), got ", two_i);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float *g = gp + r * two_i, *u = g + I;
      float* o = op + r * I;
      // exp's argument capped at 80 (e^80 ~ 5.5e34, finite): under -ffast-math g / (1 + inf) is not 0 but NaN
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 80.f))) * u[i];
    }
  });
  return out;
}
