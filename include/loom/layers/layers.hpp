// Every layer template.
#pragma once

#include "attention.hpp"
#include "conv1d.hpp"
#include "conv2d.hpp"
#include "dropout.hpp"
#include "embedding.hpp"
#include "flatten.hpp"
#include "layer.hpp"
#include "layer_norm.hpp"
#include "linear.hpp"
#include "normalization.hpp"
#include "pointwise.hpp"
#include "pool2d.hpp"
#include "recurrent.hpp"
#include "relu.hpp"
#include "reshape.hpp"
#include "tensor_linear.hpp"
