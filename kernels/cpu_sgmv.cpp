// SGMV on the CPU: y[seg] += scale_a * (x[seg] @ A_a^T) @ B_a^T for every segment of one
// (layer, module), reading A^T [in, r] and B^T [r, out] in place from the unified pool through
// each segment's page table. One call per (layer, module) for the whole batch: the torch path
// needed several ops per segment or rank group there, and their fixed costs dominated.
//
// Pool addressing: cpu_pool_tables.h.
//
// Work items are (segment, block of up to TB tokens): a decode batch of distinct adapters spreads
// one item per adapter over the threads; a long prefill segment spreads its token blocks (each
// re-reads the adapter's matrices, from cache after the first).

#include "torch_ext.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_family.h"
#include "cpu_lora_shrink.h"
#include "cpu_pool_tables.h"

namespace {

using namespace lora_shrink;  // VEC, MAX_RANK, the vector types, the blocked shrink of long segments

constexpr int TB = 8;        // tokens per work item: a row of A^T or a chunk of B^T is loaded once for TB tokens

// Register budget: AVX-512 has 32 vector registers of 16 floats, AVX2 16 of 8. The blockings below
// keep the accumulators at about half of them on either (on AVX2 the AVX-512 blocking spilled:
// 4 tokens x 64 columns is 32 ymm registers).
constexpr int SHRINK_NT = VEC == 16 ? TB : TB / 2;  // tokens per shrink pass over A^T (rank-16 accumulators)
constexpr int EXPAND_NT = VEC == 16 ? 4 : 2;        // tokens per expand pass over B^T
constexpr int W = 4 * VEC;                          // expand columns per pass
// A lone (decode) token's shrink is a chain of dependent FMAs per accumulator: P partial sums over
// alternate rows of A^T let the FMA units overlap them (latency 4-5 cycles, 1-2 issued per cycle).
constexpr int P = 4;


// Walks a matrix's elements in order, n at a time, with one division per page instead of per step.
struct Cursor {
  const Pages& pg;
  int64_t e, end;  // next element, one past the matrix
  const float* p = nullptr;
  int64_t left = 0;  // elements from p to the end of its page
  Cursor(const Pages& pages, int64_t first, int64_t count) : pg(pages), e(first), end(first + count) {
    if (e < end) p = pg.at(e, &left);
  }
  inline const float* next(int64_t n, float* buf) {
    if (left >= n) {
      const float* r = p;
      p += n, left -= n, e += n;
      return r;
    }
    const float* r = pg.span(e, n, buf);  // crosses a page boundary: copied
    e += n;
    if (e < end) p = pg.at(e, &left);
    return r;
  }
};

// Shrink of nt tokens: s[t][:rank] = scale * x_t @ A^T, one row of A^T read for all tokens.
// R > 0: the rank is a compile-time constant, so the accumulators stay in vector registers.
template <int R, int NT>
inline void shrink(float (*__restrict s)[MAX_RANK], const float* __restrict x, int64_t x_stride, int nt,
                   const Pages& pg, int64_t a_elem, int rank, int64_t in, float scale) {
  float buf[MAX_RANK];  // a row of A^T that crosses a page boundary
  if constexpr (R > 0 && NT == 1) {
    float acc[P][R] = {};
    Cursor cur(pg, a_elem, in * R);
    int64_t i = 0;
    for (; i + P <= in; i += P) {
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q) {
        const float* __restrict a = cur.next(R, buf);  // used before the next call
        __builtin_prefetch(a + 32 * 16, 0, 2);  // 2 KB ahead (harmless where it runs past a page)
        const float xv = x[i + q];
#pragma omp simd
        for (int j = 0; j < R; ++j) acc[q][j] += xv * a[j];
      }
    }
    for (; i < in; ++i) {
      const float* __restrict a = cur.next(R, buf);
      const float xv = x[i];
#pragma omp simd
      for (int j = 0; j < R; ++j) acc[0][j] += xv * a[j];
    }
    for (int j = 0; j < R; ++j) s[0][j] = (acc[0][j] + acc[1][j] + acc[2][j] + acc[3][j]) * scale;
  } else if constexpr (R > 0) {
    float acc[NT][R] = {};
    Cursor cur(pg, a_elem, in * R);
    for (int64_t i = 0; i < in; ++i) {
      const float* __restrict a = cur.next(R, buf);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        const float xv = x[t * x_stride + i];
#pragma omp simd
        for (int j = 0; j < R; ++j) acc[t][j] += xv * a[j];
      }
    }
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < R; ++j) s[t][j] = acc[t][j] * scale;
  } else {
    for (int t = 0; t < nt; ++t) std::fill(s[t], s[t] + rank, 0.f);
    Cursor cur(pg, a_elem, in * rank);
    for (int64_t i = 0; i < in; ++i) {
      const float* __restrict a = cur.next(rank, buf);
      for (int t = 0; t < nt; ++t) {
        const float xv = x[t * x_stride + i];
        float* __restrict st = s[t];
#pragma omp simd
        for (int j = 0; j < rank; ++j) st[j] += xv * a[j];
      }
    }
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < rank; ++j) s[t][j] *= scale;
  }
}

// Expand of nt tokens: y_t += s_t @ B^T, W columns at a time (acc_t = sum_k s_t[k] * B^T[k, cols],
// then one add into y). D divides out and B^T starts on a row, so W columns within a D-wide row
// never cross a page. NT > 0: the token count is a compile-time constant (registers again).
template <int NT>
inline void expand(float* __restrict y, int64_t y_stride, const float (*__restrict s)[MAX_RANK], int nt,
                   const float* const* rows, int rank, int64_t out, int64_t d) {
  // rows[j]: pool row j of B^T (rank * out / d of them, d elements each, contiguous)
  const int n = NT > 0 ? NT : nt;
  const int64_t rows_per_k = out / d;
  for (int64_t c0 = 0; c0 < out; c0 += d) {
    for (int64_t c = c0; c < c0 + d; c += W) {
      const int64_t w = std::min<int64_t>(W, c0 + d - c);
      float acc[NT > 0 ? NT : TB][W] = {};
      for (int k = 0; k < rank; ++k) {
        const float* __restrict b = rows[k * rows_per_k + c0 / d] + (c - c0);
        if (w == W) {
#pragma GCC unroll 8
          for (int t = 0; t < n; ++t) {
            const float sv = s[t][k];
#pragma omp simd
            for (int q = 0; q < W; ++q) acc[t][q] += sv * b[q];
          }
        } else {
          for (int t = 0; t < n; ++t)
            for (int64_t q = 0; q < w; ++q) acc[t][q] += s[t][k] * b[q];
        }
      }
      for (int t = 0; t < n; ++t) {
        float* __restrict yt = y + t * y_stride + c;
#pragma omp simd
        for (int64_t q = 0; q < w; ++q) yt[q] += acc[t][q];
      }
    }
  }
}

// n (< SHRINK_NT) tokens with a compile-time count: shrink<R, n>.
template <int R, int N = 1>
inline void shrink_n(int n, float (*s)[MAX_RANK], const float* x, int64_t xs, const Pages& pg, int64_t a, int rank,
                     int64_t in, float scale) {
  if constexpr (N < SHRINK_NT) {
    if (n == N) shrink<R, N>(s, x, xs, N, pg, a, rank, in, scale);
    else shrink_n<R, N + 1>(n, s, x, xs, pg, a, rank, in, scale);
  }
}

template <int R>
void shrink_block(float (*s)[MAX_RANK], const float* x, int64_t xs, int nt, const Pages& pg, int64_t a, int rank,
                  int64_t in, float scale) {
  // Fixed-size kernels for every token count: decode batches where a few requests share an adapter
  // make segments of 2-7 tokens, which the runtime-count loops read at 14 GB/s (dev CPU, 2 threads,
  // 30 adapters per layer, 3 tokens each) where one token's kernel reaches 21.
  int t0 = 0;
  for (; t0 + SHRINK_NT <= nt; t0 += SHRINK_NT)
    shrink<R, SHRINK_NT>(s + t0, x + t0 * xs, xs, SHRINK_NT, pg, a, rank, in, scale);
  if (t0 < nt) shrink_n<R>(nt - t0, s + t0, x + t0 * xs, xs, pg, a, rank, in, scale);
}

// n (< EXPAND_NT) tokens with a compile-time count: expand<n>.
template <int N = 1>
inline void expand_n(int n, float* y, int64_t ys, const float (*s)[MAX_RANK], const float* const* rows, int rank,
                     int64_t out, int64_t d) {
  if constexpr (N < EXPAND_NT) {
    if (n == N) expand<N>(y, ys, s, N, rows, rank, out, d);
    else expand_n<N + 1>(n, y, ys, s, rows, rank, out, d);
  }
}

// Pointers to the n pool rows (d elements each) of a matrix stored from logical element e on: one
// division per page crossed, not per row.
std::vector<const float*> b_rows(const Pages& pg, int64_t e, int64_t n, int64_t d) {
  std::vector<const float*> rows(n);
  int64_t run;
  const float* p = pg.at(e, &run);
  for (int64_t j = 0; j < n; ++j) {
    if (run < d) p = pg.at(e + j * d, &run);
    rows[j] = p;
    p += d, run -= d;
  }
  return rows;
}

// Expand as sweeps over B^T's rows: for each k, y_t[:out] += s_t[k] * B^T[k, :out] for the nt tokens,
// B^T read once front to back (a stream the hardware prefetcher follows) while y's nt rows stay in L1.
// The AVX2 build's expand: on the AMD EPYC dev CPU the column-chunk loops of expand() spilled their
// accumulators and stalled on B^T's 16-row column walks (a decode step's 210 calls, 30 adapters of
// ranks 8/16, 2-3 tokens each: 57 -> 45-51 ms with this and without the B^T prefetch).
inline void expand_rows(float* __restrict y, int64_t ys, const float (*__restrict s)[MAX_RANK], int nt,
                        const float* const* rows, int rank, int64_t out, int64_t d) {
  const int64_t rows_per_k = out / d;
  for (int k = 0; k < rank; ++k)
    for (int64_t j = 0; j < rows_per_k; ++j) {
      const float* __restrict b = rows[k * rows_per_k + j];
      for (int t = 0; t < nt; ++t) {
        const float sv = s[t][k];
        float* __restrict yt = y + t * ys + j * d;
#pragma omp simd
        for (int64_t q = 0; q < d; ++q) yt[q] += sv * b[q];
      }
    }
}

// y[t0:t0+nt, :out] += scale * (x[t0:t0+nt] @ A^T) @ B^T for one adapter.
void apply_block(float* __restrict y, int64_t y_stride, const float* __restrict x, int64_t x_stride, int nt,
                 const Pages& pg, int64_t a_elem, int64_t b_elem, int rank, int64_t in, int64_t out, int64_t d,
                 float scale) {
  alignas(64) float s[TB][MAX_RANK];
  const std::vector<const float*> rows = b_rows(pg, b_elem, rank * out / d, d);
  if constexpr (VEC == 16) {
    // B^T's pool rows are asked for now, so that their reads from memory overlap the shrink's (a
    // decode token's adapter is read once, and one stream of A^T at a time left the memory bus idle
    // for part of the step). On the AVX2 dev CPU (AMD EPYC) the same prefetches only slowed the
    // step: the expand below reads B^T front to back there instead.
    for (const float* r : rows)
      for (int64_t off = 0; off < d; off += 64 / sizeof(float)) __builtin_prefetch(r + off, 0, 2);
  }
  switch (rank) {
    case 8: shrink_block<8>(s, x, x_stride, nt, pg, a_elem, rank, in, scale); break;
    case 16: shrink_block<16>(s, x, x_stride, nt, pg, a_elem, rank, in, scale); break;
    case 32: shrink_block<32>(s, x, x_stride, nt, pg, a_elem, rank, in, scale); break;
    default: shrink<0, 0>(s, x, x_stride, nt, pg, a_elem, rank, in, scale);
  }
  if constexpr (VEC != 16) {
    expand_rows(y, y_stride, s, nt, rows.data(), rank, out, d);
    return;
  }
  // EXPAND_NT tokens x W columns of accumulators: half the vector registers (8 tokens would spill).
  int t0 = 0;
  for (; t0 + EXPAND_NT <= nt; t0 += EXPAND_NT)
    expand<EXPAND_NT>(y + t0 * y_stride, y_stride, s + t0, EXPAND_NT, rows.data(), rank, out, d);
  if (t0 < nt) expand_n(nt - t0, y + t0 * y_stride, y_stride, s + t0, rows.data(), rank, out, d);
}

// ---- Long segments (prefill chunks): register-blocked, as cpu_linear.cpp's GEMM --------------------
// The token-block path above re-reads a row of A^T for only 8 tokens and keeps x and s in memory;
// at 128-token segments it ran at 70 GFLOP/s on the dev CPU, against 390 for the base GEMMs, and
// a BLAS GEMM pair per segment was no faster (its calls are too small to reach speed). Here a block
// of up to LMR tokens keeps its shrink accumulators in vector registers over all of A^T, then its
// expand accumulators over each column chunk of B^T: every weight vector loaded serves LMR tokens.
// It applies where the rank is a multiple of 8 and D of the vector width (vector loads of A^T rows
// and B^T columns); other segments stay with the caller's BLAS GEMMs.

// y[r][cols] += s_r @ B^T[:, cols] for R tokens and NV*VEC columns; bcol[k]: B^T[k, cols] (contiguous).
template <int R, int NV>
void expand_chunk(float* __restrict y, int64_t ys, const float (*__restrict s)[MAX_RANK],
                  const float* const* __restrict bcol, int rank) {
  vecv acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vecv{};
  for (int k = 0; k < rank; ++k) {
    vecv b[NV];
    for (int v = 0; v < NV; ++v) b[v] = vload<vecv>(bcol[k] + v * VEC);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float sv = s[r][k];
      for (int v = 0; v < NV; ++v) acc[r][v] += sv * b[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) vstore<vecv>(y + r * ys + v * VEC, vload<vecv>(y + r * ys + v * VEC) + acc[r][v]);
}

// One block of R tokens: shrink, then expand over every column chunk. bptr[k * (out / d) + j]: pool
// row j of B^T's row k.
template <int R>
void long_block(float* y, int64_t ys, const float* x, int64_t xs, const float* const* arow, int64_t K,
                const float* const* bptr, int rank, int64_t out, int64_t d, float scale) {
  alignas(64) float s[R][MAX_RANK];
  shrink_rows<R>(x, xs, arow, K, rank, scale, s);
  const int64_t per_k = out / d;
  const float* bcol[MAX_RANK];
  for (int64_t col = 0; col < out;) {
    // Two vectors of columns where the pool row (D wide, contiguous) holds them, else one.
    const int nv = (col % d) + 2 * VEC <= d ? 2 : 1;
    for (int k = 0; k < rank; ++k) bcol[k] = bptr[k * per_k + col / d] + col % d;
    if (nv == 2) expand_chunk<R, 2>(y + col, ys, s, bcol, rank);
    else expand_chunk<R, 1>(y + col, ys, s, bcol, rank);
    col += nv * VEC;
  }
}

using LongFn = void (*)(float*, int64_t, const float*, int64_t, const float* const*, int64_t, const float* const*,
                        int, int64_t, int64_t, float);
template <int... Rs>
constexpr std::array<LongFn, sizeof...(Rs)> long_table(std::integer_sequence<int, Rs...>) {
  return {&long_block<Rs + 1>...};
}
constexpr auto LONG_BLOCKS = long_table(std::make_integer_sequence<int, LMR>{});  // [r - 1]: r tokens

// Tokens [0, nt) of one segment's rows in balanced blocks of at most LMR; the pointer tables (A^T's
// rows, B^T's pool rows) are built once per item.
void long_item(float* y, int64_t ys, const float* x, int64_t xs, int64_t nt, const Pages& pg, int64_t a_elem,
               int64_t b_elem, int rank, int64_t in, int64_t out, int64_t d, float scale) {
  std::vector<float> spill;
  const std::vector<const float*> arow = a_rows(pg, a_elem, rank, in, spill);
  const std::vector<const float*> bptr = b_rows(pg, b_elem, rank * out / d, d);
  in_blocks(nt, [&](int64_t t, int64_t rows) {
    LONG_BLOCKS[rows - 1](y + t * ys, ys, x + t * xs, xs, arow.data(), in, bptr.data(), rank, out, d, scale);
  });
}

// ---- Decode items: up to FEW tokens of one adapter --------------------------------------------------
// apply_block's loops keep their accumulators in float arrays, and the page-crossing copy (a memcpy call)
// inside the row loop made GCC keep them on the stack: every row of A^T then waited on a store-to-load
// forward. With a 2-3 token item per adapter (a decode batch of 64 over 30 adapters) that kernel ran at
// 5x the time of a plain read of the same bytes with the data in cache, and at 14 GB/s from memory on the
// AMD EPYC (Zen 5) dev CPU, whose read ceiling is 37-48 GB/s. Here the accumulators are vector values,
// A^T is walked in runs of whole rows inside a page (the rare row that crosses a page is copied by an
// inline loop, outside the hot loop), and a short token group sums P row phases so that enough FMA
// chains are in flight. The expand keeps NT x NW column vectors in registers over all of B^T's rows.

constexpr int FEW = 4;  // tokens per decode item
// Software prefetch in the decode kernels: the shrink asks for A^T FEW_AHEAD floats (4 KB) ahead of the
// rows it reads, a slice per step, and the expand, while it sweeps B^T's rows k at pool row j, for
// their pool row j + 1: B^T is read in rank strided streams, and A^T's runs are short (a page), more
// than the hardware prefetchers follow. One B=64 decode step's apply_lora calls (30 adapters of ranks
// 8/16, 30 layers x 7 modules; builds alternating in one process, AMD EPYC Zen 5), ms median in four
// runs: without 18.6 / 14.2 / 16.9 / 18.3; 4 KB ahead - / 11.0 / 12.8 / 14.0; 2 KB 16.2 / 11.9 / - / -;
// 8 KB - / 10.9 / 13.0 / -.
constexpr int64_t FEW_AHEAD = 1024;

// The next decode item's adapter bytes (its A^T, then its B^T), asked for into L2 while the current item computes,
// as many floats of it as the current item reads, so that each item finds its rows already on their way: the
// shrink's FEW_AHEAD lead within an item is about one memory latency, every item starts a new stream (another
// adapter, or another module's matrices), and a thread otherwise computed on one item while its next one had not
// been asked for. On an AMD EPYC Zen 4, benchmarks/cpu_lora_decode_bench.py with this beside the build before
// (`--baseline-source`, builds alternating in one process, paired medians of the step, RESULTS.md, thirty-sixth
// session): 64 tokens over 30 adapters -1.18 and -1.46 ms of 17.4 and 14.1 (faster in 38 and 37 of 40 rounds),
// one thread -3.45 of 26.3; 48 / 30 -1.11, 24 / 16 -0.46, 8 / 8 -0.12 (no change). Asking for two floats a float
// read ran 0 to 2 ms slower than one, and half a float 0.8 ms slower. Those runs took the row sweep
// (few_expand_rows). On Intel Xeons the asks made the step slower, whichever expand ran: next_item_asks.
struct NextItem {
  Pages pg{nullptr, nullptr, 1};
  int64_t e[2]{}, end[2]{};
  int r = 2;  // the range being walked; 2: nothing (left) to ask for
  const float* p = nullptr;
  int64_t run = 0;  // floats left from p to its page's end
  void start(const Pages& pages, int64_t a_elem, int64_t a_n, int64_t b_elem, int64_t b_n) {
    pg = pages, e[0] = a_elem, end[0] = a_elem + a_n, e[1] = b_elem, end[1] = b_elem + b_n, r = 0, run = 0;
  }
  // The next `floats` floats of the ranges, a line (16 floats) per prefetch.
  inline void ask(int64_t floats) {
    while (floats > 0 && r < 2) {
      if (e[r] >= end[r]) {
        ++r, run = 0;
        continue;
      }
      if (run <= 0) p = pg.at(e[r], &run);
      const int64_t take = std::min(std::min(floats, run), end[r] - e[r]);
      for (int64_t o = 0; o < take; o += 16) __builtin_prefetch(p + o, 0, 2);
      p += take, run -= take, e[r] += take, floats -= take;
    }
  }
};

// Whether the decode kernels take their L1 form: the shrink's prefetches into L1 rather than L2 (few_shrink's HINT),
// rank 8's shrink two rows of A^T to a vector (few_shrink8x2, AVX-512), and, where the expand sweeps B^T's rows
// (expand_by_rows: AMD CPUs), 8 rows at a time without asking for the next rows (few_expand_rows); no next-item asks
// (next_item_asks). Taken on AMD Zen 5 and on Intel CPUs (AVX-512 builds); the AMD CPUs before Zen 5 keep the form
// before it.
// On an AMD EPYC family 26 model 2 (Zen 5: AVX-512, 1 MiB L2 a core, 32 MiB L3, 2 vCPUs, memory read at 94-100
// GB/s), one B=64 decode step's LoRA, 64 tokens over 30 adapters of ranks 8/16 (benchmarks/cpu_lora_decode_bench.py
// --batch 64 --adapters 30 --reps 30 --layers 30, each step's build beside the one before, paired medians of 30
// rounds; RESULTS.md, forty-second session), ms: the asks off -0.16 and -0.24 of 7.9 (faster in 30 and 38 of 40);
// then 8 rows a sweep without the next rows' asks -0.49 of 7.70 (27 of 30; 8 rows with the asks -0.27, 16 rows
// +0.22, B^T asked for a pool row ahead +0.04); then rank 8 in pairs -0.14 of 7.36 (23 of 30); then the
// prefetches into L1 -0.12 and -0.11 (23 and 22 of 30; without them +1.02). Asking for the item's own B^T during
// its shrink (as NextItem asks for the next item's) cost +0.52, into L1 +0.41. The whole form against the build
// before it (medians): 7.94 -> 7.34 and 7.88 -> 7.26 ms (paired -0.59, -0.60), one thread 14.38 -> 13.33, 48 / 30
// 8.20 -> 7.16, 24 / 16 4.38 -> 3.92, 8 / 8 2.35 -> 2.00; with the step's adapters in L3 (one layer, one thread)
// 0.35 -> 0.23.
// On an Intel Xeon (family 6 model 167, AVX-512, 2 MB L2 a core; the same bench, the form forced beside this build's
// form before, RESULTS.md, forty-third session), with the column-chunk expand that Intel CPUs keep: 64 / 30 -0.44,
// -0.63, -0.47 and -0.44 ms of 19.4-22.3 (faster in 21, 27, 23 and 22 of 30 rounds), one thread -1.89 of 40.4 (30 of
// 30), 48 / 30 -0.19, 24 / 16 -0.09, 8 / 8 -0.13. The prefetches into L1 alone measured -0.43, rank 8 in pairs alone
// -0.26; with the row sweep the form lost (+0.33).
// LORAPLEX_SGMV_L1_FORM / _NO_L1_FORM force either (tests/kernels/test_cpu_sgmv.py builds the one not chosen here).
bool l1_decode() {
#if defined(LORAPLEX_SGMV_L1_FORM)
  return true;
#elif defined(LORAPLEX_SGMV_NO_L1_FORM)
  return false;
#elif defined(__AVX512F__)
  return cpu_family::zen5() || !cpu_family::amd();
#else
  return cpu_family::zen5();  // Intel's figures are of AVX-512 builds; off x86 false
#endif
}

// Whether the decode items ask for the next item's bytes (NextItem): on AMD CPUs before Zen 5 (l1_decode), not on the
// others. On an Intel Xeon (family 6 model 167, AVX-512, 2 MB L2 a core; benchmarks/cpu_lora_decode_bench.py with the
// build without the asks beside this one, alternating in one process, paired medians of 30 rounds, RESULTS.md,
// thirty-eighth session) the asks cost 64 tokens over 30 adapters +1.76 ms of 21.9 (slower in 27 of 30 rounds), one
// thread +2.87 of 39.3 (30 of 30), 48 / 30 +1.41, 24 / 16 +1.00, 8 / 8 +0.20; with the row sweep the same (+1.64 at
// 64 / 30). The VM gives no hardware counters to say why; a likely cause is that a software prefetch there holds one of
// the core's few fill buffers until its line arrives, where the hardware's own streams over the adapters' runs of pages
// do not. On the AMD EPYC Zen 3 (AVX2) the asks measured within noise, on the Zen 4 faster (above).
// LORAPLEX_SGMV_NEXT_ITEM / _NO_NEXT_ITEM force either (tests/kernels/test_cpu_sgmv.py builds the one not chosen here).
bool next_item_asks() {
#if defined(LORAPLEX_SGMV_NEXT_ITEM)
  return true;
#elif defined(LORAPLEX_SGMV_NO_NEXT_ITEM)
  return false;
#elif defined(__x86_64__) || defined(__i386__)
  return cpu_family::amd() && !l1_decode();
#else
  return true;  // measured on x86 CPUs only: as it was before the Intel runs
#endif
}

// A^T's first FEW_AHEAD floats (of its n), which the shrink loops' prefetches (FEW_AHEAD on) never ask for, asked for
// at once where the item before did not (NextItem). One B=64 decode step's LoRA, 64 tokens over 30 adapters
// (cpu_lora_decode_bench.py, the build before beside it, paired medians of 30 rounds, Intel Xeon family 6 model 167,
// RESULTS.md, fortieth session): -0.24 and -0.25 ms of 16.8-17.0 (faster in 24 and 20 of 30 rounds), one thread
// -0.51 of 34.0 (27 of 30); 24 / 16 -0.09; the scaling runs' step -0.03.
template <int HINT>
inline void ask_lead(const Pages& pg, int64_t a_elem, int64_t n) {
  if (next_item_asks()) return;
  int64_t run0;
  const float* p0 = pg.at(a_elem, &run0);
  const int64_t lead = std::min(std::min(run0, n), FEW_AHEAD);
  for (int64_t o = 0; o < lead; o += 16) __builtin_prefetch(p0 + o, 0, HINT);
}

// Accumulators the decode shrink may hold: NT tokens x NV vectors x P phases, half the registers or so.
constexpr int FEW_ACC = VEC == 16 ? 16 : 8;

// The NV vectors of type T of one row of A^T (R = NV * lanes floats) for NT tokens, P phases; HINT the
// prefetches' locality: 2 into L2, 3 into L1 (the L1 form: l1_decode).
template <int NT, int NV, typename T, int HINT>
inline void few_shrink(const float* __restrict x, int64_t xs, const Pages& pg, int64_t a_elem, int64_t in,
                       float scale, float (*__restrict s)[MAX_RANK], NextItem& next) {
  constexpr int L = sizeof(T) / sizeof(float), R = NV * L;
  constexpr int P = std::max(1, std::min(4, 8 / (NT * NV)));
  T acc[P][NT][NV];
#pragma GCC unroll 64
  for (int q = 0; q < P; ++q)
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < NV; ++v) acc[q][t][v] = T{};
  alignas(64) float cross[R];  // a row of A^T that crosses a page boundary
  ask_lead<HINT>(pg, a_elem, in * R);
  int64_t i = 0;
  while (i < in) {
    int64_t run;
    const float* p = pg.at(a_elem + i * R, &run);
    int64_t rows = std::min<int64_t>(run / R, in - i);
    if (rows == 0) {  // run < R: the row continues on the next page(s)
      for (int64_t k = 0; k < R;) {
        int64_t left;
        const float* q = pg.at(a_elem + i * R + k, &left);
        for (const int64_t end = std::min<int64_t>(R, k + left); k < end; ++k) cross[k] = *q++;
      }
      p = cross;
      rows = 1;
    }
    const float* __restrict xr = x + i;
    int64_t r = 0;
    for (; r + P <= rows; r += P) {
      // The rows FEW_AHEAD floats on, a slice per step (harmless where it runs past the page).
      const float* ahead = p + (r + P) * R + FEW_AHEAD;
#pragma GCC unroll 16
      for (int l = 0; l < (P * R * 4 + 63) / 64; ++l) __builtin_prefetch(ahead + 16 * l, 0, HINT);  // see few_expand
      next.ask(P * R);
#pragma GCC unroll 64
      for (int q = 0; q < P; ++q)
        for (int v = 0; v < NV; ++v) {
          const T a = vload<T>(p + (r + q) * R + v * L);
          for (int t = 0; t < NT; ++t) acc[q][t][v] += xr[t * xs + r + q] * a;
        }
    }
    for (; r < rows; ++r) {
#pragma GCC unroll 64
      for (int v = 0; v < NV; ++v) {
        const T a = vload<T>(p + r * R + v * L);
        for (int t = 0; t < NT; ++t) acc[0][t][v] += xr[t * xs + r] * a;
      }
    }
    i += rows;
  }
#pragma GCC unroll 64
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < NV; ++v) {
      T sum = acc[0][t][v];
      for (int q = 1; q < P; ++q) sum += acc[q][t][v];
      vstore<T>(s[t] + v * L, sum * scale);
    }
}

#if defined(__AVX512F__)
// The rank-8 shrink of the L1 form (l1_decode): two rows of A^T (16 floats) to a vector, multiplied by the
// token's x at those two rows (16 floats of x permuted, 8 copies of each of two), so that half as many FMAs run as
// with a row to an 8-float vector; the sums of the two halves are added at the end. Prefetches as few_shrink's,
// into L1.
typedef int ivec16 __attribute__((vector_size(16 * sizeof(int))));
constexpr ivec16 PAIR_IDX[8] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};

template <int NT>
inline void few_shrink8x2(const float* __restrict x, int64_t xs, const Pages& pg, int64_t a_elem, int64_t in,
                          float scale, float (*__restrict s)[MAX_RANK]) {
  constexpr int Q = NT == 1 ? 8 : NT == 2 ? 4 : 2;  // partial sums a token: 8 FMA chains or more in flight
  vecv acc[Q][NT];
  vec8 tail[NT];  // rows left over at a page's end, one to an 8-float vector
#pragma GCC unroll 64
  for (int t = 0; t < NT; ++t) {
    tail[t] = vec8{};
    for (int q = 0; q < Q; ++q) acc[q][t] = vecv{};
  }
  ask_lead<3>(pg, a_elem, in * 8);
  int64_t i = 0;
  while (i < in) {
    int64_t run;
    const float* __restrict p = pg.at(a_elem + i * 8, &run);
    // At least one row: a page holds whole rows of 8 (D, a multiple of 16 here, and A^T's start, a pool row).
    const int64_t rows = std::min<int64_t>(run / 8, in - i);
    const float* __restrict xr = x + i;
    int64_t r = 0;
    for (; r + 16 <= rows; r += 16) {
      const float* ahead = p + (r + 16) * 8 + FEW_AHEAD;
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) __builtin_prefetch(ahead + 16 * l, 0, 3);
      vecv xb[NT];
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) xb[t] = vload<vecv>(xr + t * xs + r);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const vecv a = vload<vecv>(p + (r + 2 * j) * 8);
        for (int t = 0; t < NT; ++t) acc[j % Q][t] += __builtin_shuffle(xb[t], PAIR_IDX[j]) * a;
      }
    }
    for (; r < rows; ++r) {
      const vec8 a = vload<vec8>(p + r * 8);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) tail[t] += xr[t * xs + r] * a;
    }
    i += rows;
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) {
    vecv sum = acc[0][t];
    for (int q = 1; q < Q; ++q) sum += acc[q][t];
    alignas(64) float h[16];
    vstore<vecv>(h, sum);
    vstore<vec8>(s[t], (vload<vec8>(h) + vload<vec8>(h + 8) + tail[t]) * scale);
  }
}
#endif

// y_t[:out] += s_t @ B^T for NT tokens: NW vectors of columns at a time, accumulated over all R rows of
// B^T in registers, then one update of y. rows[k * (out / d) + j]: pool row j of B^T's row k.
template <int NT, int NW>
inline void few_expand(float* __restrict y, int64_t ys, const float (*__restrict s)[MAX_RANK], const float* const* rows,
                       int rank, int64_t out, int64_t d, NextItem& next) {
  const int64_t per_k = out / d;
  // Pool rows j = 0 and 1 of every row of B^T asked for up front, and in the loop row j + 2 (two ahead, not one):
  // the rank rows are rank short streams, each of out / d pool rows, and one pool row ahead left each stream's
  // first lines and much of its next ones to arrive while the loads waited. One B=64 decode step's LoRA (64
  // tokens over 30 adapters of ranks 8/16; benchmarks/cpu_lora_decode_bench.py with the build before beside it,
  // paired medians of 30 rounds, Intel Xeon family 6 model 167, RESULTS.md, fortieth session): -0.20 to -0.50 ms
  // of 17.5-18.8 (faster in 22-28 of 30 rounds, four runs), one thread -0.52 of 34.0; 48 / 30 -0.13, 24 / 16
  // -0.17, 8 / 8 -0.07; the scaling runs' step of 1-7 tokens an adapter -0.01. Three and four rows ahead measured
  // the same as two; the rows up front alone -0.20, two ahead alone +0.23.
  for (int k = 0; k < rank; ++k)
    for (int64_t j = 0; j < std::min<int64_t>(2, per_k); ++j)
      for (int w = 0; w < NW; ++w) __builtin_prefetch(rows[k * per_k + j] + w * VEC, 0, 2);
  for (int64_t j = 0; j < per_k; ++j)
    for (int64_t off = 0; off < d; off += NW * VEC) {
      next.ask(NW * VEC * rank);
      vecv acc[NT][NW];
#pragma GCC unroll 64
      for (int t = 0; t < NT; ++t)
        for (int w = 0; w < NW; ++w) acc[t][w] = vecv{};
      for (int k = 0; k < rank; ++k) {
        const float* __restrict b = rows[k * per_k + j] + off;
        // Prefetches of adapter rows go to L2 (prefetcht1), here and in the shrink: one B=64 decode step's
        // LoRA calls (30 / 51 adapters of the e2e trace, Intel Xeon, builds alternating step by step)
        // 23.88 -> 23.03 and 23.31 -> 22.51 ms / 36.42 -> 35.22; a prefetch into L1 holds an L1 fill buffer
        // for a whole memory latency (cpu_attention.cpp measured the same, by more).
        if (j + 2 < per_k) {  // the same columns of B^T's row k two pool rows on: j + 2's
          const float* nb = rows[k * per_k + j + 2] + off;
#pragma GCC unroll 64
          for (int w = 0; w < NW; ++w) __builtin_prefetch(nb + w * VEC, 0, 2);
        }
#pragma GCC unroll 64
        for (int w = 0; w < NW; ++w) {
          const vecv bv = vload<vecv>(b + w * VEC);
          for (int t = 0; t < NT; ++t) acc[t][w] += s[t][k] * bv;
        }
      }
      float* __restrict yc = y + j * d + off;
#pragma GCC unroll 64
      for (int t = 0; t < NT; ++t)
        for (int w = 0; w < NW; ++w)
          vstore<vecv>(yc + t * ys + w * VEC, vload<vecv>(yc + t * ys + w * VEC) + acc[t][w]);
    }
}

// The decode expand where expand_by_rows holds (the AVX2 build; AMD CPUs): y_t[:out] += s_t @ B^T for NT
// tokens in sweeps over KB of B^T's rows at a time, each pool row of those rows read front to back, y's NT
// rows (in L1) loaded and stored once per KB rows. few_expand's column chunks walk B^T's rank rows in
// strides, and on the AMD EPYC (Zen 1) dev CPU they cost about twice the read of their bytes: one B=64
// decode step's LoRA (30 adapters of ranks 8/16, 2-3 tokens each, 30 layers;
// benchmarks/cpu_lora_decode_bench.py, builds alternating in one process, 2 threads), ms: 48.0 -> 44.4 and
// 43.4 -> 39.8 with KB = 4; in another run 51.7 -> 47.6 (KB 4), 48.3 (KB 2), 48.4 (KB 1), 47.0 (KB 4 with
// the next KB rows prefetched).
// The next KB rows' pool row j is asked for (into L2) beside pool row j of these: the KB rows are KB short
// streams (a B^T row is out / d pool rows, 9 at the default model's 576) that restart every KB rows, too short
// for the hardware prefetchers. On an AMD EPYC Zen 4 (48 tokens over 30 adapters of ranks 8/16, builds
// alternating in one process; RESULTS.md, thirty-first session) 16.00 -> 15.44, 16.47 -> 15.84 and 16.60 ->
// 15.53 ms; prefetching two groups ahead instead was no faster (15.65 and 15.89 against 15.41 and 15.38).
template <int NT, int KB, bool AHEAD>
inline void few_expand_rows(float* __restrict y, int64_t ys, const float (*__restrict s)[MAX_RANK],
                            const float* const* rows, int rank, int64_t out, int64_t d, NextItem& next) {
  static_assert(8 % KB == 0, "the decode kernels' ranks (8, 16, 32, 64: few_ok) are multiples of KB");
  const int64_t per_k = out / d;
  for (int k = 0; k < rank; k += KB)
    for (int64_t j = 0; j < per_k; ++j) {
      const float* __restrict b[KB];
#pragma GCC unroll 16
      for (int q = 0; q < KB; ++q) b[q] = rows[(k + q) * per_k + j];
      if (AHEAD && k + KB < rank) {
#pragma GCC unroll 16
        for (int q = 0; q < KB; ++q)
          for (int64_t off = 0; off < d; off += 64 / sizeof(float))
            __builtin_prefetch(rows[(k + KB + q) * per_k + j] + off, 0, 2);
      }
      next.ask(KB * d);
      float* __restrict yj = y + j * d;
      for (int64_t off = 0; off < d; off += VEC) {
#pragma GCC unroll 16
        for (int t = 0; t < NT; ++t) {
          vecv acc = vload<vecv>(yj + t * ys + off);
#pragma GCC unroll 16
          for (int q = 0; q < KB; ++q) acc += s[t][k + q] * vload<vecv>(b[q] + off);
          vstore<vecv>(yj + t * ys + off, acc);
        }
      }
    }
}

// Whether the decode expand sweeps B^T's rows (few_expand_rows) rather than column chunks down them
// (few_expand): the AVX2 build always; the AVX-512 build on AMD CPUs. One decode step's LoRA
// (benchmarks/cpu_lora_decode_bench.py --ranks 8 16, builds alternating in one process, 25th-percentile
// ms, AMD EPYC Zen 5, 2 threads; RESULTS.md, twenty-ninth session): 48 tokens over 30 adapters 12.34 ->
// 11.78, 64 / 30 12.57 -> 11.94, 12 / 9 3.41 -> 3.14, 5 / 4 1.41 -> 1.33. Intel Xeons keep the column
// chunks, measured there at 21-22 GB/s (eighth session); on one (family 6 model 167, 64 / 30, paired medians of 30
// rounds) the row sweep measured the same as them in the thirty-eighth session (21.94 against 21.89 ms), and in the
// forty-third +0.16 ms with the form before the L1 form and +0.80 with the L1 form (l1_decode).
// LORAPLEX_SGMV_EXPAND_ROWS / _COLUMNS force one (tests/kernels/test_cpu_sgmv.py builds the one not chosen here).
bool expand_by_rows() {
#if defined(LORAPLEX_SGMV_EXPAND_ROWS)
  return true;
#elif defined(LORAPLEX_SGMV_EXPAND_COLUMNS)
  return false;
#elif defined(__AVX512F__)
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return true;
#endif
}

// Column vectors per expand pass: 4 where D holds them (and the registers do), else 2, else 1.
template <int NT>
inline int few_nw(int64_t d) {
  const int most = (VEC == 16 || NT <= 2) ? 4 : 2;
  for (int nw = most; nw > 1; nw /= 2)
    if (d % (nw * VEC) == 0) return nw;
  return 1;
}

// L1F: the L1 form (l1_decode).
template <int NT, bool L1F>
void few_block_n(float* y, int64_t ys, const float* x, int64_t xs, const Pages& pg, int64_t a_elem, int64_t b_elem,
                 int rank, int64_t in, int64_t out, int64_t d, float scale, NextItem& next) {
  constexpr int H = L1F ? 3 : 2;
  alignas(64) float s[NT][MAX_RANK];
  switch (rank) {
    case 8:
#if defined(__AVX512F__)
      if constexpr (L1F) {
        few_shrink8x2<NT>(x, xs, pg, a_elem, in, scale, s);
        break;
      }
#endif
      few_shrink<NT, 1, vec8, H>(x, xs, pg, a_elem, in, scale, s, next);
      break;
    case 16: few_shrink<NT, 16 / VEC, vecv, H>(x, xs, pg, a_elem, in, scale, s, next); break;
    case 32: few_shrink<NT, 32 / VEC, vecv, H>(x, xs, pg, a_elem, in, scale, s, next); break;
    default:
      if constexpr (NT * 64 / VEC <= FEW_ACC) {
        few_shrink<NT, 64 / VEC, vecv, H>(x, xs, pg, a_elem, in, scale, s, next);  // rank 64 (few_ok)
        break;
      }
  }
  const std::vector<const float*> rows = b_rows(pg, b_elem, rank * out / d, d);
  if (expand_by_rows()) {
    if constexpr (L1F)
      few_expand_rows<NT, 8, false>(y, ys, s, rows.data(), rank, out, d, next);
    else
      few_expand_rows<NT, 4, true>(y, ys, s, rows.data(), rank, out, d, next);
    return;
  }
  switch (few_nw<NT>(d)) {
    case 4: few_expand<NT, 4>(y, ys, s, rows.data(), rank, out, d, next); break;
    case 2: few_expand<NT, 2>(y, ys, s, rows.data(), rank, out, d, next); break;
    default: few_expand<NT, 1>(y, ys, s, rows.data(), rank, out, d, next);
  }
}

// Whether an item of nt tokens at this rank takes the decode kernels (else apply_block).
bool few_ok(int64_t nt, int64_t rank, int64_t d) {
  if (nt < 1 || nt > FEW || d % VEC != 0) return false;
  if (rank == 8 || rank == 16 || rank == 32) return nt * std::max<int64_t>(1, rank / VEC) <= FEW_ACC;
  return rank == 64 && nt * (64 / VEC) <= FEW_ACC;
}

void few_block(float* y, int64_t ys, const float* x, int64_t xs, int nt, const Pages& pg, int64_t a_elem,
               int64_t b_elem, int rank, int64_t in, int64_t out, int64_t d, float scale, NextItem& next) {
  if (l1_decode()) {
    switch (nt) {
      case 1: few_block_n<1, true>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next); break;
      case 2: few_block_n<2, true>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next); break;
      case 3: few_block_n<3, true>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next); break;
      default: few_block_n<4, true>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next);
    }
    return;
  }
  switch (nt) {
    case 1: few_block_n<1, false>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next); break;
    case 2: few_block_n<2, false>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next); break;
    case 3: few_block_n<3, false>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next); break;
    default: few_block_n<4, false>(y, ys, x, xs, pg, a_elem, b_elem, rank, in, out, d, scale, next);
  }
}

// One (layer, module)'s work items over the batch; every check of that module's tables happens here, before
// anything is written (apply_lora_group plans all its modules first).
struct ModuleItem { int64_t seg; int64_t t0; int nt; bool blocked; };

std::vector<ModuleItem> plan_module(const SegTables& tb, int64_t layer, int64_t module, int64_t out, int64_t T,
                                    int64_t max_len) {
  TORCH_CHECK(module >= 0 && module < tb.num_modules, "module out of range");
  const int64_t d = tb.d;
  TORCH_CHECK(out % d == 0, "out features must be a multiple of the pool row width");
  const int32_t* st = tb.st;
  const int32_t* ln = tb.ln;
  std::vector<ModuleItem> items;
  for (int64_t s = 0; s < tb.num_segs; ++s) {
    const int32_t* l = tb.entry(s, layer, module);
    if (l[0] == 0 || ln[s] == 0) continue;
    const bool blocked = ln[s] > max_len;
    if (blocked && !long_ok(l[0], d)) continue;  // the caller's GEMMs
    TORCH_CHECK(l[0] <= MAX_RANK, "rank above ", MAX_RANK);
    TORCH_CHECK(st[s] >= 0 && st[s] + ln[s] <= T, "segment outside the batch");
    // Items of a short segment: FEW tokens for the decode kernels where they apply, else TB.
    const int64_t step = blocked ? ITEM_BLOCKS * LMR : (few_ok(std::min<int64_t>(ln[s], FEW), l[0], d) ? FEW : TB);
    for (int64_t t = st[s]; t < st[s] + ln[s]; t += step)
      items.push_back({s, t, static_cast<int>(std::min<int64_t>(step, st[s] + ln[s] - t)), blocked});
  }
  return items;
}

// One planned item of module g: y's columns of that module start at yp + col.
struct GroupItem { ModuleItem it; int64_t module, col, out; };

// The items' work in about equal shares, one contiguous run of items per thread: their cost is the adapter
// bytes they read (A^T and B^T: rank x (in + out) floats) and their tokens' FMAs beside them. A decode
// step's items are one or a few tokens of one adapter each, of ranks 8 and 16 mixed: split by count (as
// at::parallel_for does), one thread's half held more rank-16 adapters than the other's and the other waited
// for it at the end of every module (a barrier per module, 7 a layer).
std::vector<int64_t> balanced_cuts(const std::vector<GroupItem>& items, const SegTables& tb, int64_t layer, int64_t in,
                                   int64_t parts) {
  std::vector<double> cost(items.size());
  double total = 0;
  for (size_t n = 0; n < items.size(); ++n) {
    const GroupItem& g = items[n];
    const int32_t rank = tb.entry(g.it.seg, layer, g.module)[0];
    cost[n] = static_cast<double>(rank) * static_cast<double>(in + g.out) * (4.0 + g.it.nt);
    total += cost[n];
  }
  std::vector<int64_t> cuts{0};
  double acc = 0;
  for (size_t n = 0; n < items.size() && static_cast<int64_t>(cuts.size()) < parts; ++n) {
    const double target = total * static_cast<double>(cuts.size()) / static_cast<double>(parts);
    // Cut before item n when that leaves the share closer to its target than taking n would.
    if (acc + cost[n] > target && target - acc < acc + cost[n] - target) cuts.push_back(static_cast<int64_t>(n));
    acc += cost[n];
  }
  // Cuts are pushed at increasing n, so they are already in order; the rest end at the last item.
  while (static_cast<int64_t>(cuts.size()) <= parts) cuts.push_back(static_cast<int64_t>(items.size()));
  return cuts;
}

// y [T, ...] (row stride ys) += each planned item's delta from x [T, in]: every module's items in one parallel
// region, balanced_cuts' shares one per thread.
void run_items(const std::vector<GroupItem>& items, float* yp, int64_t ys, const float* xp, int64_t xs, int64_t in,
               const SegTables& tb, int64_t layer) {
  if (items.empty()) return;
  const int64_t d = tb.d;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  const std::vector<int64_t> cuts = balanced_cuts(items, tb, layer, in, parts);
  const bool asks = next_item_asks();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    NextItem next;
    for (int64_t n = cuts[p0]; n < cuts[p1]; ++n) {
      next.r = 2;  // this thread's next item, if it has one (a long item reads its matrices many times: none)
      if (asks && n + 1 < cuts[p1] && !items[n + 1].it.blocked) {
        const GroupItem& g = items[n + 1];
        const int32_t* ln = tb.entry(g.it.seg, layer, g.module);
        next.start(tb.pages_of(g.it.seg), static_cast<int64_t>(ln[1]) * d, static_cast<int64_t>(ln[0]) * in,
                   static_cast<int64_t>(ln[2]) * d, static_cast<int64_t>(ln[0]) * g.out);
      }
      const ModuleItem& it = items[n].it;
      const int64_t module = items[n].module, out = items[n].out;
      float* y = yp + items[n].col;
      const int32_t* l = tb.entry(it.seg, layer, module);
      const float scale = tb.scale(it.seg, layer, module);
      const Pages p = tb.pages_of(it.seg);
      if (it.blocked)
        long_item(y + it.t0 * ys, ys, xp + it.t0 * xs, xs, it.nt, p, static_cast<int64_t>(l[1]) * d,
                  static_cast<int64_t>(l[2]) * d, l[0], in, out, d, scale);
      else if (few_ok(it.nt, l[0], d))
        few_block(y + it.t0 * ys, ys, xp + it.t0 * xs, xs, it.nt, p, static_cast<int64_t>(l[1]) * d,
                  static_cast<int64_t>(l[2]) * d, l[0], in, out, d, scale, next);
      else
        apply_block(y + it.t0 * ys, ys, xp + it.t0 * xs, xs, it.nt, p, static_cast<int64_t>(l[1]) * d,
                    static_cast<int64_t>(l[2]) * d, l[0], in, out, d, scale);
    }
  });
}

void add_module(std::vector<GroupItem>& items, const std::vector<ModuleItem>& planned, int64_t module, int64_t col,
                int64_t out) {
  for (const ModuleItem& it : planned) items.push_back({it, module, col, out});
}

void check_yx(const at::Tensor& y, const at::Tensor& x) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat,
              "cpu_sgmv.apply_lora takes float32 tensors");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y [T, out] and x [T, in] expected");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "y and x need contiguous columns");
}

}  // namespace

// Segments longer than max_len take the register-blocked path where long_ok(rank, D) holds; the
// others are left to the caller (a BLAS GEMM multiplies them faster than the token-block loops).
// y [T, out] (rows may be strided, columns contiguous: a column slice of a fused projection) is
// updated in place; x [T, in]; the other arguments: SegTables.
void apply_lora(at::Tensor y, at::Tensor x, at::Tensor pool_rows, at::Tensor seg_start,
                at::Tensor seg_len, at::Tensor layout, at::Tensor scales, at::Tensor pages,
                int64_t rows_per_page, int64_t layer, int64_t module, int64_t max_len) {
  check_yx(y, x);
  const SegTables tb(pool_rows, seg_start, seg_len, layout, scales, pages, rows_per_page, layer);
  std::vector<GroupItem> items;
  add_module(items, plan_module(tb, layer, module, y.size(1), y.size(0), max_len), module, 0, y.size(1));
  run_items(items, y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0), x.size(1), tb, layer);
}

// apply_lora of modules[g] on y's columns [bounds[g], bounds[g + 1]) for modules that share x and one fused
// output (q | k | v, gate | up), in one parallel region (run_items): one call from Python per fused projection, where
// a call per module cost the engine's decode step ~10 us of Python and argument passing each (210 a step).
void apply_lora_group(at::Tensor y, at::Tensor x, at::Tensor pool_rows, at::Tensor seg_start,
                      at::Tensor seg_len, at::Tensor layout, at::Tensor scales, at::Tensor pages,
                      int64_t rows_per_page, int64_t layer, std::vector<int64_t> modules, std::vector<int64_t> bounds,
                      int64_t max_len) {
  check_yx(y, x);
  TORCH_CHECK(modules.size() + 1 == bounds.size() && !modules.empty(), "one column range per module");
  TORCH_CHECK(bounds.front() >= 0 && bounds.back() <= y.size(1), "module columns outside y");
  for (size_t g = 0; g < modules.size(); ++g) TORCH_CHECK(bounds[g + 1] > bounds[g], "empty module columns");
  const SegTables tb(pool_rows, seg_start, seg_len, layout, scales, pages, rows_per_page, layer);
  std::vector<GroupItem> items;  // all modules checked (planned) before any is applied
  for (size_t g = 0; g < modules.size(); ++g)
    add_module(items, plan_module(tb, layer, modules[g], bounds[g + 1] - bounds[g], y.size(0), max_len), modules[g],
               bounds[g], bounds[g + 1] - bounds[g]);
  // Segment by segment, each segment's modules in order: an adapter's modules of one layer lie back to back in
  // its pages (A^T then B^T of q, k, v, ...: unified_pager.adapter_rows), so a thread reads one stretch of memory
  // per segment rather than jumping to another adapter after every module. Items write disjoint parts of y, so
  // the sums are the same bit for bit. One decode step's LoRA, 48 tokens over 30 adapters of ranks 8/16, AMD
  // EPYC Zen 4, builds alternating in one process (RESULTS.md, thirty-first session): 15.53 -> 14.06 ms with the
  // memory reading at 57 GB/s, 15.69 -> 15.79 and 15.84 -> 15.73 at 34 GB/s (the same machine, another run).
  std::stable_sort(items.begin(), items.end(),
                   [](const GroupItem& a, const GroupItem& b) { return a.it.seg < b.it.seg; });
  run_items(items, y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0), x.size(1), tb, layer);
}

// s[seg rows, s_cols[i] : s_cols[i] + rank] = scale * x[seg rows] @ A^T of modules[i], for every
// segment of the tables and every module it carries, for modules sharing one input x (q, k, v; gate, up)
// in one pass over x: the shrink that cpu_linear.linear_lora runs inside, chunk by chunk (the same sums),
// as a call of its own, for the benchmarks and for cpu_linear builds from before it ran inside. Every
// (segment, module) must satisfy long_ok; other columns of s are left as they are.
void shrink_segments(at::Tensor s, at::Tensor x, at::Tensor pool_rows, at::Tensor seg_start,
                     at::Tensor seg_len, at::Tensor layout, at::Tensor scales, at::Tensor pages,
                     int64_t rows_per_page, int64_t layer, std::vector<int64_t> modules, std::vector<int64_t> s_cols) {
  TORCH_CHECK(s.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat, "cpu_sgmv.shrink takes float32 tensors");
  TORCH_CHECK(s.dim() == 2 && x.dim() == 2 && s.size(0) == x.size(0), "s [T, W] and x [T, in] expected");
  TORCH_CHECK(s.stride(1) == 1 && x.stride(1) == 1, "s and x need contiguous columns");
  const SegTables tb(pool_rows, seg_start, seg_len, layout, scales, pages, rows_per_page, layer);
  check_shrink(tb, layer, modules, s_cols, x.size(0), s.size(1));
  shrink_all(ShrinkJob{tb, layer, modules, s_cols, x.data_ptr<float>(), x.stride(0), x.size(1), s.data_ptr<float>(),
                       s.stride(0)});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL while it runs: the server's threads keep going meanwhile.
  m.def("apply_lora", &apply_lora, "SGMV shrink + expand of one (layer, module), pool read in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_lora_group", &apply_lora_group, "apply_lora of several modules sharing x, each on its columns of y",
        py::call_guard<py::gil_scoped_release>());
  m.def("shrink", &shrink_segments, "scale * x @ A^T of several modules sharing x, for the GEMM's LoRA epilogue",
        py::call_guard<py::gil_scoped_release>());
  m.def("few_ok", &few_ok, "whether an item of nt tokens (a decode segment) at this rank and pool row width D "
        "takes the decode kernels");
  m.def("long_ok", &long_ok, "whether segments longer than max_len with this rank and pool row width D take the "
        "blocked path (else they are left to the caller)");
  m.def("next_item_asks", &next_item_asks, "whether this build's decode items ask for the next item's bytes "
        "(NextItem)");
  m.def("l1_decode", &l1_decode, "whether this build's decode kernels take their L1 form");
  m.def("expand_by_rows", &expand_by_rows, "whether this build's decode expand sweeps B^T's rows (else column "
        "chunks down them)");
}
