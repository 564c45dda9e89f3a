// Reader for CIFAR-10's binary version (cifar-10-binary.tar.gz, extracted:
// cifar-10-batches-bin/data_batch_1.bin ... data_batch_5.bin, test_batch.bin).
// Each record is 3073 bytes: the label (0..9), then the 32 x 32 red, green
// and blue planes, row-major: already the NCHW layout loom trains on. As with
// the IDX reader, every way a file can be wrong is a loom::Error that names
// the file and says what was expected and what was found.
#pragma once

#include <array>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <loom/core/file.hpp>
#include <loom/core/error.hpp>
#include <loom/data/dataset.hpp>
#include <memory>
#include <string>
#include <vector>

namespace loom::data {

inline constexpr std::size_t cifar_side = 32;
inline constexpr std::size_t cifar_channels = 3;
inline constexpr std::size_t cifar_pixels = cifar_channels * cifar_side * cifar_side;
inline constexpr std::size_t cifar_record = 1 + cifar_pixels;

// Per channel (red, green, blue): (pixel / 255 - mean) / std, with the
// CIFAR-10 training set's own statistics.
struct CifarNormalize {
  std::array<float, 3> mean{0.4914f, 0.4822f, 0.4465f};
  std::array<float, 3> std{0.2470f, 0.2435f, 0.2616f};
};

namespace detail {

inline constexpr const char* cifar_hint =
    "extract the binary version (cifar-10-binary.tar.gz, folder cifar-10-batches-bin) and pass "
    "that folder";

// Appends `path`'s records to `set` (labels checked, pixels normalised).
inline void read_cifar_file(const std::string& path, const CifarNormalize& normalize,
                            Dataset& set) {
  std::error_code code;
  if (!std::filesystem::exists(path, code))
    LOOM_FAIL("CIFAR-10 file '", path, "' not found; ", cifar_hint);
  errno = 0;
  const File file(std::fopen(path.c_str(), "rb"));
  if (!file) LOOM_FAIL("cannot open CIFAR-10 file '", path, "': ", std::strerror(errno));
  std::vector<std::uint8_t> bytes;
  std::uint8_t buffer[1 << 16];
  while (const std::size_t got = std::fread(buffer, 1, sizeof buffer, file.get()))
    bytes.insert(bytes.end(), buffer, buffer + got);
  if (std::ferror(file.get()))
    LOOM_FAIL("cannot read CIFAR-10 file '", path, "': ", std::strerror(errno));
  if (bytes.empty())
    LOOM_FAIL("CIFAR-10 file '", path, "' is empty; expected records of ", cifar_record,
              " bytes (a label, then 3 x 32 x 32 pixels)");
  if (bytes.size() % cifar_record != 0 && bytes.size() % (cifar_record + 1) == 0)
    LOOM_FAIL("CIFAR-10 file '", path, "' holds ", bytes.size(), " bytes: whole 3074-byte "
              "records, CIFAR-100's layout (two label bytes), not CIFAR-10's 3073");
  if (bytes.size() % cifar_record != 0)
    LOOM_FAIL("CIFAR-10 file '", path, "' holds ", bytes.size(), " bytes, not a whole number of ",
              cifar_record, "-byte records: record ", bytes.size() / cifar_record,
              " is cut short after ", bytes.size() % cifar_record,
              " bytes; the file is damaged, extract it again");
  std::array<float, 256 * 3> table;
  for (std::size_t c = 0; c < 3; ++c)
    for (std::size_t v = 0; v < 256; ++v)
      table[c * 256 + v] = static_cast<float>(
          (static_cast<double>(v) / 255.0 - normalize.mean[c]) / normalize.std[c]);
  const std::size_t records = bytes.size() / cifar_record;
  set.images.reserve(set.images.size() + records * cifar_pixels);
  for (std::size_t r = 0; r < records; ++r) {
    const std::uint8_t* record = bytes.data() + r * cifar_record;
    if (record[0] >= set.classes)
      LOOM_FAIL("CIFAR-10 file '", path, "' has label ", int{record[0]}, " in record ", r,
                "; expected 0..", set.classes - 1);
    set.labels.push_back(record[0]);
    for (std::size_t i = 0; i < cifar_pixels; ++i)
      set.images.push_back(table[i / (cifar_side * cifar_side) * 256 + record[1 + i]]);
  }
  set.count += records;
}

}  // namespace detail

// The records of `paths`, in order, as one data set.
inline Dataset read_cifar10(const std::vector<std::string>& paths, std::string name,
                            CifarNormalize normalize = {}) {
  for (std::size_t c = 0; c < 3; ++c)
    LOOM_CHECK(std::isfinite(normalize.mean[c]) && std::isfinite(normalize.std[c]) &&
                   normalize.std[c] > 0,
               "CifarNormalize channel ", c, ": mean ", normalize.mean[c], ", std ",
               normalize.std[c], " is invalid; std must be positive and both finite");
  Dataset set;
  set.name = std::move(name);
  set.channels = cifar_channels;
  set.height = set.width = cifar_side;
  set.classes = 10;
  for (const auto& path : paths) detail::read_cifar_file(path, normalize, set);
  return set;
}

// The training set (data_batch_1..5.bin, 50000 images) and the test set
// (test_batch.bin, 10000) from the extracted folder.
inline Split cifar10(const std::string& dir, CifarNormalize normalize = {}) {
  namespace fs = std::filesystem;
  std::vector<std::string> train;
  for (int k = 1; k <= 5; ++k)
    train.push_back((fs::path(dir) / ("data_batch_" + std::to_string(k) + ".bin")).string());
  return {read_cifar10(train, "cifar10-train", normalize),
          read_cifar10({(fs::path(dir) / "test_batch.bin").string()}, "cifar10-test", normalize)};
}

}  // namespace loom::data
