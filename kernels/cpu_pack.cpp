// Packing an adapter into pool rows on the CPU: every source matrix src [m, n] (any strides) is
// written transposed, dst [n, m] row-major, at its element offset in one flat output. This is the
// whole of unified_pager.adapter_rows.write_rows (A [r, in] -> A^T [in, r], B [out, r] -> B^T
// [r, out]) in one call: numpy's strided copies and their per-matrix Python cost were ~24 ms of a
// rank-16 SmolLM2 adapter's load on the dev CPU, on the path of every host-cache miss.
//
// The copy is bytes only (same dtype in and out), so one template per element size serves every
// floating dtype. Tiles of TILE x TILE keep both the reads and the writes within a few cache lines.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t TILE = 16;

template <typename T>
void transpose_one(const T* src, int64_t m, int64_t n, int64_t s0, int64_t s1, T* dst) {
  for (int64_t i0 = 0; i0 < m; i0 += TILE) {
    const int64_t i1 = std::min(m, i0 + TILE);
    for (int64_t j0 = 0; j0 < n; j0 += TILE) {
      const int64_t j1 = std::min(n, j0 + TILE);
      for (int64_t j = j0; j < j1; ++j) {
        T* d = dst + j * m;
        const T* s = src + j * s1;
        for (int64_t i = i0; i < i1; ++i) d[i] = s[i * s0];
      }
    }
  }
}

template <typename T>
void run(const std::vector<torch::Tensor>& srcs, const int64_t* offsets, T* out) {
  at::parallel_for(0, static_cast<int64_t>(srcs.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const torch::Tensor& s = srcs[k];
      transpose_one<T>(static_cast<const T*>(s.data_ptr()), s.size(0), s.size(1), s.stride(0), s.stride(1),
                       out + offsets[k]);
    }
  });
}

}  // namespace

// out: flat contiguous [N]; srcs: 2-D tensors of out's dtype on the CPU; offsets: [len(srcs)] int64,
// the first element of each transposed matrix in out. Every write is checked to lie inside out.
void transpose_into(std::vector<torch::Tensor> srcs, torch::Tensor out, torch::Tensor offsets) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 1 && out.device().is_cpu(), "out must be a flat contiguous CPU tensor");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() &&
                  offsets.numel() == static_cast<int64_t>(srcs.size()),
              "offsets: one int64 per source");
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (size_t k = 0; k < srcs.size(); ++k) {
    const torch::Tensor& s = srcs[k];
    TORCH_CHECK(s.dim() == 2 && s.scalar_type() == out.scalar_type() && s.device().is_cpu(),
                "source ", k, " must be a 2-D CPU tensor of the output's dtype");
    TORCH_CHECK(off[k] >= 0 && off[k] + s.numel() <= out.numel(), "source ", k, " does not fit in out");
  }
  switch (out.element_size()) {
    case 2: run<uint16_t>(srcs, off, static_cast<uint16_t*>(out.data_ptr())); break;
    case 4: run<uint32_t>(srcs, off, static_cast<uint32_t*>(out.data_ptr())); break;
    case 8: run<uint64_t>(srcs, off, static_cast<uint64_t*>(out.data_ptr())); break;
    default: TORCH_CHECK(false, "element size ", out.element_size(), " is not supported");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("transpose_into", &transpose_into, "write each source transposed into a flat output, at its offset",
        py::call_guard<py::gil_scoped_release>());
}
