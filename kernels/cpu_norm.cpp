// RMSNorm of the residual stream on the CPU in float32, with the residual add before it fused in.
//
// Why: torch's CPU rms_norm is a composite of about ten ops (pow, mean, add, rsqrt, mul, casts), each
// with its own dispatch and thread-pool cost; at decode sizes ([12, 576]) one call took about 100 us,
// 61 calls per step, 7 ms of a 54 ms decode step of the default model on the dev CPU. Here a row is
// one pass to sum its squares and one to scale it.
//
// Numerics follow transformers' LlamaRMSNorm in float32: y = (x * rsqrt(mean(x^2) + eps)) * w. The sum
// of squares is accumulated in float32 vector lanes, so the last bits can differ from torch's order.

#include "torch_ext.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t ROWS_PER_TASK = 16;  // below this many rows a thread split costs more than it saves

void norm_row(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t h, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) y[i] = (x[i] * r) * w[i];
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() &&
                  (t.stride(1) == 1 || t.size(1) <= 1 || t.numel() == 0),  // a size-1 dim's stride is arbitrary
              name,
              " must be a 2-D float32 CPU tensor with contiguous rows");
}

void check_weight(const at::Tensor& w, int64_t h) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "weight must be contiguous float32 [", h, "]");
}

}  // namespace

// x [T, H] -> y [T, H] (contiguous).
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_weight(w, H);
  at::Tensor y = at::empty({T, H}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * xs, wp, yp + t * H, H, static_cast<float>(eps));
  });
  return y;
}

// h [T, H] += d [T, H] in place (the residual stream), then returns rms_norm(h).
at::Tensor add_rms_norm(at::Tensor h, at::Tensor d, at::Tensor w, double eps) {
  check(h, "h");
  check(d, "d");
  const int64_t T = h.size(0), H = h.size(1);
  TORCH_CHECK(d.size(0) == T && d.size(1) == H, "d must have h's shape");
  check_weight(w, H);
  at::Tensor y = at::empty({T, H}, h.options().memory_format(at::MemoryFormat::Contiguous));
  float* hp = h.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t hs = h.stride(0), ds = d.stride(0);
  at::parallel_for(0, T, ROWS_PER_TASK, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = hp + t * hs;
      const float* add = dp + t * ds;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) row[i] += add[i];
      norm_row(row, wp, yp + t * H, H, static_cast<float>(eps));
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "y = x * rsqrt(mean(x^2) + eps) * w, per row", py::arg("x"), py::arg("w"),
        py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "h += d in place, then rms_norm(h)", py::arg("h"), py::arg("d"),
        py::arg("w"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
}
