// The unified pool as the C++ CPU kernels read it: an adapter's pages (Pages) and one batch's segment
// table (SegTables, LoraDeviceTensors on the Python side). Included by cpu_sgmv.cpp and cpu_linear.cpp
// (the GEMM's LoRA epilogue); kernels/cpu_build.py hashes this header with each source that it builds.
//
// Pool addressing (unified_pager): the pool is [num_pages * rows_per_page, D] float32 rows; an
// adapter's logical row l lives in page pages[l / rows_per_page] at row l % rows_per_page. A matrix
// is stored flattened (row-major) from its first logical row on, so a run of elements is contiguous in
// memory up to the next page boundary.

#pragma once

#include "torch_ext.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

struct Pages {
  const float* pool;
  const int32_t* table;  // this segment's page table
  int64_t page_elems;    // rows_per_page * D

  // Pointer to logical element `e` of the adapter (elements counted from its first row) and how
  // many elements follow it contiguously before the page ends.
  inline const float* at(int64_t e, int64_t* run) const {
    int64_t page = e / page_elems, off = e - page * page_elems;
    *run = page_elems - off;
    return pool + static_cast<int64_t>(table[page]) * page_elems + off;
  }

  // n contiguous logical elements from e: a pointer into the pool when they lie in one page,
  // else copied into buf (a run crossing a page boundary).
  inline const float* span(int64_t e, int64_t n, float* buf) const {
    int64_t run;
    const float* p = at(e, &run);
    if (run >= n) return p;
    int64_t done = 0;
    while (done < n) {
      int64_t take = std::min(run, n - done);
      std::memcpy(buf + done, p, take * sizeof(float));
      done += take;
      if (done < n) p = at(e + done, &run);
    }
    return buf;
  }
};

// The segment table of one batch (LoraDeviceTensors): seg_start/seg_len [S] int32; layout [S, L, 7, 3]
// int32 (rank, a_row, b_row: logical rows); scales [S, L, 7] float32; pages [S, P] int32 (each
// segment's page table, padded); pool_rows [R, D] contiguous float32.
struct SegTables {
  const int32_t *st, *ln, *lay, *pg;
  const float* sc;
  const float* pool;
  int64_t num_segs, num_layers, num_modules, max_pages, d, page_elems;

  SegTables(const at::Tensor& pool_rows, const at::Tensor& seg_start, const at::Tensor& seg_len,
            const at::Tensor& layout, const at::Tensor& scales, const at::Tensor& pages,
            int64_t rows_per_page, int64_t layer) {
    TORCH_CHECK(pool_rows.scalar_type() == at::kFloat && pool_rows.is_contiguous() && pool_rows.dim() == 2,
                "pool_rows must be a contiguous float32 [R, D] tensor");
    TORCH_CHECK(layout.is_contiguous() && scales.is_contiguous() && pages.is_contiguous() &&
                    seg_start.is_contiguous() && seg_len.is_contiguous(),
                "segment tables must be contiguous");
    TORCH_CHECK(layout.scalar_type() == at::kInt && pages.scalar_type() == at::kInt &&
                    seg_start.scalar_type() == at::kInt && seg_len.scalar_type() == at::kInt &&
                    scales.scalar_type() == at::kFloat,
                "segment tables: int32 (layout, pages, starts, lengths) and float32 (scales)");
    num_segs = seg_start.size(0), num_layers = layout.size(1), num_modules = layout.size(2);
    TORCH_CHECK(layer >= 0 && layer < num_layers, "layer out of range");
    st = seg_start.data_ptr<int32_t>(), ln = seg_len.data_ptr<int32_t>(), lay = layout.data_ptr<int32_t>();
    sc = scales.data_ptr<float>(), pg = pages.data_ptr<int32_t>(), pool = pool_rows.data_ptr<float>();
    max_pages = pages.size(1), d = pool_rows.size(1), page_elems = rows_per_page * d;
  }
  // (rank, a_row, b_row) of segment s's (layer, module), and its scale
  const int32_t* entry(int64_t s, int64_t layer, int64_t module) const {
    return lay + ((s * num_layers + layer) * num_modules + module) * 3;
  }
  float scale(int64_t s, int64_t layer, int64_t module) const {
    return sc[(s * num_layers + layer) * num_modules + module];
  }
  Pages pages_of(int64_t s) const { return Pages{pool, pg + s * max_pages, page_elems}; }
};

}  // namespace
