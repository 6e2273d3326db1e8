// Paged attention on the CPU, reading K/V in place from the pool through the block tables.
//
// The torch path gathers every K/V block of every sequence into a new tensor before SDPA (a copy
// as large as the read itself); here each K/V row is read once, where it lies, and consumed from
// L1 by all the query rows that need it.
//
// Work is a list of tiles, planned once per step on the Python side and shared by every layer:
//   tile = (sequence, first token, tokens m, keys of the first token)
// Token j of a tile attends keys 0 .. keys0 + j - 1 of its sequence: a decode token is a tile of
// one token whose key count is the sequence length; a prefill chunk is cut into tiles of several
// consecutive tokens (causal inside the chunk, full over the cached tokens before it).
// One work item is (tile, kv head): all query heads of that kv head's group (and all tokens of
// the tile) are computed together, so each K/V row is read from memory once per item. Items
// with few rows (decode) run "by rows" (run_item: a row's scores for a chunk of VL keys in one
// vector); items with many rows (prefill tiles) run "in lanes" (run_item_lanes: VL rows in one vector).
// VL (below) is 16 with AVX-512, 8 without.
//
// Softmax is online (running max, rescaled sums) in float32, one chunk of up to VL keys at a time.
// Keys at or past a row's limit are never read: pool slots past a sequence's length may hold
// anything (NaN included), and 0 * NaN would still poison the output.

#include "torch_ext.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// One vector: 16 floats, one AVX-512 register, where the build has AVX-512; 8 floats, one AVX2 register (or two
// NEON ones), elsewhere. GCC/Clang vector extensions keep the code portable. A vector is also a chunk of keys
// and, in the lanes path, a group of query rows: every loop below keeps a vector's worth of vectors in
// registers (scores of a chunk's keys, acc^T columns), 16 of the 32 AVX-512 registers. With 16-float vectors
// on AVX2 those arrays took all 16 registers twice over and spilled: prefill 1 x 512 tokens, 2 threads, AMD
// EPYC (AVX2, twentieth session), 35.0 ms a layer call against 13.1 for torch's SDPA.
#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VL * sizeof(int32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);  // unaligned load
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
constexpr vi vi_zero = {};

inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float s = 0.f;
  for (int i = 0; i < VL; ++i) s += v[i];
  return s;
#endif
}

inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float s = v[0];
  for (int i = 1; i < VL; ++i) s = std::max(s, v[i]);
  return s;
#endif
}

// exp(x) for x <= RESCALE_AT (scores minus their reference max), 0 below -87 (and for the -inf
// of masked keys); a NaN stays NaN. Cephes' expf polynomial: ~2 ulp, far inside the 1e-5 the
// kernel answers for; the libm expf would be scalar (GCC only vectorises it with -ffast-math).
__attribute__((always_inline)) inline vf vexp(vf x) {
  const vf lo = splat(-87.0f);
  const vi under = x < lo;
  x = under ? lo : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi bits = (vi)t - (vi)splat(magic);  // n as an integer, -126 .. 12
  bits = (bits + 127) << 23;            // 2^n
  const vf y = p * (vf)bits;
  return under ? splat(0.f) : y;
}

// q . k over any head_dim (the path for head sizes that are not 32, 64 or 128).
inline float dot(const float* a, const float* b, int d) {
  vf s = {};
  int c = 0;
  for (; c + VL <= d; c += VL) s += load(a + c) * load(b + c);
  float t = hsum(s);
  for (; c < d; ++c) t += a[c] * b[c];
  return t;
}

// Lane i of the result = the sum of the lanes of part[i]: 16 horizontal sums in 30 shuffles and
// 15 adds (one reduce_add per sum would take 64 shuffles). Each step halves the partial sums per
// key and doubles the keys per vector.
#if defined(__AVX512F__)
__attribute__((always_inline)) inline vf reduce_lanes(const vf* part) {
  vf s1[8], s2[4], s3[2];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: key 2k, 8-15: key 2k+1
    const vf a = part[2 * k], b = part[2 * k + 1];
    s1[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int k = 0; k < 4; ++k) {  // 4 lanes per key: keys 4k .. 4k+3 in order
    const vf a = s1[2 * k], b = s1[2 * k + 1];
    s2[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int k = 0; k < 2; ++k) {  // 2 lanes per key: keys 8k .. 8k+7
    const vf a = s2[2 * k], b = s2[2 * k + 1];
    s3[k] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(s3[0], s3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(s3[0], s3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
// The same for 8 lanes: 8 sums in 14 shuffles and 7 adds.
__attribute__((always_inline)) inline vf reduce_lanes(const vf* part) {
  vf s1[4], s2[2];
  for (int k = 0; k < 4; ++k) {  // lanes 0-3: key 2k, 4-7: key 2k+1
    const vf a = part[2 * k], b = part[2 * k + 1];
    s1[k] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int k = 0; k < 2; ++k) {  // 2 lanes per key: keys 4k .. 4k+3 in order
    const vf a = s1[2 * k], b = s1[2 * k + 1];
    s2[k] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(s2[0], s2[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(s2[0], s2[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// Scores of one query row (scaled q, padded to whole vectors) against up to VL keys: lane i is
// q . k[i] for i < n, -inf past n (keys the row may not see, never read).
// NV: vectors per head row when head_dim is 32, 64 or 128, known at compile time (the loops
// unroll and the partial sums stay in registers); 0: any head_dim, with a scalar tail.
template <int NV>
__attribute__((always_inline)) inline vf chunk_scores(const float* qr, const float* const* k, int n, int d,
                                                      int64_t off = 0) {
  vi lane;
  for (int i = 0; i < VL; ++i) lane[i] = i;
  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  vf s;
  if constexpr (NV > 0) {
    vf qv[NV], part[VL];
    for (int c = 0; c < NV; ++c) qv[c] = load(qr + c * VL);
    for (int i = 0; i < VL; ++i) {
      if (i < n) {
        const float* kr = k[i] + off;
        vf a = qv[0] * load(kr);
        for (int c = 1; c < NV; ++c) a += qv[c] * load(kr + c * VL);
        part[i] = a;
      } else {
        part[i] = vf{};
      }
    }
    s = reduce_lanes(part);
  } else {
    alignas(64) float t[VL] = {};
    for (int i = 0; i < n; ++i) t[i] = dot(qr, k[i] + off, d);
    s = load(t);
  }
  return lane < n ? s : ninf;
}

// acc += sum_i p[i] * (v[i] + off) over n value rows.
template <int NV>
inline void accumulate(float* acc, const float* p, const float* const* v, int n, int d, int64_t off = 0) {
  if constexpr (NV > 0) {
    // Two sets of accumulators (even and odd keys): one set would chain 16 dependent FMAs per
    // vector, latency-bound at half the FMA throughput.
    vf a[NV], b[NV];
    for (int c = 0; c < NV; ++c) {
      a[c] = load(acc + c * VL);
      b[c] = vf{};
    }
    int i = 0;
    for (; i + 1 < n; i += 2) {
      const float w0 = p[i], w1 = p[i + 1];
      const float *v0 = v[i] + off, *v1 = v[i + 1] + off;
      for (int c = 0; c < NV; ++c) {
        a[c] += w0 * load(v0 + c * VL);
        b[c] += w1 * load(v1 + c * VL);
      }
    }
    if (i < n)
      for (int c = 0; c < NV; ++c) a[c] += p[i] * load(v[i] + off + c * VL);
    for (int c = 0; c < NV; ++c) store(acc + c * VL, a[c] + b[c]);
  } else {
    for (int i = 0; i < n; ++i) {
      const float w = p[i];
      const float* vi_ = v[i] + off;
      int c = 0;
      for (; c + VL <= d; c += VL) store(acc + c, load(acc + c) + w * load(vi_ + c));
      for (; c < d; ++c) acc[c] += w * vi_[c];
    }
  }
}

struct Problem {
  const float* pool;
  int64_t num_pages, bs, kvh, d;
  const int32_t* tables;  // [S, max_blocks] of one layer
  int64_t num_seqs, max_blocks;
  const int32_t* tiles;  // [W, 4]
  const float* q;
  int64_t q_s0, q_s1;
  float* out;
  int64_t o_s0, o_s1;
  int64_t group;  // query heads per kv head
  float scale;
};

// Per-thread buffers, reused across work items (both paths, each with its own layout: see
// run_item and run_item_lanes).
struct Scratch {
  std::vector<float> q, acc, s, p, l, m;
  std::vector<int32_t> lim;
  std::vector<int64_t> row_keys, row_head;  // run_item: per row, its token's key count and its kv head's offset
};

// data() of v grown to at least n elements (contents not kept: every item initialises its own).
template <typename T>
T* grown(std::vector<T>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize(n);
  return v.data();
}

// K/V prefetches go to L2 (prefetcht1), not L1: on the Intel Xeon of the fourteenth session, B=64 decode per
// layer call, builds alternating in one process, ctx 128 0.799 -> 0.712 and 0.738 -> 0.670 ms, ctx 512
// 2.94 -> 2.64 and 3.07 -> 2.85 (prefetcht2 the same as t1). A prefetch into L1 holds one of the core's few
// L1 fill buffers for a whole memory latency, and there are hundreds of lines in flight a chunk; the
// demand loads that follow then find the lines in L2.
constexpr int PF_LOCALITY = 2;

// Points k[i] and v[i] at the K and V rows of keys t0 + i (i < 16, below nkeys) of sequence seq,
// kv head g, and prefetches them. Walks the blocks with a running offset: a division per key (bs
// is not known at compile time) would cost more than the key's dot products. False at a page
// outside the pool.
// Both kernels locate chunk t0 + 16 before computing chunk t0: the rows sit on pages scattered
// over the pool, where the hardware prefetchers do not follow. (Measured at B=64 decode: 30%
// faster than no prefetch; a separate prefetch walk one, two or four chunks ahead ran 40% slower.)
// pf false: pointers only; the decode kernel spreads the chunk's prefetches over the passes of the
// chunk before it (PrefetchSpread).
inline bool locate(const Problem& pb, int64_t seq, int64_t g, int64_t t0, int64_t nkeys, const float** k,
                   const float** v, int64_t heads = 1, bool pf = true) {
  const int32_t* pages = pb.tables + seq * pb.max_blocks;
  const int64_t row = pb.kvh * pb.d, half = pb.bs * row;
  const int64_t lines = (heads * pb.d * (int64_t)sizeof(float) + 63) / 64;  // kv heads g .. g + heads - 1
  const int n = (int)std::min<int64_t>(VL, nkeys - t0);
  for (int i = 0; i < n;) {
    const int64_t t = t0 + i;
    const int64_t page = pages[t / pb.bs];
    if (page < 0 || page >= pb.num_pages) return false;
    const int64_t off = t % pb.bs;
    const int take = (int)std::min<int64_t>(n - i, pb.bs - off);
    const float* base = pb.pool + page * 2 * half + off * row + g * pb.d;
    for (int j = 0; j < take; ++j, ++i) {
      k[i] = base + j * row;
      v[i] = k[i] + half;
      if (pf)
        for (int64_t c = 0; c < lines; ++c) {
          __builtin_prefetch(k[i] + 16 * c, 0, PF_LOCALITY);
          __builtin_prefetch(v[i] + 16 * c, 0, PF_LOCALITY);
        }
    }
  }
  return true;
}

// Slices of the prefetches of rows p[0 .. n) (`lines` cache lines each). A decode chunk
// of all kv heads is 384 lines (16 keys x 12 lines of K, as many of V at SmolLM2's shapes): asked for
// in one burst, far more than the line-fill buffers hold, they held up the loads of the chunk being
// computed, and memory and arithmetic took turns (the kernel ran at 0.60-0.66 of a plain read of its
// pages). Spread one slice per row over the chunk before's passes (K over the score pass, V over the
// accumulate pass), B=64 decode per layer call, the two builds alternating in one process on a
// huge-page pool (AMD EPYC Zen 5): ctx 128 0.671 -> 0.482 ms, 512 3.14 -> 2.39, 2048 12.2 -> 9.0; a
// plain read of the same pages took 0.45 ms at ctx 128. All of it during the score pass: 0.497 ms.
//
// The slices are handed out in order, one per next(), walking rows and lines with counters: an earlier
// form located each prefetch's row and line by a division (x / lines, x % lines), some 45 64-bit divisions
// per query row and pass at SmolLM2's shapes, beside the row's 64 FMAs.
struct PrefetchSpread {
  const float* const* p;
  int64_t lines, total, parts;
  int64_t part = 0, done = 0, row = 0, line = 0;
  PrefetchSpread(const float* const* rows, int n, int64_t lines_per_row, int64_t num_parts)
      : p(rows), lines(lines_per_row), total(n * lines_per_row), parts(num_parts) {}
  inline void next() {  // slice `part` of `parts`: prefetches [total * part / parts, total * (part + 1) / parts)
    const int64_t hi = total * ++part / parts;
    for (; done < hi; ++done) {
      __builtin_prefetch(p[row] + 16 * line, 0, PF_LOCALITY);
      if (++line == lines) line = 0, ++row;
    }
  }
};

// Softmax weights are exp(score - m) against a reference max m that is only moved (and what was
// summed under it rescaled) when a score exceeds it by more than RESCALE_AT: weights stay below
// e^8 (no overflow in float32 sums), and most chunks skip the horizontal max and the rescale.
constexpr float RESCALE_AT = 8.0f;

// Tiles of at least this many rows take the lanes path (run_item_lanes): below it most of the 16
// lanes would idle (measured: decode at 8 query heads per kv head runs 1.45x faster by rows, at
// 16 both paths take the same time; prefill tiles of 48-96 rows run 1.3-2x faster in lanes).
constexpr int64_t LANE_ROWS = 16;

// Every kv head of a tile, all query heads as rows: each chunk reads the K (then V) rows of all heads of
// its keys, which lie side by side in the page, in one pass (one kv head after another, the same lines
// were fetched kvh times, from L2 at best). False (the item's output rows left unwritten) when the tile
// points outside the tables or the pool.
// k_lo, k_hi: the keys this call reads (a part of a split decode token: see run_all); with part set (a
// token of one row per query head, mt = 1), the rows' unnormalised results go there as part_floats(dp)
// floats a row (reference max, sum of the weights, acc) for merge_parts, instead of into out.
inline int64_t part_floats(int64_t dp) { return dp + 2; }

template <int NV>
bool run_item(const Problem& pb, int64_t w, Scratch& sc, int64_t k_lo = 0, int64_t k_hi = -1,
              float* part = nullptr) {
  const int32_t* tile = pb.tiles + 4 * w;
  const int64_t seq = tile[0], tok0 = tile[1], mt = tile[2], keys0 = tile[3];
  const int d = NV > 0 ? NV * VL : (int)pb.d;
  const int64_t G = pb.group, Gt = G * pb.kvh, R = mt * Gt;  // rows per token: every query head
  const int64_t nkeys = keys0 + mt - 1;  // the last token's keys: every key any row reads
  if (seq < 0 || seq >= pb.num_seqs || mt < 1 || keys0 < 1 || nkeys > pb.max_blocks * pb.bs) return false;
  const int64_t kend = k_hi < 0 ? nkeys : std::min(k_hi, nkeys);  // keys k_lo .. kend - 1 of this call
  // Rows padded to whole vectors: the vector loops over q and acc may run past head_dim (K/V
  // rows are never read past it).
  const int64_t dp = (d + VL - 1) / VL * VL;
  float* qb = grown(sc.q, R * dp);
  float* acc = grown(sc.acc, R * dp);
  float* sb = grown(sc.s, R * VL);   // [R, 16] this chunk's scores
  float* pb_ = grown(sc.p, R * VL);  // [R, 16] this chunk's weights
  float* lb = grown(sc.l, R * VL);   // [R, 16] running sums of the weights, lane-wise (reduced at the end)
  float* mx = grown(sc.m, R);        // [R] reference max
  int64_t* rkeys = grown(sc.row_keys, R);  // [R] keys the row sees: keys0 + its token
  int64_t* rhead = grown(sc.row_head, R);  // [R] its kv head's offset in a K/V row of all heads

  // Rows r = j * Gt + h: query head h, whose kv head is h / G. A local copy of q reads
  // a strided q (a slice of the fused qkv) once and folds the softmax scale in.
  for (int64_t j = 0; j < mt; ++j) {
    for (int64_t h = 0; h < Gt; ++h) {
      const int64_t r = j * Gt + h;
      const float* src = pb.q + (tok0 + j) * pb.q_s0 + h * pb.q_s1;
      float* dst = qb + r * dp;
      for (int c = 0; c < d; ++c) dst[c] = src[c] * pb.scale;
      for (int64_t c = d; c < dp; ++c) dst[c] = 0.f;
      std::fill(acc + r * dp, acc + (r + 1) * dp, 0.f);
      store(lb + r * VL, vf{});
      mx[r] = -std::numeric_limits<float>::infinity();
      rkeys[r] = keys0 + j;
      rhead[r] = h / G * pb.d;
    }
  }

  const float* ptrs[2][2][VL];  // [this chunk / next][K / V][key]
  if (!locate(pb, seq, 0, k_lo, kend, ptrs[0][0], ptrs[0][1], pb.kvh)) return false;
  for (int64_t t0 = k_lo, cur = 0; t0 < kend; t0 += VL, cur ^= 1) {
    const int n = (int)std::min<int64_t>(VL, kend - t0);
    if (t0 + VL < kend && !locate(pb, seq, 0, t0 + VL, kend, ptrs[cur ^ 1][0], ptrs[cur ^ 1][1], pb.kvh, false))
      return false;
    const int next_n = t0 + VL < kend ? (int)std::min<int64_t>(VL, kend - t0 - VL) : 0;  // the next chunk's keys
    const int64_t lines = (pb.kvh * pb.d * (int64_t)sizeof(float) + 63) / 64;  // a key's K (or V) row, all heads
    const float* const* kp = ptrs[cur][0];
    const float* const* vp = ptrs[cur][1];
    // Rows that see keys of this chunk: causally, token j of the tile sees keys0 + j keys.
    const int64_t r0 = std::max<int64_t>(0, t0 - keys0 + 1) * Gt;
    auto keys_of = [&](int64_t r) { return (int)std::min<int64_t>(n, rkeys[r] - t0); };
    auto head_of = [&](int64_t r) { return rhead[r]; };  // the row's kv head, from head 0's pointers
    // Three passes over the rows, each row independent of the others within a pass: the
    // out-of-order core overlaps rows, where one row's scores -> max -> exp -> sum chain alone
    // would leave it waiting on latencies.
    PrefetchSpread kpf(ptrs[cur ^ 1][0], next_n, lines, R - r0), vpf(ptrs[cur ^ 1][1], next_n, lines, R - r0);
    for (int64_t r = r0; r < R; ++r) {
      kpf.next();
      store(sb + r * VL, chunk_scores<NV>(qb + r * dp, kp, keys_of(r), d, head_of(r)));
    }
    for (int64_t r = r0; r < R; ++r) {
      const vf sv = load(sb + r * VL);
      const vi over = sv > (mx[r] + RESCALE_AT);
      if (std::memcmp(&over, &vi_zero, sizeof over) != 0) {
        // Move the reference max to this chunk's (nothing to rescale before the first chunk).
        const float cm = hmax(sv);
        const float alpha = t0 > k_lo ? std::exp(mx[r] - cm) : 0.f;
        float* ar = acc + r * dp;
        for (int64_t c = 0; c < dp; c += VL) store(ar + c, load(ar + c) * alpha);
        store(lb + r * VL, load(lb + r * VL) * alpha);
        mx[r] = cm;
      }
      const vf pv = vexp(sv - mx[r]);
      store(lb + r * VL, load(lb + r * VL) + pv);
      store(pb_ + r * VL, pv);
    }
    for (int64_t r = r0; r < R; ++r) {
      vpf.next();
      accumulate<NV>(acc + r * dp, pb_ + r * VL, vp, keys_of(r), d, head_of(r));
    }
  }

  if (part != nullptr) {  // mt = 1: row r is query head r
    for (int64_t r = 0; r < R; ++r) {
      float* dst = part + r * part_floats(dp);
      dst[0] = mx[r];
      dst[1] = hsum(load(lb + r * VL));
      std::memcpy(dst + 2, acc + r * dp, d * sizeof(float));
    }
    return true;
  }
  for (int64_t j = 0; j < mt; ++j) {
    for (int64_t h = 0; h < Gt; ++h) {
      const int64_t r = j * Gt + h;
      const float inv = 1.f / hsum(load(lb + r * VL));
      const float* ar = acc + r * dp;
      float* dst = pb.out + (tok0 + j) * pb.o_s0 + h * pb.o_s1;
      for (int c = 0; c < d; ++c) dst[c] = ar[c] * inv;
    }
  }
  return true;
}

// The same attention with the rows of a tile as the lanes of the vectors (16 rows a group): for
// tiles of many rows (prefill). The running max, the softmax and its rescaling become lane-wise
// (no horizontal sums), and both products are broadcast FMAs: a score vector (16 rows, one key)
// gathers q^T[d] * k[d] over d, and acc^T[d] (16 rows) gathers p[key] * v[key][d] over the keys.
// q and acc are kept transposed, [d][16 rows], per group.
template <int NV>
bool run_item_lanes(const Problem& pb, int64_t w, int64_t g, Scratch& sc) {
  const int32_t* tile = pb.tiles + 4 * w;
  const int64_t seq = tile[0], tok0 = tile[1], mt = tile[2], keys0 = tile[3];
  const int64_t d = NV > 0 ? NV * VL : pb.d, G = pb.group, R = mt * G;
  const int64_t nkeys = keys0 + mt - 1;
  if (seq < 0 || seq >= pb.num_seqs || mt < 1 || keys0 < 1 || nkeys > pb.max_blocks * pb.bs) return false;
  const int64_t groups = (R + VL - 1) / VL;
  float* qt = grown(sc.q, groups * d * VL);    // [groups, d, 16]
  float* at = grown(sc.acc, groups * d * VL);  // [groups, d, 16]
  float* mb = grown(sc.m, groups * VL);        // [groups, 16] running max
  float* lb = grown(sc.l, groups * VL);        // [groups, 16] running sum of the weights
  int32_t* limb = grown(sc.lim, groups * VL);  // [groups, 16] keys each row sees
  float* pm = grown(sc.p, VL * VL);            // [16 keys, 16 rows] this chunk's weights
  float* kc = grown(sc.s, VL * d);             // [16 keys, d] this chunk's keys, side by side

  // Row r = j * G + h is lane r % 16 of group r / 16. Lanes past R are padding: q = 0 and every
  // key visible keep them finite (their output is not written).
  std::fill(qt, qt + groups * d * VL, 0.f);
  std::fill(at, at + groups * d * VL, 0.f);
  for (int64_t r = 0; r < groups * VL; ++r) {
    mb[r] = -std::numeric_limits<float>::infinity();
    lb[r] = 0.f;
    limb[r] = (int32_t)(r < R ? keys0 + r / G : nkeys);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* src = pb.q + (tok0 + r / G) * pb.q_s0 + (g * G + r % G) * pb.q_s1;
    float* dst = qt + (r / VL) * d * VL + r % VL;
    for (int64_t c = 0; c < d; ++c) dst[c * VL] = src[c] * pb.scale;
  }

  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  const float* ptrs[2][2][VL];  // [this chunk / next][K / V][key]
  if (!locate(pb, seq, g, 0, nkeys, ptrs[0][0], ptrs[0][1])) return false;
  for (int64_t t0 = 0, cur = 0; t0 < nkeys; t0 += VL, cur ^= 1) {
    const int n = (int)std::min<int64_t>(VL, nkeys - t0);
    if (t0 + VL < nkeys && !locate(pb, seq, g, t0 + VL, nkeys, ptrs[cur ^ 1][0], ptrs[cur ^ 1][1])) return false;
    const float** kp = ptrs[cur][0];
    const float** vp = ptrs[cur][1];
    // A short last chunk points its missing keys at key 0 (read, finite) and masks them: every
    // loop below then runs a whole 16 keys, unrolled, with its sums in registers.
    for (int i = n; i < VL; ++i) {
      kp[i] = kp[0];
      vp[i] = vp[0];
    }
    // The keys side by side: the score loop then broadcasts k[i][c] at fixed offsets from one
    // pointer instead of loading 16 row pointers for each column.
    for (int i = 0; i < VL; ++i) std::memcpy(kc + i * d, kp[i], d * sizeof(float));
    for (int64_t gr = 0; gr < groups; ++gr) {
      const vi lim = [&] { vi v; std::memcpy(&v, limb + gr * VL, sizeof v); return v; }();
      const int64_t last = std::min<int64_t>(R, (gr + 1) * VL) - 1;  // its rows see the most keys
      if (limb[last] <= t0) continue;  // causal: no row of the group sees this chunk
      const float* q = qt + gr * d * VL;
      vf sc16[VL];
      for (int i = 0; i < VL; ++i) sc16[i] = vf{};
      for (int64_t c = 0; c < d; ++c) {
        const vf qc = load(q + c * VL);
        for (int i = 0; i < VL; ++i) sc16[i] += qc * kc[i * d + c];
      }
      vf m = load(mb + gr * VL), mnew = m;
      for (int i = 0; i < VL; ++i) {
        sc16[i] = lim > (int32_t)(t0 + i) ? sc16[i] : ninf;
        mnew = mnew > sc16[i] ? mnew : sc16[i];
      }
      const vf alpha = vexp(m - mnew);  // 0 on the first chunk (m = -inf)
      vf lsum = load(lb + gr * VL) * alpha;
      for (int i = 0; i < VL; ++i) {
        const vf pv = vexp(sc16[i] - mnew);
        lsum += pv;
        store(pm + i * VL, pv);
      }
      store(lb + gr * VL, lsum);
      store(mb + gr * VL, mnew);
      float* a = at + gr * d * VL;
      int64_t c0 = 0;
      for (; c0 + VL <= d; c0 += VL) {  // 16 columns of acc^T at a time, in registers
        vf acc16[VL];
        for (int j = 0; j < VL; ++j) acc16[j] = load(a + (c0 + j) * VL) * alpha;
        for (int i = 0; i < VL; ++i) {
          const vf pv = load(pm + i * VL);
          const float* v = vp[i] + c0;
          for (int j = 0; j < VL; ++j) acc16[j] += pv * v[j];
        }
        for (int j = 0; j < VL; ++j) store(a + (c0 + j) * VL, acc16[j]);
      }
      for (; c0 < d; ++c0) {  // head_dim not a multiple of 16
        vf a1 = load(a + c0 * VL) * alpha;
        for (int i = 0; i < VL; ++i) a1 += load(pm + i * VL) * vp[i][c0];
        store(a + c0 * VL, a1);
      }
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    const float* a = at + (r / VL) * d * VL + r % VL;
    const float inv = 1.f / lb[r];
    float* dst = pb.out + (tok0 + r / G) * pb.o_s0 + (g * G + r % G) * pb.o_s1;
    for (int64_t c = 0; c < d; ++c) dst[c] = a[c * VL] * inv;
  }
  return true;
}

// A decode token is split into parts (keys k0 .. k1 - 1 each, run on any thread, merged by merge_parts) when
// the step's decode tokens are fewer than four times the threads and it has no prefill tiles: one sequence
// alone otherwise ran on one thread, and 3 or 5 on 2 threads 2:1 or 3:2.
// Parts keep at least SPLIT_MIN_KEYS keys: each costs a copy of q, its own first-chunk wait and the merge.
constexpr int64_t SPLIT_MIN_KEYS = 256;

// out[token's rows] from its parts' (max, sum, acc): the softmax over all its keys, each part's terms
// rescaled to the largest of their reference maxima.
void merge_parts(const Problem& pb, int64_t tok, int64_t rows, int64_t dp, const float* parts, int64_t num_parts) {
  const int64_t pf = part_floats(dp);
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < num_parts; ++p) m = std::max(m, parts[(p * rows + r) * pf]);
    float l = 0.f;
    float* dst = pb.out + tok * pb.o_s0 + r * pb.o_s1;
    for (int64_t c = 0; c < pb.d; ++c) dst[c] = 0.f;
    for (int64_t p = 0; p < num_parts; ++p) {
      const float* src = parts + (p * rows + r) * pf;
      const float wgt = std::exp(src[0] - m);
      l += wgt * src[1];
      for (int64_t c = 0; c < pb.d; ++c) dst[c] += wgt * src[2 + c];
    }
    const float inv = 1.f / l;
    for (int64_t c = 0; c < pb.d; ++c) dst[c] *= inv;
  }
}

template <int NV>
bool run_all(const Problem& pb, int64_t num_tiles) {
  // Work units: (tile, kv head) for tiles that run in lanes (prefill); (tile, every kv head at once) for
  // tiles that run by rows (decode): a page holds a block's K rows of all heads side by side, then its
  // V rows, and one item over all heads reads each of its lines once (see run_item).
  // Split decode tokens: units with part >= 0 write rows of `parts` (slot part) instead of out.
  struct Unit { int64_t tile, head, k0, k1, part; };  // head -1: every kv head; k1 -1: all the tile's keys
  const int64_t threads = at::get_num_threads();
  bool split = threads > 1 && num_tiles < 4 * threads;  // one thread runs the parts one after another: no gain
  for (int64_t w = 0; w < num_tiles && split; ++w) split = pb.tiles[4 * w + 2] == 1 && pb.group < LANE_ROWS;
  // Parts per token: at least two units a thread, and a whole number of units a thread (3 tokens on 2 threads
  // in 3 parts each ran 8% slower than in 2: 5 units against 4).
  int64_t per_tile = 1;
  if (split) {
    per_tile = (2 * threads + num_tiles - 1) / num_tiles;
    while ((num_tiles * per_tile) % threads != 0) ++per_tile;
  }
  const int64_t rows = pb.group * pb.kvh, dp = (pb.d + VL - 1) / VL * VL;
  std::vector<Unit> units;
  std::vector<int64_t> first_part(num_tiles + 1, 0);  // split tile w's parts: slots first_part[w] .. [w + 1] - 1
  units.reserve(num_tiles * pb.kvh);
  for (int64_t w = 0; w < num_tiles; ++w) {
    const int64_t nkeys = pb.tiles[4 * w + 3];  // a decode tile's keys (only split tiles use it)
    const int64_t n = split ? std::min(per_tile, nkeys / SPLIT_MIN_KEYS) : 1;
    first_part[w + 1] = first_part[w] + (n > 1 ? n : 0);
    if (n > 1) {
      for (int64_t p = 0; p < n; ++p)  // chunk-aligned bounds
        units.push_back({w, -1, nkeys * p / n / VL * VL, p + 1 < n ? nkeys * (p + 1) / n / VL * VL : nkeys,
                         first_part[w] + p});
    } else if (pb.tiles[4 * w + 2] * pb.group >= LANE_ROWS) {
      for (int64_t g = 0; g < pb.kvh; ++g) units.push_back({w, g, 0, -1, -1});
    } else {
      units.push_back({w, -1, 0, -1, -1});
    }
  }
  std::vector<float> parts(first_part[num_tiles] * rows * part_floats(dp));
  const int64_t items = static_cast<int64_t>(units.size());
  std::atomic<bool> ok{true};
  // Units differ in cost (sequence lengths, causal tiles): threads take them one at a time from a
  // shared counter instead of parallel_for's fixed contiguous ranges.
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  // Task t starts with unit t (its own: tasks t0 .. t1 - 1 where one thread runs several), the rest
  // come from the counter. A thread claims its next unit before computing the current one and
  // prefetches that unit's first keys: within an item each chunk is prefetched during the one before,
  // but the first would otherwise wait a full memory latency (an eighth of a 128-token decode). With
  // every unit from the counter, the first thread to start claimed the second unit too: two decode
  // sequences ran one after the other on one thread while the other thread had nothing.
  std::atomic<int64_t> next{nt};
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    Scratch sc;
    int64_t own = t0;
    auto claim = [&]() { return own < t1 ? own++ : next.fetch_add(1, std::memory_order_relaxed); };
    int64_t it = claim();
    while (it < items) {
      const int64_t after = claim();
      if (after < items) {
        const Unit& a = units[after];
        const int32_t* tile = pb.tiles + 4 * a.tile;
        const int64_t seq = tile[0], nkeys = (int64_t)tile[3] + tile[2] - 1;
        const float* ignored[2][VL];
        if (seq >= 0 && seq < pb.num_seqs && nkeys <= pb.max_blocks * pb.bs)  // else the kernel reports it
          locate(pb, seq, std::max<int64_t>(0, a.head), a.k0, a.k1 < 0 ? nkeys : a.k1, ignored[0], ignored[1],
                 a.head < 0 ? pb.kvh : 1);
      }
      const Unit u = units[it];
      if (u.head >= 0) {
        if (!run_item_lanes<NV>(pb, u.tile, u.head, sc)) ok.store(false, std::memory_order_relaxed);
      } else if (!run_item<NV>(pb, u.tile, sc, u.k0, u.k1,
                               u.part < 0 ? nullptr : parts.data() + u.part * rows * part_floats(dp))) {
        ok.store(false, std::memory_order_relaxed);
      }
      it = after;
    }
  });
  if (!ok.load()) return false;
  for (int64_t w = 0; w < num_tiles; ++w)
    if (first_part[w + 1] > first_part[w])
      merge_parts(pb, pb.tiles[4 * w + 1], rows, dp, parts.data() + first_part[w] * rows * part_floats(dp),
                  first_part[w + 1] - first_part[w]);
  return true;
}

}  // namespace

// out[tokens of each tile] = attention of those tokens' q over their sequence's cached K/V.
// Tokens not in any tile are left untouched.
void paged_attention(at::Tensor out,          // [T, H, D] float32, last dim contiguous
                     at::Tensor q,            // [T, H, D] float32, last dim contiguous
                     at::Tensor kv_pool,      // [P, 2, bs, kvh, D] float32 contiguous
                     at::Tensor tables,       // [S, max_blocks] int32 contiguous, one layer
                     at::Tensor tiles,        // [W, 4] int32: sequence, first token, tokens, keys of the first token
                     double scale) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && kv_pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && kv_pool.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D] of the same shape");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dim");
  TORCH_CHECK(kv_pool.dim() == 5 && kv_pool.size(1) == 2 && kv_pool.is_contiguous(),
              "kv_pool must be a contiguous [P, 2, bs, kvh, D]");
  TORCH_CHECK(kv_pool.size(4) == q.size(2), "head_dim of q and kv_pool differ");
  TORCH_CHECK(tables.scalar_type() == at::kInt && tables.dim() == 2 && tables.is_contiguous(),
              "tables must be a contiguous [S, max_blocks] int32");
  TORCH_CHECK(tiles.scalar_type() == at::kInt && tiles.dim() == 2 && tiles.size(1) == 4 && tiles.is_contiguous(),
              "tiles must be a contiguous [W, 4] int32");
  const int64_t H = q.size(1), kvh = kv_pool.size(3), d = q.size(2);
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "num_heads must be a multiple of kv_heads");
  const int64_t T = q.size(0), W = tiles.size(0);
  const int32_t* tp = tiles.data_ptr<int32_t>();
  for (int64_t w = 0; w < W; ++w)  // tokens are checked here, pages and lengths in the kernel
    TORCH_CHECK(tp[4 * w + 1] >= 0 && tp[4 * w + 2] >= 1 && (int64_t)tp[4 * w + 1] + tp[4 * w + 2] <= T,
                "tile ", w, " covers tokens outside q");
  if (W == 0 || T == 0) return;

  Problem pb{kv_pool.data_ptr<float>(), kv_pool.size(0), kv_pool.size(2), kvh, d,
             tables.data_ptr<int32_t>(), tables.size(0), tables.size(1),
             tp, q.data_ptr<float>(), q.stride(0), q.stride(1),
             out.data_ptr<float>(), out.stride(0), out.stride(1),
             H / kvh, (float)scale};
  bool ok;
  switch (d) {
    case 32: ok = run_all<32 / VL>(pb, W); break;
    case 64: ok = run_all<64 / VL>(pb, W); break;
    case 128: ok = run_all<128 / VL>(pb, W); break;
    default: ok = run_all<0>(pb, W); break;
  }
  TORCH_CHECK(ok, "a tile's sequence, length or page lies outside the block tables or the pool");
}

// This step's new K and V into their pool slots, for one layer: token t's row (all kv heads) goes to
// row offsets[t] of page pages[t], K half then V half. One call for both, where the torch path took two
// index_copy_ calls per layer (60 ops per decode step, ~1.5-2 ms of a B=64 step in their fixed costs).
void write_kv(at::Tensor kv_pool,  // [P, 2, bs, kvh, D] float32 contiguous
              at::Tensor k,        // [T, kvh, D] float32, heads and D contiguous (rows may be strided)
              at::Tensor v,        // [T, kvh, D] likewise
              at::Tensor pages,    // [T] int64: this layer's page of each token
              at::Tensor offsets)  // [T] int64: the token's row in that page
{
  TORCH_CHECK(kv_pool.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(kv_pool.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(kv_pool.dim() == 5 && kv_pool.size(1) == 2 && kv_pool.is_contiguous(),
              "kv_pool must be a contiguous [P, 2, bs, kvh, D]");
  const int64_t P = kv_pool.size(0), bs = kv_pool.size(2), kvh = kv_pool.size(3), d = kv_pool.size(4);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == kvh && k.size(2) == d,
              "k and v must be [T, kv_heads, head_dim] matching the pool");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d,
              "k and v need each token's heads contiguous");
  const int64_t T = k.size(0);
  TORCH_CHECK(pages.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && pages.dim() == 1 &&
                  offsets.dim() == 1 && pages.size(0) == T && offsets.size(0) == T && pages.is_contiguous() &&
                  offsets.is_contiguous(),
              "pages and offsets must be contiguous int64 [T]");
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // checked before anything is written: a bad slot changes nothing
    TORCH_CHECK(pg[t] >= 0 && pg[t] < P && off[t] >= 0 && off[t] < bs, "token ", t, "'s slot (page ", pg[t],
                ", row ", off[t], ") lies outside the pool");
  float* pool = kv_pool.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t row = kvh * d, ks = k.stride(0), vs = v.stride(0);
  // A decode step's rows are 1.5 KB each: one thread copies them faster than two can be woken.
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* dst = pool + (pg[t] * 2 * bs + off[t]) * row;
      std::memcpy(dst, kp + t * ks, row * sizeof(float));
      std::memcpy(dst + bs * row, vp + t * vs, row * sizeof(float));
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "this step's K/V into their pool slots (one layer)", py::arg("kv_pool"), py::arg("k"),
        py::arg("v"), py::arg("pages"), py::arg("offsets"), py::call_guard<py::gil_scoped_release>());
  // The GIL is released while the kernel runs: the engine's other Python threads (the server)
  // keep going through a long prefill.
  m.def("paged_attention", &paged_attention, "Paged attention over the pool in place (float32)",
        py::arg("out"), py::arg("q"), py::arg("kv_pool"), py::arg("tables"), py::arg("tiles"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}
