// The Python module of the engine's CPU kernels (lab_utils/engine/cpu_kernels.py builds it).
#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                     double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor small_m_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                          const c10::optional<at::Tensor>& bias);
at::Tensor small_m_linear_int8(const at::Tensor& x, const std::vector<at::Tensor>& qweights, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& bias);
at::Tensor small_m_linear_w8a8(const at::Tensor& x, const std::vector<at::Tensor>& qweights, const at::Tensor& scale,
                               const c10::optional<at::Tensor>& bias);
bool small_m_vectorized();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "One query per row against its paged K/V, read in place through its block table (float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight, one pass (float32)");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta) * weight), one pass (float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate, up] (float32)");
  m.def("small_m_linear", &small_m_linear,
        "x @ cat(weights).T (+ bias) for a few rows of x, each weight row read once (float32)", py::arg("x"),
        py::arg("weights"), py::arg("bias") = py::none());
  m.def("small_m_linear_int8", &small_m_linear_int8,
        "(x @ cat(qweights).T) * scale (+ bias) for a few rows of x, int8 weights read once (weight-only INT8)",
        py::arg("x"), py::arg("qweights"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("small_m_linear_w8a8", &small_m_linear_w8a8,
        "the same with x rounded to int8 per 32 inputs of a row first, integer dot products (W8A8Linear)",
        py::arg("x"), py::arg("qweights"), py::arg("scale"), py::arg("bias") = py::none());
  m.attr("small_m_vectorized") = small_m_vectorized();  // false: built without AVX2 + FMA, the engine keeps oneDNN
}
