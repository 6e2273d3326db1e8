// What a C++ CPU kernel here needs from torch, and no more: at::Tensor and its methods, at::empty,
// at::parallel_for, TORCH_CHECK, and pybind11 with torch's Tensor caster (py::, PYBIND11_MODULE, std::vector
// and std::optional arguments). Included by every cpu_*.cpp instead of <torch/extension.h>.
//
// Why: torch/extension.h brings in the whole C++ frontend (torch/all.h: autograd, nn, optim, data), which
// the kernels never use, and parsing it was most of each kernel's build. On an AMD EPYC (Zen 4, 2 cores;
// g++ 12, the kernels' flags, one build at a time): cpu_argmax.cpp 26.4 s with torch/extension.h, 11.1 s
// with these headers; cpu_sgmv.cpp 38.7 s, 17.3 s. Every fresh machine builds all eight kernels before
// its first step, and CI builds a few more variants besides.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
