// The blocked LoRA shrink of prefill segments on the CPU: s[t, :rank] = scale * x[t] @ A^T for blocks of up to
// LMR tokens of one adapter, A^T's rows read in place from the unified pool (cpu_pool_tables.h). Included by
// cpu_sgmv.cpp (its long-segment path and its `shrink`) and cpu_linear.cpp (linear_lora, which shrinks each chunk
// of rows just before its panels run over the same rows, while they are in L2); kernels/cpu_build.py hashes this
// header with each source that it builds.
//
// Its own namespace: cpu_linear.cpp has vector types and constants of its own (V, vec, load) beside these.

#pragma once

#include "torch_ext.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_pool_tables.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {
namespace lora_shrink {

constexpr int MAX_RANK = 256;
#if defined(__AVX512F__)
constexpr int VEC = 16;  // floats per vector register: AVX-512 has 32 of them, AVX2 16 of 8
constexpr int LMR = 12;  // tokens per block: 2 x 12 expand accumulators (cpu_sgmv's long_block) of the 32 registers
#else
constexpr int VEC = 8;
constexpr int LMR = 6;   // of the 16 on AVX2
#endif

typedef float vecv __attribute__((vector_size(VEC * sizeof(float))));
typedef float vecv_u __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec8_u __attribute__((vector_size(8 * sizeof(float)), aligned(4)));

template <typename T> struct Unaligned;
template <> struct Unaligned<vecv> { using type = vecv_u; };
#if defined(__AVX512F__)  // VEC is 16: vec8 is a type of its own
template <> struct Unaligned<vec8> { using type = vec8_u; };
#endif
template <typename T>
inline T vload(const float* p) { return *reinterpret_cast<const typename Unaligned<T>::type*>(p); }
template <typename T> inline void vstore(float* p, T v) { *reinterpret_cast<typename Unaligned<T>::type*>(p) = v; }

// c + x * a in one rounding, whatever the block's size. Left to `acc += x * a`, GCC 12 with -march=native on an AMD
// EPYC Zen 4 compiled the one-row block with separate multiplies and adds (vmulps, vaddps) and the 7-row block with
// FMAs alone: a token's s then depended on the size of the block it fell in, and linear_lora's rows split (where a
// chunk's cut can leave a piece of one row) differed from its panels split in the last bits
// (tests/kernels/test_cpu_lora_gemm.py, forty-first session). The intrinsics are FMAs in every block; builds with
// neither AVX-512 nor FMA leave the contraction to the compiler. The broadcast is set1, not `T{} + x`: that form
// added a vaddss and a vbroadcastss to every FMA and took the shrink from 36.4 to 52.5 ms a step.
template <typename T>
inline T fmadd(T c, float x, T a) {
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 64)
    return reinterpret_cast<T>(
        _mm512_fmadd_ps(_mm512_set1_ps(x), reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(c)));
#endif
#if defined(__FMA__)
  if constexpr (sizeof(T) == 32)
    return reinterpret_cast<T>(
        _mm256_fmadd_ps(_mm256_set1_ps(x), reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(c)));
#endif
  return c + x * a;
}

bool long_ok(int64_t rank, int64_t d) { return rank > 0 && rank <= MAX_RANK && rank % 8 == 0 && d % VEC == 0; }

// acc[r] += x_r[k .. k + KU) @ A^T[k .. k + KU, c0 : c0 + NV*w] for R tokens: KU steps of k per walk down the rows.
// One pointer walks down the rows, hidden from the optimiser after each step: left to itself, GCC kept a
// pointer per row (12 of them beside the loop's own), spilled them, and reloaded them from the stack inside
// the loop, and those reloads on top of the row broadcasts made the loop bound by its loads. Each
// accumulator takes its k in order, so the sums are those of one k per walk.
template <int R, int NV, typename T, int KU>
inline void shrink_k(T (&acc)[R][NV], const float* __restrict x, int64_t xs, const float* const* __restrict arow,
                     int64_t k, int c0) {
  constexpr int W = sizeof(T) / sizeof(float);
  T a[KU][NV];
#pragma GCC unroll 16
  for (int u = 0; u < KU; ++u)
    for (int v = 0; v < NV; ++v) a[u][v] = vload<T>(arow[k + u] + c0 + v * W);
  const float* xr = x + k;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float xv[KU];
#pragma GCC unroll 16
    for (int u = 0; u < KU; ++u) xv[u] = xr[u];
#pragma GCC unroll 16
    for (int u = 0; u < KU; ++u)
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(acc[r][v], xv[u], a[u][v]);
    xr += xs;
    asm("" : "+r"(xr));
  }
}

// k per walk down the rows, and whether the shrink prefetches the next block's rows of x (one line per row every
// 16 k; at prefill sizes x comes from L3, and 12 rows of it are more streams than the hardware prefetchers
// follow). On AVX-512 (12 rows, one vector of rank 16 per row) each k's walk was its pointer steps, the loop's
// own work and A^T's row pointer beside one broadcast FMA per row, and those took issue slots from the FMAs:
// four k per walk and no prefetch, one layer's shrinks of 16 x 128 tokens at rank 16 (Intel Xeon, 2 threads,
// builds alternating, their order swapped every round) 1.52 -> 1.29 ms; in a run where four k without it took
// 1.32, four k with the prefetch into L2 1.39 and two k per walk 1.40; 8 x 256 and 48 x 40 tokens and rank 8 the
// same way. The AVX2 build (6 rows, 16 registers) gained nothing from either on the same CPU (2.09 ms before,
// 2.16 with four k, 2.18 with four k and no prefetch) and keeps its one k and the prefetch into L1. Bit for bit
// the same sums either way (benchmarks/cpu_lora_prefill_bench.py --shrink-baseline-source; RESULTS.md).
// That one layer, repeated, kept x in cache. Over a step's 30 layers, the e2e quick trace's first prefill chunk
// (12 segments, 2018 tokens, ranks 8 and 16; `cpu_lora_prefill_bench.py --layers 30 --lengths ... --paths shrink
// --shrink-baseline-source`, AMD EPYC Zen 4, 30 rounds, RESULTS.md, thirty-sixth session) the AVX-512 build with
// the prefetch into L2 took 37.96 ms a step against 43.70 without (paired medians -4.95 and -7.12 ms in two runs,
// faster in 28 and 30 of 30 rounds); into L3, or two blocks ahead, no better. So both builds prefetch now;
// a step on an Intel Xeon was not measured.
constexpr int SHRINK_KU = VEC == 16 ? 4 : 1;
constexpr int SHRINK_PREFETCH_HINT = VEC == 8 ? 3 : 2;  // into L1 (AVX2, as measured there) or L2 (AVX-512)
// Accumulator sets of a one-vector rank chunk (shrink_chunk): 2 on AVX2, where one set is 6 registers; the
// AVX-512 build's 12 rows already keep 12 chains.
constexpr int SHRINK_SETS_1 = VEC == 8 ? 2 : 1;

// s[r][c0 : c0 + NV*w] = x_r @ A^T[:, c0 : ...] for R tokens (w = the vector width of T); arow[k]: row k of A^T.
// SETS accumulator sets take alternate k (set u: k = u mod SETS) and are summed at the end: with one vector per
// row on AVX2 (rank 8; 6 rows) one set is 6 chains of dependent FMAs, fewer than the two FMA pipes' latency
// needs in flight (8 on a Zen 3), and two sets are 12 (benchmarks/cpu_lora_prefill_bench.py
// --shrink-baseline-source, RESULTS.md, thirtieth session). The sums' order then differs from one set's.
template <int R, int NV, typename T, int SETS = 1>
void shrink_chunk(const float* __restrict x, int64_t xs, const float* const* __restrict arow, int64_t K, int c0,
                  float (*__restrict s)[MAX_RANK], bool prefetch) {
  static_assert(SETS == 1 || SHRINK_KU == 1, "accumulator sets take one k each");
  constexpr int W = sizeof(T) / sizeof(float);
  T acc[SETS][R][NV];
#pragma GCC unroll 16
  for (int u = 0; u < SETS; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[u][r][v] = T{};
  constexpr int STEP = SETS * SHRINK_KU;
  static_assert(16 % STEP == 0, "k steps onto every multiple of 16, where x is prefetched");
  int64_t k = 0;
  for (; k + STEP <= K; k += STEP) {
    if (prefetch && (k & 15) == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) __builtin_prefetch(x + (R + r) * xs + k, 0, SHRINK_PREFETCH_HINT);
    }
#pragma GCC unroll 4
    for (int u = 0; u < SETS; ++u) shrink_k<R, NV, T, SHRINK_KU>(acc[u], x, xs, arow, k + u * SHRINK_KU, c0);
  }
  for (; k < K; ++k) shrink_k<R, NV, T, 1>(acc[0], x, xs, arow, k, c0);  // none: the pool geometry makes K a multiple of D
#pragma GCC unroll 4
  for (int u = 1; u < SETS; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[0][r][v] += acc[u][r][v];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) vstore<T>(s[r] + c0 + v * W, acc[0][r][v]);
}

// s[r][:rank] = scale * x_r @ A^T for R tokens: the rank in chunks of 2, 1 vectors (and 8 floats).
template <int R>
void shrink_rows(const float* x, int64_t xs, const float* const* arow, int64_t K, int rank, float scale,
                 float (*s)[MAX_RANK]) {
  int c = 0;
  for (; c + 2 * VEC <= rank; c += 2 * VEC) shrink_chunk<R, 2, vecv>(x, xs, arow, K, c, s, c == 0);
  if (c + VEC <= rank) shrink_chunk<R, 1, vecv, SHRINK_SETS_1>(x, xs, arow, K, c, s, c == 0), c += VEC;
  if (c < rank) shrink_chunk<R, 1, vec8>(x, xs, arow, K, c, s, c == 0);  // rank % VEC == 8 (AVX-512 only)
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < rank; ++j) s[r][j] *= scale;
}

using ShrinkFn = void (*)(const float*, int64_t, const float* const*, int64_t, int, float, float (*)[MAX_RANK]);
template <int... Rs>
constexpr std::array<ShrinkFn, sizeof...(Rs)> shrink_table(std::integer_sequence<int, Rs...>) {
  return {&shrink_rows<Rs + 1>...};
}
constexpr auto SHRINK_BLOCKS = shrink_table(std::make_integer_sequence<int, LMR>{});

// Pointers to the `in` rows of A^T (rank floats each, from logical element a_elem); a row that crosses
// a page is copied into spill. One division per page crossed, not per row: for 48 tokens of rank 16 a
// division per row cost about a third of the arithmetic.
std::vector<const float*> a_rows(const Pages& pg, int64_t a_elem, int rank, int64_t in, std::vector<float>& spill) {
  std::vector<const float*> arow(in);
  spill.assign(static_cast<size_t>((in * rank / pg.page_elems + 2) * rank), 0.f);
  size_t used = 0;
  int64_t run;
  const float* p = pg.at(a_elem, &run);
  for (int64_t k = 0; k < in; ++k) {
    if (run >= rank) {
      arow[k] = p;
      p += rank, run -= rank;
    } else {
      arow[k] = pg.span(a_elem + k * rank, rank, spill.data() + used);
      used += rank;
      if (k + 1 < in) p = pg.at(a_elem + (k + 1) * rank, &run);
    }
  }
  return arow;
}

// Balanced blocks of at most LMR tokens: fn(first token, block size) for each.
template <typename Fn>
void in_blocks(int64_t nt, Fn fn) {
  const int64_t nb = (nt + LMR - 1) / LMR;
  const int64_t base = nt / nb, extra = nt % nb;
  int64_t t = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t rows = base + (b < extra ? 1 : 0);
    fn(t, rows);
    t += rows;
  }
}

constexpr int ITEM_BLOCKS = 4;  // blocks per work item: the item's pointer tables serve 4 x LMR tokens

// Which rows to shrink into which columns: one (layer, projection) of a batch. modules[i]'s s goes to
// s[t, s_cols[i] : s_cols[i] + rank].
struct ShrinkJob {
  const SegTables& tb;
  int64_t layer;
  const std::vector<int64_t>& modules;
  const std::vector<int64_t>& s_cols;
  const float* x;  // [T, in], row stride xs
  int64_t xs, in;
  float* s;  // [T, W], row stride ss
  int64_t ss;
};

// A^T's row tables of the segment in hand, one per module: a thread's rows come in order, so the blocks of one
// segment (a 128-token prompt is three items) share them rather than each building its own (a table is `in`
// pointers and a heap allocation, beside 4 x 12 tokens' FMAs over it). One layer's shrinks, 16 x 128 tokens, AMD
// EPYC Zen 4, 2 threads, builds alternating 150 times: rank 8 1.44 -> 1.38 ms, rank 16 2.04 -> 1.96 (medians);
// 48 x 40 tokens (one item a segment) 2.14 -> 2.15, no change (RESULTS.md, twenty-eighth session).
struct ShrinkTables {
  int64_t seg = -1;
  std::vector<std::vector<float>> spill;
  std::vector<std::vector<const float*>> arows;
};

// The job's checks: every (segment, module) of rank > 0 one that the blocked shrink takes, its columns inside s
// (W wide), its rows inside the batch (T rows).
void check_shrink(const SegTables& tb, int64_t layer, const std::vector<int64_t>& modules,
                  const std::vector<int64_t>& s_cols, int64_t T, int64_t W) {
  TORCH_CHECK(modules.size() == s_cols.size(), "one s column per module");
  for (int64_t g = 0; g < tb.num_segs; ++g) {
    TORCH_CHECK(tb.st[g] >= 0 && tb.ln[g] >= 0 && tb.st[g] + tb.ln[g] <= T, "segment outside the batch");
    for (size_t i = 0; i < modules.size(); ++i) {
      TORCH_CHECK(modules[i] >= 0 && modules[i] < tb.num_modules, "module out of range");
      const int32_t rank = tb.entry(g, layer, modules[i])[0];
      TORCH_CHECK(rank == 0 || long_ok(rank, tb.d), "rank ", rank, " is not one the blocked shrink takes");
      TORCH_CHECK(s_cols[i] >= 0 && s_cols[i] + rank <= W, "s is too narrow for the ranks");
    }
  }
}

// Rows [t0, t0 + nt) of segment seg, every module of the job, in balanced blocks of at most LMR.
void shrink_span(const ShrinkJob& job, int64_t seg, int64_t t0, int64_t nt, ShrinkTables& tables) {
  const int64_t nm = static_cast<int64_t>(job.modules.size());
  if (tables.seg != seg) {
    tables.seg = seg;
    tables.spill.resize(nm), tables.arows.resize(nm);
    const Pages p = job.tb.pages_of(seg);
    for (int64_t i = 0; i < nm; ++i) {
      const int32_t* l = job.tb.entry(seg, job.layer, job.modules[i]);
      if (l[0] > 0) tables.arows[i] = a_rows(p, static_cast<int64_t>(l[1]) * job.tb.d, l[0], job.in, tables.spill[i]);
    }
  }
  alignas(64) float buf[LMR][MAX_RANK];
  for (int64_t i = 0; i < nm; ++i) {
    const int rank = job.tb.entry(seg, job.layer, job.modules[i])[0];
    if (rank == 0) continue;
    const float scale = job.tb.scale(seg, job.layer, job.modules[i]);
    const float* const* arow = tables.arows[i].data();
    in_blocks(nt, [&](int64_t t, int64_t rows) {
      SHRINK_BLOCKS[rows - 1](job.x + (t0 + t) * job.xs, job.xs, arow, job.in, rank, scale, buf);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(job.s + (t0 + t + r) * job.ss + job.s_cols[i], buf[r], rank * sizeof(float));
    });
  }
}

// Every segment of the job, spread over the threads in items of up to ITEM_BLOCKS x LMR tokens.
void shrink_all(const ShrinkJob& job) {
  struct Item { int64_t seg, t0, nt; };
  std::vector<Item> items;
  const SegTables& tb = job.tb;
  for (int64_t g = 0; g < tb.num_segs; ++g)
    for (int64_t t = tb.st[g]; t < tb.st[g] + tb.ln[g]; t += ITEM_BLOCKS * LMR)
      items.push_back({g, t, std::min<int64_t>(ITEM_BLOCKS * LMR, tb.st[g] + tb.ln[g] - t)});
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    ShrinkTables tables;
    for (int64_t n = lo; n < hi; ++n) shrink_span(job, items[n].seg, items[n].t0, items[n].nt, tables);
  });
}

}  // namespace lora_shrink
}  // namespace
