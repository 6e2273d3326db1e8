// Which x86 CPU the kernels run on, for the few choices measured to go opposite ways on different CPUs (each
// choice's comment gives its figures). Included by cpu_linear.cpp and cpu_sgmv.cpp.

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace cpu_family {

// The x86 family with its extended bits: 25 an AMD Zen 3/4, 26 a Zen 5, 6 Intel's cores; 0 where cpuid says
// nothing, or off x86.
inline int x86_family() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return 0;
  const int base = (a >> 8) & 0xf;
  return base == 0xf ? base + static_cast<int>((a >> 20) & 0xff) : base;
#else
  return 0;
#endif
}

inline bool amd() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool is = __builtin_cpu_is("amd");
  return is;
#else
  return false;
#endif
}

// An AMD Zen 5 or later (family 26 on).
inline bool zen5() {
  static const bool is = amd() && x86_family() >= 26;
  return is;
}

}  // namespace cpu_family
