// The CPU backend: every primitive op a layer, loss or optimizer calls.
#pragma once

#include "blas_kernels.hpp"
#include "conv.hpp"
#include "epilogue.hpp"
#include "gemm.hpp"
#include "pool.hpp"
#include "sgd.hpp"
#include "softmax_xent.hpp"
#include "threads.hpp"
#include "transcendental.hpp"
