// The data module in one include: IDX reading, in-memory datasets, batch loading.
#pragma once

#include <loom/data/cifar.hpp>
#include <loom/data/dataset.hpp>
#include <loom/data/idx.hpp>
#include <loom/data/loader.hpp>
#include <loom/data/text.hpp>
