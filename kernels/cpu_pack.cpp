// Packing an adapter into pool rows on the CPU: every source matrix src [m, n] (any strides) is
// written transposed, dst [n, m] row-major, at its element offset in one flat output. This is the
// whole of unified_pager.adapter_rows.write_rows (A [r, in] -> A^T [in, r], B [out, r] -> B^T
// [r, out]) in one call: numpy's strided copies and their per-matrix Python cost were ~24 ms of a
// rank-16 SmolLM2 adapter's load on the dev CPU, on the path of every host-cache miss.
//
// The copy is bytes only (same dtype in and out), so one template per element size serves every
// floating dtype. Sources with contiguous rows and 4-byte elements go through 8 x 8 blocks
// transposed in AVX registers (where the build has AVX2); the rest through tiles of TILE x TILE
// scalars, which keep both the reads and the writes within a few cache lines.
//
// Optionally the same call tells which sources hold a NaN or an Inf: the packed copy is checked
// while it is still in cache, instead of a separate pass over the adapter's bytes in memory (that
// pass, torch's foreach norm, cost about as much as the packing itself).

#include "torch_ext.h"
#include <omp.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 16;

template <typename T>
void transpose_tiles(const T* src, int64_t m, int64_t n, int64_t s0, int64_t s1, T* dst, int64_t i_begin) {
  for (int64_t i0 = i_begin; i0 < m; i0 += TILE) {
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

#if defined(__AVX2__)
// dst[j * ld_dst + i] = src[i * ld_src + j] for an 8 x 8 block of 4-byte elements (bits only).
inline void block8x8(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  __m256 r[8], t[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(reinterpret_cast<const float*>(src + k * ld_src));
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x20);
    t[k + 4] = _mm256_permute2f128_ps(r[k], r[k + 4], 0x31);
  }
  for (int k = 0; k < 8; ++k) _mm256_storeu_ps(reinterpret_cast<float*>(dst + k * ld_dst), t[k]);
}
#endif

template <typename T>
void transpose_one(const T* src, int64_t m, int64_t n, int64_t s0, int64_t s1, T* dst) {
  int64_t done = 0;  // source rows (destination columns) already written by the vector blocks
#if defined(__AVX2__)
  if constexpr (sizeof(T) == 4) {
    if (s1 == 1 && m >= 8 && n >= 8) {
      const int64_t m8 = m / 8 * 8, n8 = n / 8 * 8;
      for (int64_t i0 = 0; i0 < m8; i0 += 8) {
        const uint32_t* s = reinterpret_cast<const uint32_t*>(src) + i0 * s0;
        uint32_t* d = reinterpret_cast<uint32_t*>(dst) + i0;
        for (int64_t j0 = 0; j0 < n8; j0 += 8) block8x8(s + j0, s0, d + j0 * m, m);
        for (int64_t j = n8; j < n; ++j)  // the last n % 8 columns of these rows
          for (int64_t i = 0; i < 8; ++i) d[j * m + i] = s[i * s0 + j];
      }
      done = m8;
    }
  }
#endif
  transpose_tiles<T>(src, m, n, s0, s1, dst, done);
}

template <typename T>
bool any_nonfinite(const T* p, int64_t count, T mask) {
  // All exponent bits set (an Inf or a NaN in any IEEE format, given its exponent mask) is
  // ~p & mask == 0: one unsigned min over the elements, which compilers vectorize (an OR of
  // comparisons into a bool they did not, and it cost as much as the transpose).
  T least = mask;
  for (int64_t k = 0; k < count; ++k) least = std::min<T>(least, static_cast<T>(~p[k] & mask));
  return count > 0 && least == 0;
}

// One source matrix [m, n] with strides (s0, s1), in elements of the output's size.
struct Src {
  const void* p;
  int64_t m, n, s0, s1;
};

template <typename T>
int64_t run(const std::vector<Src>& srcs, const int64_t* offsets, T* out, T mask) {
  std::vector<uint8_t> bad(srcs.size(), 0);
  at::parallel_for(0, static_cast<int64_t>(srcs.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Src& s = srcs[k];
      T* dst = out + offsets[k];
      transpose_one<T>(static_cast<const T*>(s.p), s.m, s.n, s.s0, s.s1, dst);
      if (mask != 0) bad[k] = any_nonfinite<T>(dst, s.m * s.n, mask);
    }
  });
  for (size_t k = 0; k < bad.size(); ++k)
    if (bad[k]) return static_cast<int64_t>(k);
  return -1;
}

// f(out, mask) with out's data as the unsigned integers of its element size (the copy moves bits only) and the
// mask checked to fit one: f's answer.
template <typename F>
int64_t by_element_size(const at::Tensor& out, uint64_t mask, F&& f) {
  switch (out.element_size()) {
    case 2:
      TORCH_CHECK(mask <= 0xFFFF, "nonfinite_mask wider than the element");
      return f(static_cast<uint16_t*>(out.data_ptr()), static_cast<uint16_t>(mask));
    case 4:
      TORCH_CHECK(mask <= 0xFFFFFFFFull, "nonfinite_mask wider than the element");
      return f(static_cast<uint32_t*>(out.data_ptr()), static_cast<uint32_t>(mask));
    case 8: return f(static_cast<uint64_t*>(out.data_ptr()), mask);
    default: TORCH_CHECK(false, "element size ", out.element_size(), " is not supported");
  }
  return -1;
}

int64_t run_sized(const std::vector<Src>& srcs, const int64_t* off, at::Tensor& out, uint64_t mask) {
  return by_element_size(out, mask, [&](auto* o, auto m) { return run(srcs, off, o, m); });
}

// run with every source read from the file fd by the thread that transposes it: matrix k's m x n elements from
// byte base + boff[k], into a buffer of the thread's (largest: the biggest matrix's bytes). -3 where a read
// came short or failed (out partly written).
template <typename T>
int64_t run_from_file(int fd, int64_t base, const int64_t* boff, const int64_t* shp, const int64_t* off,
                      int64_t count, int64_t largest, T* out, T mask) {
  std::vector<uint8_t> bad(count, 0);
  std::atomic<bool> short_read{false};
  at::parallel_for(0, count, 1, [&](int64_t lo, int64_t hi) {
    std::unique_ptr<T[]> buf(new T[largest / sizeof(T) + 1]);  // uninitialised: pread fills what is read
    auto* b = reinterpret_cast<uint8_t*>(buf.get());
    for (int64_t k = lo; k < hi && !short_read.load(std::memory_order_relaxed); ++k) {
      const int64_t m = shp[2 * k], n = shp[2 * k + 1], len = m * n * static_cast<int64_t>(sizeof(T));
      for (int64_t got = 0; got < len;) {
        const ssize_t r = pread(fd, b + got, static_cast<size_t>(len - got), static_cast<off_t>(base + boff[k] + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          short_read = true;
          return;
        }
        got += r;
      }
      transpose_one<T>(buf.get(), m, n, n, 1, out + off[k]);
      if (mask != 0) bad[k] = any_nonfinite<T>(out + off[k], m * n, mask);
    }
  });
  if (short_read) return -3;
  for (int64_t k = 0; k < count; ++k)
    if (bad[k]) return k;
  return -1;
}

void check_flat_out(const at::Tensor& out, const at::Tensor& offsets, int64_t count) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 1 && out.device().is_cpu(), "out must be a flat contiguous CPU tensor");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.numel() == count,
              "offsets: one int64 per source");
}

// The tables of transpose_from_buffer and transpose_from_file checked: per matrix one byte offset, one shape
// [rows, cols] and one output offset. Returns the number of matrices.
int64_t check_matrix_tables(const at::Tensor& byte_offsets, const at::Tensor& shapes, const at::Tensor& out,
                            const at::Tensor& offsets) {
  const int64_t count = byte_offsets.numel();
  check_flat_out(out, offsets, count);
  TORCH_CHECK(byte_offsets.scalar_type() == at::kLong && byte_offsets.is_contiguous(), "byte_offsets: int64");
  TORCH_CHECK(shapes.scalar_type() == at::kLong && shapes.is_contiguous() && shapes.dim() == 2 &&
                  shapes.size(0) == count && shapes.size(1) == 2,
              "shapes: [count, 2] int64");
  return count;
}

}  // namespace

// out: flat contiguous [N]; srcs: 2-D tensors of out's dtype on the CPU; offsets: [len(srcs)] int64,
// the first element of each transposed matrix in out. Every write is checked to lie inside out.
// nonfinite_mask: 0, or the dtype's exponent bits (float32: 0x7F800000): then the index of the first
// source holding a NaN or an Inf is returned (everything is written regardless), else -1.
int64_t transpose_into(std::vector<at::Tensor> srcs, at::Tensor out, at::Tensor offsets,
                       int64_t nonfinite_mask) {
  check_flat_out(out, offsets, static_cast<int64_t>(srcs.size()));
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<Src> views;
  views.reserve(srcs.size());
  for (size_t k = 0; k < srcs.size(); ++k) {
    const at::Tensor& s = srcs[k];
    TORCH_CHECK(s.dim() == 2 && s.scalar_type() == out.scalar_type() && s.device().is_cpu(),
                "source ", k, " must be a 2-D CPU tensor of the output's dtype");
    TORCH_CHECK(off[k] >= 0 && off[k] + s.numel() <= out.numel(), "source ", k, " does not fit in out");
    views.push_back({s.data_ptr(), s.size(0), s.size(1), s.stride(0), s.stride(1)});
  }
  return run_sized(views, off, out, static_cast<uint64_t>(nonfinite_mask));
}

// The same copy with every source a row-major matrix inside one byte buffer (a safetensors file read
// whole, or a stored blob): the caller names each matrix by its byte offset from `base` and its shape
// ([k, 0] rows, [k, 1] columns), instead of making a tensor view of each (420 views of a rank-16
// SmolLM2 adapter cost more than the copy itself). Every matrix is checked to lie inside the buffer and
// its destination inside out. Returns as transpose_into does, or -2 (nothing written) where a matrix
// starts at an address that is not a multiple of the element size: the caller then takes its other path.
int64_t transpose_from_buffer(py::buffer data, int64_t base, at::Tensor byte_offsets, at::Tensor shapes,
                              at::Tensor out, at::Tensor offsets, int64_t nonfinite_mask) {
  const py::buffer_info info = data.request();  // with the GIL: released below, for the copy only
  TORCH_CHECK(info.ndim == 1 && info.itemsize == 1 && info.strides[0] == 1, "data must be a flat byte buffer");
  const int64_t count = check_matrix_tables(byte_offsets, shapes, out, offsets);
  const int64_t size = static_cast<int64_t>(info.size);
  const int64_t esize = out.element_size();
  const auto* bytes = static_cast<const uint8_t*>(info.ptr);
  const int64_t* boff = byte_offsets.data_ptr<int64_t>();
  const int64_t* shp = shapes.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<Src> views;
  views.reserve(count);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t m = shp[2 * k], n = shp[2 * k + 1];
    TORCH_CHECK(m >= 0 && n >= 0 && base >= 0 && boff[k] >= 0, "matrix ", k, ": negative shape or offset");
    const int64_t begin = base + boff[k];
    TORCH_CHECK(begin <= size && m * n * esize <= size - begin, "matrix ", k, " does not lie inside the buffer");
    TORCH_CHECK(off[k] >= 0 && off[k] + m * n <= out.numel(), "matrix ", k, " does not fit in out");
    const uint8_t* p = bytes + begin;
    if (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(esize)) return -2;
    views.push_back({p, m, n, n, 1});
  }
  py::gil_scoped_release release;
  return run_sized(views, off, out, static_cast<uint64_t>(nonfinite_mask));
}

// The same copy with the matrices read from an open file (a safetensors file whose header a pack plan
// matched), by each thread for its own matrices: pread of one matrix into a buffer of the thread's, then
// transposed from there into out while those bytes are still in L2. Reading the whole file into a scratch
// buffer first and transposing from it (transpose_from_buffer) takes the adapter's bytes through memory twice
// more, and the read ran on one thread: a rank-16 SmolLM2 adapter's 19.5 MB read in 2.2 ms and transposed in
// 1.4 (AMD EPYC Zen 4, 2 threads, file in the page cache; RESULTS.md, thirty-third session). A read that
// comes short or fails (the file shrank or changed while read) returns -3, out partly written; the caller
// then takes its full path, which says what is wrong with the file. Otherwise returns as transpose_into does.
int64_t transpose_from_file(int64_t fd, int64_t base, at::Tensor byte_offsets, at::Tensor shapes, at::Tensor out,
                            at::Tensor offsets, int64_t nonfinite_mask) {
  const int64_t count = check_matrix_tables(byte_offsets, shapes, out, offsets);
  TORCH_CHECK(fd >= 0 && fd <= INT32_MAX && base >= 0, "fd and base must not be negative");
  const int64_t esize = out.element_size();
  const int64_t* boff = byte_offsets.data_ptr<int64_t>();
  const int64_t* shp = shapes.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  int64_t largest = 0;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t m = shp[2 * k], n = shp[2 * k + 1];
    TORCH_CHECK(m >= 0 && n >= 0 && boff[k] >= 0, "matrix ", k, ": negative shape or offset");
    TORCH_CHECK(off[k] >= 0 && off[k] + m * n <= out.numel(), "matrix ", k, " does not fit in out");
    largest = std::max(largest, m * n * esize);
  }
  return by_element_size(out, static_cast<uint64_t>(nonfinite_mask), [&](auto* o, auto mask) {
    return run_from_file(static_cast<int>(fd), base, boff, shp, off, count, largest, o, mask);
  });
}

// The OpenMP regions the calling thread starts from now on (torch's intra-op work, these kernels') run on
// it alone; torch's process-wide default and every other thread's team stay as they are
// (torch.set_num_threads would change the default that each thread adopts at its first parallel op, the
// engine's thread included). See kernels/cpu_threads.py for why threads beside the engine need this.
void confine_to_one_thread() {
  // torch sets a thread's team size lazily, at its first parallel op: done now, or it would undo this.
  at::internal::lazy_init_num_threads();
  omp_set_num_threads(1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("transpose_into", &transpose_into,
        "write each source transposed into a flat output, at its offset; the first source with a NaN or Inf",
        py::arg("srcs"), py::arg("out"), py::arg("offsets"), py::arg("nonfinite_mask") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("transpose_from_buffer", &transpose_from_buffer,
        "transpose_into with row-major sources inside one byte buffer, named by byte offset and shape",
        py::arg("data"), py::arg("base"), py::arg("byte_offsets"), py::arg("shapes"), py::arg("out"),
        py::arg("offsets"), py::arg("nonfinite_mask") = 0);
  m.def("transpose_from_file", &transpose_from_file,
        "transpose_from_buffer with the matrices read from an open file by the threads that transpose them",
        py::arg("fd"), py::arg("base"), py::arg("byte_offsets"), py::arg("shapes"), py::arg("out"), py::arg("offsets"),
        py::arg("nonfinite_mask") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("confine_to_one_thread", &confine_to_one_thread,
        "OpenMP regions started by the calling thread run on it alone (others' teams unchanged)");
}
