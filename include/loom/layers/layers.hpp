// Every layer template.
#pragma once

#include "conv2d.hpp"
#include "flatten.hpp"
#include "layer.hpp"
#include "linear.hpp"
#include "pool2d.hpp"
#include "relu.hpp"
