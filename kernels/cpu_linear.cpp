// The base model's projections on the CPU in float32: y [M, N] = x [M, K] @ W^T (+ bias), with W
// prepacked once, at model load, into panels of NR output columns: panels [P, K, NR], P = ceil(N / NR),
// zero-padded past N.
//
// Why our own: MKL's sgemm repacks W on every call, and oneDNN's prepacked linear, at SmolLM2's shapes
// (K = 576 or 1536) on 2 threads, is slow at decode batch sizes: timed call by call against it on the
// dev CPU (benchmarks/cpu_linear_bench.py, RESULTS.md), this kernel ran 1.5-1.8x faster at 12 rows and
// 1.2x at 64; at prefill chunks (2048 rows) the two are within a few percent. Here a panel row (NR
// floats) is two vector loads that serve up to MR rows of x: the weights stream from memory once per
// block of MR rows, and the block is FMA-bound above a few rows.
//
// Loops, outside in: threads split the panels (each writes its own columns, no reduction); a chunk of
// MC rows of x (sized to stay in L2 while every panel of the thread passes over it); panels; blocks of
// at most MR rows, balanced (64 rows on AVX-512: 6 blocks of 10-11, not 5 of 12 and a lone 4) so that
// every block keeps enough independent accumulators to hide the FMA latency.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace {

#if defined(__AVX512F__)
constexpr int V = 16;   // floats per vector register
constexpr int MR = 12;  // rows per block: 2 x 12 accumulators of the 32 registers
#else
constexpr int V = 8;    // AVX2 (or narrower: the compiler splits the vectors)
constexpr int MR = 6;   // 2 x 6 accumulators of the 16 registers
#endif
constexpr int NR = 2 * V;  // panel width: two vectors per row of x
constexpr int64_t X_CHUNK_BYTES = 512 * 1024;  // a chunk of x rows kept in L2 across the thread's panels

typedef float vec __attribute__((vector_size(V * sizeof(float))));
typedef float vec_u __attribute__((vector_size(V * sizeof(float)), aligned(4)));  // unaligned access

inline vec load(const float* p) { return *reinterpret_cast<const vec_u*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vec_u*>(p) = v; }

// One block of R rows x one panel: R x NR outputs, every k once. R is a compile-time constant so that
// the 2R accumulators live in registers. next: the panel after this one, or null. The first block of a
// panel pulls it in from memory; it also prefetches the next panel into L2, so that while the later
// blocks compute on this one, the next one is already on its way (the hardware prefetchers stop at
// every 4 KB page; a panel is 18 pages at K = 576). Without it the LM head, 113 MB read once per
// step, ran at 144 GFLOP/s at 64 rows against oneDNN's 179.
template <int R>
void block(const float* __restrict x, int64_t xs, const float* __restrict w, int64_t K, float* __restrict y,
           int64_t ys, int ncols, const float* __restrict bias, const float* next) {
  vec a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    if (next != nullptr) {
      __builtin_prefetch(next + k * NR, 0, 2);
      __builtin_prefetch(next + k * NR + 16, 0, 2);
    }
    const vec w0 = load(w + k * NR), w1 = load(w + k * NR + V);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * xs + k];
      a0[r] += xv * w0;
      a1[r] += xv * w1;
    }
  }
  vec b0{}, b1{};
  if (bias != nullptr && ncols == NR) b0 = load(bias), b1 = load(bias + V);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* out = y + r * ys;
    if (ncols == NR) {
      store(out, a0[r] + b0);
      store(out + V, a1[r] + b1);
    } else {  // the last panel of an N that NR does not divide: only the real columns
      float tmp[NR];
      store(tmp, a0[r]);
      store(tmp + V, a1[r]);
      for (int c = 0; c < ncols; ++c) out[c] = tmp[c] + (bias != nullptr ? bias[c] : 0.0f);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int, const float*,
                         const float*);

template <int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs)> block_table(std::integer_sequence<int, Rs...>) {
  return {&block<Rs + 1>...};
}
constexpr auto BLOCKS = block_table(std::make_integer_sequence<int, MR>{});  // BLOCKS[r - 1]: r rows

// Rows [m0, m0 + m) of x against one panel, in ceil(m / MR) blocks whose sizes differ by at most one.
void rows_by_panel(const float* x, int64_t xs, int64_t m0, int64_t m, const float* w, int64_t K, float* y,
                   int64_t ys, int ncols, const float* bias, const float* next) {
  const int64_t nb = (m + MR - 1) / MR;
  const int64_t base = m / nb, extra = m % nb;
  int64_t r0 = m0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t rows = base + (b < extra ? 1 : 0);
    BLOCKS[rows - 1](x + r0 * xs, xs, w, K, y + r0 * ys, ys, ncols, bias, b == 0 ? next : nullptr);
    r0 += rows;
  }
}

}  // namespace

int64_t panel_width() { return NR; }

// x [M, K] float32 (rows may be strided, columns contiguous); panels [P, K, NR] (pack_panels);
// bias [N] or None. Returns y [M, N] float32, contiguous.
torch::Tensor linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  (x.stride(1) == 1 || x.size(1) <= 1 || x.numel() == 0),  // a size-1 dim's stride is arbitrary
              "x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == NR,
              "panels must be contiguous float32 [P, K, ", NR, "] (packed for this build)");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " features, the packed weight ", panels.size(1));
  TORCH_CHECK(n > (P - 1) * NR && n <= P * NR, "out features ", n, " do not match ", P, " panels");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "bias must be contiguous float32 [", n, "]");
    bp = bias->data_ptr<float>();
  }
  torch::Tensor y = torch::empty({M, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || n == 0) return y;
  if (K == 0) return bp != nullptr ? y.copy_(bias->expand({M, n})) : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t chunk = std::max<int64_t>(MR, X_CHUNK_BYTES / (K * 4) / MR * MR);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t m = std::min(chunk, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const int ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
        rows_by_panel(xp, xs, m0, m, wp + p * K * NR, K, yp + p * NR, n, ncols, bp == nullptr ? nullptr : bp + p * NR,
                      p + 1 < p1 ? wp + (p + 1) * K * NR : nullptr);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_width", &panel_width, "NR: output columns per packed panel in this build");
  // Without the GIL while it runs: the server's threads keep going meanwhile.
  m.def("linear", &linear, "y = x @ W^T (+ bias) with W packed in panels", py::arg("x"), py::arg("panels"),
        py::arg("bias"), py::arg("n"), py::call_guard<py::gil_scoped_release>());
}
