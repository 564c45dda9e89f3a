// Every layer template.
#pragma once

#include "conv1d.hpp"
#include "conv2d.hpp"
#include "dropout.hpp"
#include "flatten.hpp"
#include "layer.hpp"
#include "linear.hpp"
#include "normalization.hpp"
#include "pointwise.hpp"
#include "pool2d.hpp"
#include "recurrent.hpp"
#include "relu.hpp"
#include "reshape.hpp"
