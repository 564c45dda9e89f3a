// A C stream closed by its owner: std::unique_ptr<std::FILE, FileClose>, for
// the readers that use stdio (IDX, CIFAR-10, safetensors, the audio cache).
#pragma once

#include <cstdio>
#include <memory>

namespace loom {

struct FileClose {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

using File = std::unique_ptr<std::FILE, FileClose>;

}  // namespace loom
