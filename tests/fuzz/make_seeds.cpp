// Writes the seed corpus (tests/fuzz/corpus/<target>/): small valid files,
// real where the data is at hand. Run it again when a format changes; the
// replay tests fail while a seed no longer parses. Only the trained
// checkpoint's position.seconds differs from one run to the next.
//   loom_fuzz_make_seeds FASHION_MNIST_DIR OUT_DIR
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_net.hpp"

namespace fs = std::filesystem;
using loom::Error;
using Bytes = std::vector<std::uint8_t>;

namespace {

void report(const fs::path& path) {
  std::printf("%s: %ju bytes\n", path.c_str(), static_cast<std::uintmax_t>(fs::file_size(path)));
}

void write_raw(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  out.close();
  LOOM_CHECK(out.good(), "cannot write '", path.string(), "'");
  report(path);
}

void write_gzip(const fs::path& path, const Bytes& bytes) {
  gzFile file = gzopen(path.c_str(), "wb9");
  LOOM_CHECK(file, "cannot create '", path.string(), "'");
  const int wrote = gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  LOOM_CHECK(gzclose(file) == Z_OK && wrote == static_cast<int>(bytes.size()), "cannot write '",
             path.string(), "'");
  report(path);
}

// The IDX header of `array` with its first dimension cut to `count`, then
// the data of those `count` items.
Bytes idx_head(const loom::data::IdxArray& array, std::size_t count) {
  Bytes bytes{0, 0, 0x08, static_cast<std::uint8_t>(array.dims.size())};
  std::size_t item = 1;
  for (std::size_t i = 0; i < array.dims.size(); ++i) {
    const std::size_t dim = i == 0 ? count : array.dims[i];
    if (i > 0) item *= dim;
    for (int shift = 24; shift >= 0; shift -= 8)
      bytes.push_back(static_cast<std::uint8_t>(dim >> shift));
  }
  bytes.insert(bytes.end(), array.data.begin(),
               array.data.begin() + static_cast<std::ptrdiff_t>(count * item));
  return bytes;
}

// CIFAR-10 records with labels 0, 1, ... and smooth made-up planes.
Bytes cifar_records(std::size_t count) {
  Bytes bytes;
  for (std::size_t r = 0; r < count; ++r) {
    bytes.push_back(static_cast<std::uint8_t>(r % 10));
    for (std::size_t c = 0; c < 3; ++c)
      for (std::size_t y = 0; y < 32; ++y)
        for (std::size_t x = 0; x < 32; ++x)
          bytes.push_back(static_cast<std::uint8_t>(x * 8 + y * 4 + c * 85 + r * 31));
  }
  return bytes;
}

// A header written by hand, for the dtypes SafetensorsWriter does not write.
Bytes mixed_dtypes_safetensors() {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"half":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]},)"
      R"("index":{"dtype":"I64","shape":[2],"data_offsets":[8,24]},)"
      R"("mask":{"dtype":"BOOL","shape":[3],"data_offsets":[24,27]},)"
      R"("none":{"dtype":"U8","shape":[0,4],"data_offsets":[27,27]}})";
  Bytes bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<std::uint8_t>(header.size() >> (8 * i)));
  bytes.insert(bytes.end(), header.begin(), header.end());
  const Bytes data{0x00, 0x3c, 0x00, 0x40, 0x00, 0xc2, 0x00, 0x00,  // 1, 2, -3, 0 in F16
                   1,    0,    0,    0,    0,    0,    0,    0,     // 1 in I64
                   0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f,  // its largest value
                   1,    0,    1};
  bytes.insert(bytes.end(), data.begin(), data.end());
  return bytes;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s FASHION_MNIST_DIR OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string fashion = argv[1];
  const fs::path out = argv[2];
  using namespace loom;
  for (const char* target : {"idx", "cifar", "safetensors", "checkpoint"})
    fs::create_directories(out / target);

  const auto images =
      data::read_idx(data::detail::find_idx_file(fashion, "train-images-idx3-ubyte"));
  const auto labels =
      data::read_idx(data::detail::find_idx_file(fashion, "train-labels-idx1-ubyte"));
  write_raw(out / "idx" / "images-2", idx_head(images, 2));
  write_gzip(out / "idx" / "images-2.gz", idx_head(images, 2));
  write_raw(out / "idx" / "labels-16", idx_head(labels, 16));
  write_gzip(out / "idx" / "labels-16.gz", idx_head(labels, 16));

  write_raw(out / "cifar" / "records-1.bin", cifar_records(1));
  write_raw(out / "cifar" / "records-2.bin", cifar_records(2));

  io::SafetensorsWriter weights;
  const std::vector<float> values{0.5f, -1.25f, 3.0f, 0.0f, -0.0f, 1e-30f, 6.5e4f, -2.0f, 0.125f};
  weights.add("conv.weight", std::span(values).first(9), {1, 1, 3, 3});
  weights.add("conv.bias", std::span(values).first(1), {1});
  weights.add("scale", std::span(values).first(1), {});
  weights.add("empty", {}, {0, 3});
  weights.set_metadata("note", "fuzz seed");
  weights.write(out / "safetensors" / "weights.safetensors");
  report(out / "safetensors" / "weights.safetensors");
  write_raw(out / "safetensors" / "mixed-dtypes.safetensors", mixed_dtypes_safetensors());

  // The weights of a short real run, and a checkpoint of a trainer that has
  // not fit yet (no fit.* metadata, epoch 0).
  data::IdxArray few_images = images, few_labels = labels;
  few_images.dims[0] = few_labels.dims[0] = 64;
  few_images.data.resize(64 * 28 * 28);
  few_labels.data.resize(64);
  const auto train = data::make_image_dataset(few_images, few_labels, 10, {}, "seed");
  auto fresh = fuzz::make_checkpoint_trainer();
  fresh.save(out / "checkpoint" / "fresh.safetensors");
  report(out / "checkpoint" / "fresh.safetensors");
  auto trained = fuzz::make_checkpoint_trainer();
  trained.fit(train, {.epochs = 1, .batch_size = 32});
  trained.save(out / "checkpoint" / "trained.safetensors");
  fs::copy_file(out / "checkpoint" / "trained.safetensors",
                out / "safetensors" / "checkpoint.safetensors",
                fs::copy_options::overwrite_existing);
  report(out / "checkpoint" / "trained.safetensors");
  report(out / "safetensors" / "checkpoint.safetensors");
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "%s\n", error.what());
  return 1;
}
