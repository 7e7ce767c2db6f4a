// The op namespace the kernels register in, and the registration macros every source uses.
// specdec/runtime/build.py passes -DSPECDEC_OPS=<namespace> per variant (the AVX2 build gets its own, so
// both can be loaded in one process); packed_linear.cpp defines the library, the others add fragments.
#pragma once

#include <torch/library.h>

#ifndef SPECDEC_OPS
#define SPECDEC_OPS specdec_kernels
#endif

// One more macro level so that SPECDEC_OPS expands before TORCH_LIBRARY pastes it.
#define SPECDEC_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define SPECDEC_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define SPECDEC_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
