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
// Loops, outside in: threads split the panels (each writes its own columns, no reduction), or, in linear_lora
// with a chunk of rows per thread or more, the chunks of rows (run() says why); a chunk of
// MC rows of x (sized to stay in L2 while every panel of the thread passes over it); panels; blocks of
// at most MR rows, balanced (64 rows on AVX-512: 6 blocks of 10-11, not 5 of 12 and a lone 4) so that
// every block keeps enough independent accumulators to hide the FMA latency.

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
// panel pulls it in from memory; the blocks also prefetch the next panel into L2, so that while they
// compute on this one, the next one is already on its way (the hardware prefetchers stop at every 4 KB
// page; a panel is 18 pages at K = 576). Without it the LM head, 113 MB read once per step, ran at 144
// GFLOP/s at 64 rows against oneDNN's 179. The prefetches are spread over all the panel's blocks: block b
// of nb prefetches slice b of the next panel's nb slices, a line or a few every two k: issued by the first
// block alone, a burst of 72 KB asked for within one block's time, above one core's share of the
// bandwidth, the next panel was still arriving when its blocks began (all layers' projections at 24-64
// rows, weights streaming from memory, Intel Xeon: 7-8% faster spread; RESULTS.md, fourteenth session).
// The k loop runs two k per pass with the prefetches unconditional within it: an earlier form decided
// per k whether this k prefetched (a counter and two branches per k) and, beside the 11 row pointers of
// x, spilled registers inside the loop; the integer work took issue slots from the FMAs (Intel Xeon,
// eighteenth session, all layers' projections streaming from memory, the two builds alternating: 64 rows
// 290 -> 330 GFLOP/s, 2048 rows 311 -> 340; bit for bit the same sums; RESULTS.md).
// H is the prefetches' locality hint: 2 (prefetcht1) everywhere but on AMD CPUs at 24 rows or more, where
// 3 (prefetcht0) measured faster (l1_prefetch below).
// LoRA epilogue of a block (linear_lora): acc += s @ B^T[:, the panel's columns], s [R, rank] (row
// stride ss, scale applied), bt [rank, NR] the panel's NR columns of B^T, copied out of the pool (LoraPlan::at).
// rank 0: none.
struct Epilogue {
  const float* s;
  int64_t ss;
  const float* bt;
  int rank;
};

// acc[r] += x[r][k] * (w0 | w1) for the R rows of a block. One pointer walks down the rows, hidden from the
// optimiser after each step: left to itself GCC keeps a pointer per row, more than the registers hold, and
// reloads the spilled ones from the stack inside the k loop (cpu_sgmv.cpp's shrink_chunk: the same).
// w: a row of NR floats (a panel's, or B^T's at the panel's columns), loaded once into two registers. On AVX2
// GCC would rather fold the loads into the FMAs, 2R loads of w per k where 2 do (14 of the 16 registers hold
// the accumulators and the two halves); the empty asm makes the loaded values opaque, so they stay in registers.
// On an AMD EPYC Zen 3 (AVX2; benchmarks/cpu_linear_bench.py --stream, the two builds in one process,
// RESULTS.md, thirtieth session) all 30 layers' projections at 16 / 64 / 256 / 1024 rows took 34.6 -> 29.9,
// 176.7 -> 156.6, 624.4 -> 352.4, 2083 -> 1516 ms, the same sums bit for bit. AVX-512 builds have the
// registers to spare and already keep them ("x" would also confine them to the low 16 of the 32).
template <int R>
inline void fma_k(vec (&a0)[R], vec (&a1)[R], const float* __restrict x, int64_t xs, int64_t k,
                  const float* __restrict w) {
  vec w0 = load(w), w1 = load(w + V);
#if defined(__AVX__) && !defined(__AVX512F__)  // "x": an x86 vector register, which a 32-byte vector fills
  asm("" : "+x"(w0), "+x"(w1));
#endif
  const float* xr = x + k;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const float xv = *xr;
    a0[r] += xv * w0;
    a1[r] += xv * w1;
    xr += xs;
    asm("" : "+r"(xr));
  }
}

template <int R, int H, bool NEAR>
void block(const float* __restrict x, int64_t xs, const float* __restrict w, int64_t K, float* __restrict y,
           int64_t ys, int ncols, const float* __restrict bias, const float* next, int pf_phase, int pf_stride,
           const Epilogue& lora) {
  vec a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = vec{};
  // Slice pf_phase of the next panel's pf_stride slices, `step` bytes of it per two k (rounded up: the
  // last lines asked for may lie past the slice, and past the panel for the last slice; a prefetch of
  // any address is harmless), so 1 to 4 lines per two k.
  // The address is an integer: it may run past the panel (and is 0 without a next panel), where pointer
  // arithmetic would be undefined.
  const int64_t step = (2 * NR * 4 + pf_stride - 1) / pf_stride;
  const int lines = next != nullptr ? static_cast<int>((step + 63) / 64) : 0;
  uintptr_t pf = next != nullptr ? reinterpret_cast<uintptr_t>(next) + K * NR * 4 * pf_phase / pf_stride : 0;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2) {
    if (lines > 0) __builtin_prefetch(reinterpret_cast<const void*>(pf), 0, H);
    if (lines > 1) __builtin_prefetch(reinterpret_cast<const void*>(pf + 64), 0, H);
    if (lines > 2) {
      __builtin_prefetch(reinterpret_cast<const void*>(pf + 128), 0, H);
      __builtin_prefetch(reinterpret_cast<const void*>(pf + 192), 0, H);
    }
    pf += step;
    if constexpr (NEAR) {  // this panel's rows k + 16 and k + 17 into L1 (near_prefetch); an integer, as pf
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(w + k * NR) + 16 * NR * 4;
      __builtin_prefetch(reinterpret_cast<const void*>(ahead), 0, 3);
      __builtin_prefetch(reinterpret_cast<const void*>(ahead + 64), 0, 3);
      __builtin_prefetch(reinterpret_cast<const void*>(ahead + NR * 4), 0, 3);
      __builtin_prefetch(reinterpret_cast<const void*>(ahead + NR * 4 + 64), 0, 3);
    }
    fma_k<R>(a0, a1, x, xs, k, w + k * NR);
    fma_k<R>(a0, a1, x, xs, k + 1, w + k * NR + NR);
  }
  if (k < K) fma_k<R>(a0, a1, x, xs, k, w + k * NR);
  // The adapter's delta joins the accumulators before the one store: y is written once, where a
  // separate SGMV pass would read and write it again (at prefill sizes, from L3 or memory).
  for (int k = 0; k < lora.rank; ++k) fma_k<R>(a0, a1, lora.s, lora.ss, k, lora.bt + k * NR);
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
                         const float*, int, int, const Epilogue&);

template <int H, bool NEAR, int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs)> block_table(std::integer_sequence<int, Rs...>) {
  return {&block<Rs + 1, H, NEAR>...};
}
// BLOCKS[h][r - 1]: r rows, the next panel prefetched with hint 2 (h = 0) or 3 (h = 1); h = 2: hint 2 and this
// panel's rows 16 k ahead into L1 as well (near_prefetch).
constexpr std::array<std::array<BlockFn, MR>, 3> BLOCKS = {
    block_table<2, false>(std::make_integer_sequence<int, MR>{}),
    block_table<3, false>(std::make_integer_sequence<int, MR>{}),
    block_table<2, true>(std::make_integer_sequence<int, MR>{})};

// Whether a call of M rows prefetches the next panel into L1 (prefetcht0) rather than L2 (prefetcht1). On
// an AMD EPYC Zen 4 (AVX-512), all layers' projections and the LM head at M rows, weights streaming from
// memory, the two alternating in one process (RESULTS.md, twenty-fourth session): t0 against t1 at 24 / 32 /
// 48 / 64 / 512 rows 0.935 / 0.924 / 0.944 / 0.941 / 0.983 of the time, but 1.02-1.04 at 1 / 8 / 16 rows,
// where the step is bound by the weights' stream rather than the FMAs. On an AMD EPYC Zen 5 (family 26) t0
// is faster from two blocks a panel on, 13-23 rows (benchmarks/cpu_linear_bench.py --stream with the two
// builds, RESULTS.md, twenty-ninth session): 13 / 16 / 18 / 22 rows 15.4 -> 14.5, 15.5 -> 13.6, 15.0 ->
// 13.7, 15.3 -> 14.4 ms, and 16 / 20 rows 16.3 -> 14.2, 14.6 -> 13.5 in another run; 8 and 12 rows (one
// block) were not changed by it. Intel Xeons keep t1 throughout: it is the hint that was measured there (t0
// was not).
bool l1_prefetch(int64_t M) {
#if defined(__AVX512F__)
  return cpu_family::amd() && (M >= 2 * MR || (cpu_family::zen5() && M > MR));
#else
  return false;  // measured only on AVX-512 CPUs
#endif
}

// Whether a call of M rows also prefetches its own panel's rows 16 k ahead into L1 (block's NEAR), beside the next
// panel into L2: on Intel CPUs at decode sizes. On an Intel Xeon (family 6 model 167; all layers' projections and
// the LM head at M rows, the weights streaming from memory on 2 MiB pages as the engine holds them, both builds'
// linear called directly and alternating in one process, paired medians of 24 rounds; RESULTS.md, thirty-eighth
// session) 4 / 8 / 16 / 24 rows 20.84 -> 20.23, 23.14 -> 21.57, 27.53 -> 26.26, 30.43 -> 29.76 ms (-0.64, -1.62,
// -1.26, -0.54 paired; faster in 22, 22, 21 and 19 of 24); 1, 12, 32, 48 and 64 rows within 0.34 ms either way; at
// 2048 rows 32.7 ms slower of 1499 (in 21 of 24), where each panel serves many blocks from L2 and the prefetches
// only take issue slots. Why it helps is not measured (the VM gives no counters): streaming, a pass there took
// about its FMAs' time plus its read's rather than the larger of the two, so the loads still wait on lines the
// next-panel prefetches have not brought close. Not measured on AMD CPUs (l1_prefetch's hint serves them) nor on
// AVX2 builds.
bool near_prefetch(int64_t M) {
#if defined(__AVX512F__)
  return !cpu_family::amd() && M <= 32;
#else
  (void)M;
  return false;
#endif
}

// Rows [m0, m0 + m) of x against one panel, in ceil(m / MR) blocks whose sizes differ by at most one.
void rows_by_panel(const float* x, int64_t xs, int64_t m0, int64_t m, const float* w, int64_t K, float* y,
                   int64_t ys, int ncols, const float* bias, const float* next, const Epilogue& lora,
                   const std::array<BlockFn, MR>& blocks) {
  const int64_t nb = (m + MR - 1) / MR;
  const int64_t base = m / nb, extra = m % nb;
  int64_t r0 = m0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t rows = base + (b < extra ? 1 : 0);
    const Epilogue e{lora.s == nullptr ? nullptr : lora.s + (r0 - m0) * lora.ss, lora.ss, lora.bt, lora.rank};
    blocks[rows - 1](x + r0 * xs, xs, w, K, y + r0 * ys, ys, ncols, bias, next, static_cast<int>(b),
                     static_cast<int>(nb), e);
    r0 += rows;
  }
}

// Where the adapters' deltas go in linear_lora: the rows of each segment (one adapter) and, per panel,
// that adapter's B^T columns, read in place from the unified pool through the segment's page table.
struct LoraPlan {
  static constexpr int MAX_RANK = 256;
  struct Piece { int64_t r0, r1, seg; };  // rows [r0, r1) of segment seg (-1: no adapter)
  SegTables tb;
  int64_t layer;
  float* s;  // [M, W] shrink outputs, scale applied: run() fills the segments' rows
  int64_t ss;
  std::vector<int64_t> modules, bounds, s_cols;  // module i: output columns [bounds[i], bounds[i + 1])
  std::vector<Piece> pieces;                     // in row order, covering every row

  // The shrink that fills s: this plan's segments and modules over x [M, K] (row stride xs).
  lora_shrink::ShrinkJob shrink_job(const float* x, int64_t xs, int64_t K) const {
    return lora_shrink::ShrinkJob{tb, layer, modules, s_cols, x, xs, K, s, ss};
  }

  // The module (index into modules) whose output columns hold column c.
  size_t module_at(int64_t c) const {
    size_t i = 0;
    while (c >= bounds[i + 1]) ++i;
    return i;
  }

  // Segment seg's B^T columns of every panel, panel by panel ([panel][the panel's module's rank][NR] in data,
  // panel p from offset at[p]), copied in one pass over B^T's rows, each row front to back: where the threads split
  // the rows (run()) each piece of a chunk needs every panel's columns, and at() copied them a panel at a time,
  // rank short reads from rows `out` floats apart, each waiting on memory. The same bytes, so the same sums bit
  // for bit. The e2e quick trace's first prefill chunk (12 segments, 2018 tokens) over 30 layers, each layer cold
  // (benchmarks/cpu_lora_prefill_bench.py --cold --baseline-source, the build before beside it, Intel Xeon family 6
  // model 167, RESULTS.md, fortieth session): what the LoRA adds, 88.4 -> 84.4 and 84.5 -> 77.6 ms; one layer's
  // worth of 6 layers warm, paired medians of 30 rounds: 23 x 88 tokens -1.6 ms of 22.7, 64 x 32 tokens -3.7 of
  // 39.1 (faster in 23 of 30).
  struct PanelCopy {
    std::vector<float> data;
    std::vector<int64_t> at;
  };
  void copy_panels(int64_t seg, PanelCopy& out) const {
    out.at.assign(bounds.back() / NR, 0);  // every panel: the modules' columns cover the output (linear_lora)
    int64_t total = 0;
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const int rank = tb.entry(seg, layer, modules[i])[0];
      for (int64_t p = bounds[i] / NR; p < bounds[i + 1] / NR; ++p) out.at[p] = total, total += rank * NR;
    }
    out.data.resize(total);
    const Pages pg = tb.pages_of(seg);
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const int32_t* l = tb.entry(seg, layer, modules[i]);
      const int rank = l[0];
      const int64_t out_i = bounds[i + 1] - bounds[i], p0 = bounds[i] / NR;
      for (int k = 0; k < rank; ++k) {  // B^T's row k, front to back: NR columns never cross a page (D % NR == 0)
        const int64_t e = static_cast<int64_t>(l[2]) * tb.d + k * out_i;
        int64_t run;
        const float* src = pg.at(e, &run);
        for (int64_t q = 0; q < out_i / NR; ++q, src += NR, run -= NR) {
          if (run < NR) src = pg.at(e + q * NR, &run);
          std::memcpy(out.data.data() + out.at[p0 + q] + k * NR, src, NR * sizeof(float));
        }
      }
    }
  }
  // The epilogue of segment seg's rows (from row r) at panel p, from its copy_panels.
  Epilogue from_copy(int64_t seg, int64_t r, int64_t p, const PanelCopy& copy) const {
    const size_t i = module_at(p * NR);
    return Epilogue{s + r * ss + s_cols[i], ss, copy.data.data() + copy.at[p], tb.entry(seg, layer, modules[i])[0]};
  }

  // The epilogue of segment seg's rows (from row r) at panel columns [c, c + NR), its B^T columns copied into
  // bt [rank, NR]. Why a copy: the piece's blocks each read all of them after their K loop has streamed the
  // panel (K x NR floats, more than L1) through L1, and in the pool B^T's rows lie `out` floats apart: at
  // gate/up's 1536 that is 96 lines, so a rank-16 adapter's 32 lines of them fall in 4 of L1's 64 sets (Zen 4:
  // 32 KB, 8 ways) and evict one another; back to back they take 32 sets. Read in place, B^T cost 0.6 of the
  // epilogue's 2.2 ms at gate/up and 1.2 of 4.0 over a layer (against B^T read from one buffer in L1). The
  // copy, the same sums bit for bit: one layer, 16 x 128 tokens at rank 16, paired medians of 40 and 80
  // rounds, ms added to the GEMMs (AMD EPYC Zen 4, RESULTS.md, thirty-third session): qkv 0.60 -> 0.54 and
  // 0.64 -> 0.53, o 0.37 -> 0.30 and 0.34 -> 0.27, gate/up 2.04 -> 1.83 and 2.53 -> 2.27, down 0.38 -> 0.36
  // and 0.41 -> 0.37.
  Epilogue at(int64_t seg, int64_t r, int64_t c, float* bt) const {
    const size_t i = module_at(c);
    const int32_t* l = tb.entry(seg, layer, modules[i]);
    const int rank = l[0];
    const int64_t out = bounds[i + 1] - bounds[i];
    const Pages pg = tb.pages_of(seg);
    int64_t run;
    // B^T [rank, out] is stored row-major from logical row b_row; NR columns lie in one D-wide pool row.
    const int64_t first = static_cast<int64_t>(l[2]) * tb.d + (c - bounds[i]);
    for (int k = 0; k < rank; ++k) {
      const float* src = pg.at(first + k * out, &run);
      std::memcpy(bt + k * NR, src, NR * sizeof(float));
      // The same row of B^T at the next panel's columns (NR floats on: the same pool row, or the next one,
      // which follows it unless a page ends there; a prefetch of a wrong address is harmless), asked for now,
      // a whole panel of blocks before it is copied: each piece's first block otherwise waited on rank lines
      // from memory. benchmarks/cpu_lora_prefill_bench.py on the AMD EPYC Zen 1 (2 threads, builds
      // alternating in one process): what fused adds, paired medians, 16 segments 18.2 -> 15.5 and 17.5 ->
      // 14.5 ms, 8 segments (80 rounds) 9.35 -> 8.84.
      __builtin_prefetch(src + NR, 0, 2);
    }
    return Epilogue{s + r * ss + s_cols[i], ss, bt, rank};
  }
};

// Whether a plain GEMM (no LoRA plan) splits its rows between the threads, as linear_lora does (run), rather than
// its panels: on an AMD EPYC Zen 5 from 1536 rows on. The 30 layers' GEMMs of the default model, every layer its
// own weights (benchmarks/cpu_linear_bench.py --stream --rows ... --layers 30 --reps 8 --baseline-source <this
// split>, builds alternating in one process, paired medians of 8 rounds; RESULTS.md, forty-second session): 2048
// rows -33.6 ms of 907, 2018 -23.8 of 888, 1536 -4.3 of 658 (faster in 8 of 8 each); 1024 +0.04; 768, 657 and 512
// rows +2.1, +1.8, +1.9 (slower in 7-8 of 8). The outputs the same bit for bit. Not measured on other CPUs, where
// the panels split stays (the thirty-seventh and forty-first sessions found the rows split costing nothing by itself
// beside the LoRA epilogue on a Zen 3 and a Zen 4). LORAPLEX_LINEAR_PLAIN_ROWS / _PLAIN_PANELS force either at
// every size (tests/kernels/test_cpu_linear.py builds the one not chosen here).
bool plain_rows_split(int64_t M) {
#if defined(LORAPLEX_LINEAR_PLAIN_ROWS)
  (void)M;
  return true;
#elif defined(LORAPLEX_LINEAR_PLAIN_PANELS)
  (void)M;
  return false;
#else
  return cpu_family::zen5() && M >= 1536;
#endif
}

at::Tensor run(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t n,
               const LoraPlan* plan) {
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
  at::Tensor y = at::empty({M, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || n == 0) return y;
  if (K == 0 && plan == nullptr) return bp != nullptr ? y.copy_(bias->expand({M, n})) : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t chunk = std::max<int64_t>(MR, X_CHUNK_BYTES / (std::max<int64_t>(K, 1) * 4) / MR * MR);
  const LoraPlan::Piece whole{0, M, -1};
  const LoraPlan::Piece* pieces = plan != nullptr ? plan->pieces.data() : &whole;
  const LoraPlan::Piece* pieces_end = pieces + (plan != nullptr ? plan->pieces.size() : 1);
  const auto& blocks = BLOCKS[l1_prefetch(M) ? 1 : near_prefetch(M) ? 2 : 0];
  // Rows [m0, m1) against panels [p0, p1). bt: LoraPlan::at's copy of B^T's columns.
  // copies: null, or per segment its copy_panels (those of the pieces in these rows made).
  const auto panels_over = [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1, float* bt,
                               const LoraPlan::PanelCopy* copies = nullptr) {
    for (int64_t p = p0; p < p1; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
      const float* next = p + 1 < p1 ? wp + (p + 1) * K * NR : nullptr;
      for (const LoraPlan::Piece* pc = pieces; pc != pieces_end; ++pc) {  // the rows cut where the adapter changes
        const int64_t a = std::max(pc->r0, m0), b = std::min(pc->r1, m1);
        if (a >= b) continue;
        const Epilogue e = pc->seg < 0       ? Epilogue{nullptr, 0, nullptr, 0}
                           : copies != nullptr ? plan->from_copy(pc->seg, a, p, copies[pc->seg])
                                               : plan->at(pc->seg, a, p * NR, bt);
        rows_by_panel(xp, xs, a, b - a, wp + p * K * NR, K, yp + p * NR, n, ncols,
                      bp == nullptr ? nullptr : bp + p * NR, next, e, blocks);
        next = nullptr;
      }
    }
  };
  const int64_t threads = at::get_num_threads();
  // The rows split: nc chunks of rows, as many for each thread, where there is a chunk or more for each.
  const bool chunk_each = (M + chunk - 1) / chunk >= threads;
  const int64_t nc = threads * ((M + threads * chunk - 1) / (threads * chunk));
  if (plan == nullptr && chunk_each && plain_rows_split(M)) {
    at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) panels_over(M * c / nc, M * (c + 1) / nc, 0, P, nullptr);
    });
    return y;
  }
  if (plan != nullptr && chunk_each) {
    // The threads split the rows, not the panels: each shrinks a chunk of rows (the adapters' x @ A^T) and then
    // runs every panel over the same chunk, while its x is still in L2; a shrink pass of its own over the whole
    // batch before the GEMM read x from L3 or memory (a prefill chunk of 2048 tokens is 4.7 MB at K = 576). The
    // weights' traffic is the same: each thread reads every panel once per chunk of its half of the rows, where
    // the panel split read half the panels once per chunk of all of them. The chunks are as many per thread, so
    // that the threads finish together. The e2e quick trace's first prefill chunk (12 segments, 2018 tokens, ranks 8
    // and 16) over 30 layers, each layer timed cold (benchmarks/cpu_lora_prefill_bench.py --layers 30 --lengths ...
    // --cold --baseline-source, AMD EPYC Zen 3, RESULTS.md, thirty-seventh session): the LoRA added 166.8 ms to the
    // GEMMs with the shrink a pass of its own, 125.5 with it here, the same sums bit for bit. Below a chunk per
    // thread the rows split lost: 64 rows (two segments) added 20.3 ms over 30 layers against 9.2 for the panel
    // split, each thread then reading every panel for a few rows.
    const lora_shrink::ShrinkJob job = plan->shrink_job(xp, xs, K);
    at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) {
      lora_shrink::ShrinkTables tables;
      // Per segment, its copy_panels, made at the first of this thread's chunks that holds the segment: a copy
      // depends on the segment alone, and a long segment spans several chunks.
      std::vector<LoraPlan::PanelCopy> copies(plan->tb.num_segs);
      std::vector<bool> copied(plan->tb.num_segs, false);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t m0 = M * c / nc, m1 = M * (c + 1) / nc;
        for (const LoraPlan::Piece* pc = pieces; pc != pieces_end; ++pc) {
          const int64_t a = std::max(pc->r0, m0), b = std::min(pc->r1, m1);
          if (a >= b || pc->seg < 0) continue;
          lora_shrink::shrink_span(job, pc->seg, a, b - a, tables);
          if (!copied[pc->seg]) plan->copy_panels(pc->seg, copies[pc->seg]), copied[pc->seg] = true;
        }
        panels_over(m0, m1, 0, P, nullptr, copies.data());
      }
    });
    return y;
  }
  if (plan != nullptr)  // fewer chunks than threads: the shrink first, over all the rows, then the panels split
    lora_shrink::shrink_all(plan->shrink_job(xp, xs, K));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) float bt[LoraPlan::MAX_RANK * NR];
    for (int64_t m0 = 0; m0 < M; m0 += chunk) panels_over(m0, std::min(chunk, M - m0) + m0, p0, p1, bt);
  });
  return y;
}

}  // namespace

int64_t panel_width() { return NR; }

// x [M, K] float32 (rows may be strided, columns contiguous); panels [P, K, NR] (pack_panels);
// bias [N] or None. Returns y [M, N] float32, contiguous.
at::Tensor linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t n) {
  return run(x, panels, bias, n, nullptr);
}

// linear, plus each segment's LoRA delta: y[seg rows, module i's columns] += s[seg rows, s_cols[i] :
// s_cols[i] + rank] @ B^T, where this call first fills s [M, W] (scratch: the rows outside the segments are left
// as they are) with scale * x[seg rows] @ A^T of modules[i] (cpu_lora_shrink.h). The segment table is the batch's
// LoraDeviceTensors (SegTables); modules[i] owns output columns [bounds[i], bounds[i + 1]). Needs every rank one
// the blocked shrink takes (long_ok), D and every bound a multiple of NR (a panel lies in one module and its B^T
// columns in one pool row); segments must not overlap.
at::Tensor linear_lora(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t n,
                       at::Tensor s, at::Tensor pool_rows, at::Tensor seg_start, at::Tensor seg_len,
                       at::Tensor layout, at::Tensor scales, at::Tensor pages, int64_t rows_per_page,
                       int64_t layer, std::vector<int64_t> modules, std::vector<int64_t> bounds,
                       std::vector<int64_t> s_cols) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == at::kFloat && s.stride(1) == 1 && s.size(0) == x.size(0),
              "s must be float32 [M, W] with contiguous columns");
  LoraPlan plan{SegTables(pool_rows, seg_start, seg_len, layout, scales, pages, rows_per_page, layer), layer,
                s.data_ptr<float>(), s.stride(0)};
  const int64_t d = plan.tb.d, S = plan.tb.num_segs, M = x.size(0);
  TORCH_CHECK(d % NR == 0, "the pool row width ", d, " is not a multiple of the panel width ", NR);
  TORCH_CHECK(modules.size() + 1 == bounds.size() && modules.size() == s_cols.size() && !modules.empty(),
              "one s column and one column range per module");
  TORCH_CHECK(bounds.front() == 0 && bounds.back() == n, "module columns must cover the output");
  for (size_t i = 0; i < modules.size(); ++i)
    TORCH_CHECK(bounds[i] % NR == 0 && bounds[i + 1] > bounds[i] && (bounds[i + 1] - bounds[i]) % d == 0,
                "module columns must be non-empty multiples of the panel width and of D");
  // Segments inside the batch, modules in range, ranks the shrink takes (long_ok: at most MAX_RANK, as the
  // epilogue's copy of B^T needs) and inside s
  lora_shrink::check_shrink(plan.tb, layer, modules, s_cols, M, s.size(1));
  static_assert(lora_shrink::MAX_RANK <= LoraPlan::MAX_RANK, "the epilogue takes every rank the shrink does");
  plan.modules = std::move(modules), plan.bounds = std::move(bounds), plan.s_cols = std::move(s_cols);
  std::vector<std::pair<int64_t, int64_t>> segs;  // (start, segment)
  const int32_t *st = plan.tb.st, *ln = plan.tb.ln;
  for (int64_t g = 0; g < S; ++g)  // inside the batch: check_shrink
    if (ln[g] > 0) segs.emplace_back(st[g], g);
  std::sort(segs.begin(), segs.end());
  int64_t r = 0;
  for (const auto& [start, g] : segs) {
    TORCH_CHECK(start >= r, "segments overlap");
    if (start > r) plan.pieces.push_back({r, start, -1});
    plan.pieces.push_back({start, start + ln[g], g});
    r = start + ln[g];
  }
  if (r < M) plan.pieces.push_back({r, M, -1});
  return run(x, panels, bias, n, &plan);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_width", &panel_width, "NR: output columns per packed panel in this build");
  // Without the GIL while it runs: the server's threads keep going meanwhile.
  m.def("linear", &linear, "y = x @ W^T (+ bias) with W packed in panels", py::arg("x"), py::arg("panels"),
        py::arg("bias"), py::arg("n"), py::call_guard<py::gil_scoped_release>());
  m.def("plain_rows_split", &plain_rows_split, "whether a plain GEMM of M rows splits its rows between the threads "
        "(else its panels)");
  m.def("linear_lora", &linear_lora, "linear with each segment's LoRA shrink before and expand in the epilogue",
        py::call_guard<py::gil_scoped_release>());
  // linear_lora fills s itself (earlier builds took it from cpu_sgmv.shrink; benchmarks time those beside this)
  m.attr("SHRINKS_INSIDE") = true;
}
