// Byte-level text for next-token training: a corpus read whole, split into
// training and validation text, and windows of context + 1 bytes drawn from
// each. A window's first `context` bytes are the sample (token ids 0..255,
// one float each, what an Embedding<256, W> reads); its target at each
// position is the byte after it (a class per position, PositionCrossEntropy).
//
// The corpus this library trains on is Debian's fortunes package: the
// fortune files in /usr/share/games/fortunes (about 2.4 MB of English, the
// "%" lines between fortunes kept as they are), read in file-name order,
// their .dat indexes and .u8 links left out.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "../core/error.hpp"
#include "../core/rng.hpp"
#include "dataset.hpp"

namespace loom::data {

inline constexpr const char* fortunes_dir = "/usr/share/games/fortunes";

struct TextCorpus {
  std::string name;
  std::string text;                // every file's bytes, one after another
  std::vector<std::string> files;  // read, in order
};

// The fortune files in `dir`: every regular file that is not a .dat index
// (the .u8 names are links to the files themselves).
inline TextCorpus read_fortunes(const std::string& dir = fortunes_dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  LOOM_CHECK(fs::is_directory(dir, error), "no fortune files in '", dir,
             "' (not a folder): install Debian's fortunes package (apt-get install fortunes), or "
             "pass the folder of a text corpus");
  TextCorpus corpus;
  corpus.name = "fortunes";
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const fs::path& path = entry.path();
    if (entry.is_symlink() || !entry.is_regular_file() || path.extension() == ".dat") continue;
    paths.push_back(path);
  }
  std::ranges::sort(paths);
  for (const auto& path : paths) {
    std::ifstream in(path, std::ios::binary);
    LOOM_CHECK(in.good(), "cannot read the text file '", path.string(), "'");
    std::ostringstream bytes;
    bytes << in.rdbuf();
    corpus.text += bytes.str();
    corpus.files.push_back(path.string());
  }
  LOOM_CHECK(!corpus.text.empty(), "no fortune files in '", dir,
             "': install Debian's fortunes package (apt-get install fortunes), or pass the folder "
             "of a text corpus");
  return corpus;
}

// `count` windows of context + 1 bytes of `text`, their starts drawn
// uniformly by `seed` (the same seed, the same windows): samples of
// `context` byte ids, and the next byte at each position as its target.
inline Dataset text_windows(std::string_view text, std::size_t context, std::size_t count,
                            std::uint64_t seed, const std::string& name) {
  LOOM_CHECK(context > 0, "text windows of context 0: give a context of at least 1 byte");
  LOOM_CHECK(text.size() > context, "the text '", name, "' holds ", text.size(),
             " bytes, fewer than one window of context + 1 = ", context + 1,
             ": give a longer corpus or a shorter context");
  Dataset set;
  set.name = name;
  set.count = count;
  set.channels = 1;
  set.height = 1;
  set.width = context;
  set.classes = 256;
  set.max_target = context;
  set.images.resize(count * context);
  set.targets.resize(count * context);
  const std::size_t starts = text.size() - context;  // a window may start at 0 .. starts - 1
  for (std::size_t s = 0; s < count; ++s) {
    const auto start = std::min(
        starts - 1, static_cast<std::size_t>(uniform01(seed, 0x7E47, s) * static_cast<double>(starts)));
    for (std::size_t p = 0; p < context; ++p) {
      set.images[s * context + p] = static_cast<float>(static_cast<unsigned char>(text[start + p]));
      set.targets[s * context + p] =
          static_cast<std::int32_t>(static_cast<unsigned char>(text[start + p + 1]));
    }
  }
  return set;
}

// The corpus's last `validation_fraction` of bytes as validation text, the
// rest as training text, each sampled into windows: `train_windows` training
// windows (0: as many as the training text has contexts) and
// `validation_windows` validation ones (seeds of their own, so neither
// depends on the other's count).
inline Split text_split(const TextCorpus& corpus, std::size_t context, std::uint64_t seed,
                        std::size_t train_windows = 0, double validation_fraction = 0.1,
                        std::size_t validation_windows = 512) {
  LOOM_CHECK(validation_fraction > 0.0 && validation_fraction < 1.0,
             "text_split: a validation fraction of ", validation_fraction, ", not between 0 and 1");
  const auto cut = static_cast<std::size_t>(static_cast<double>(corpus.text.size()) *
                                            (1.0 - validation_fraction));
  const std::string_view all(corpus.text);
  const std::string_view train = all.substr(0, cut), validation = all.substr(cut);
  const std::size_t windows =
      train_windows > 0 ? train_windows
                        : std::max<std::size_t>(1, train.size() / std::max<std::size_t>(context, 1));
  return {text_windows(train, context, windows, seed, corpus.name + " (training text)"),
          text_windows(validation, context, validation_windows, seed + 1,
                       corpus.name + " (validation text)")};
}

}  // namespace loom::data
