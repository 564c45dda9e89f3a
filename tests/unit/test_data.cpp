// The data module: IDX reading (and every way a file can be broken), the
// Fashion-MNIST loader against the installed files, and the batch Loader's
// ordering, contents and thread lifetime.
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <loom/data/data.hpp>
#include <loom/parallel/grid_engine.hpp>  // batch_share, as replicas split a batch
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "loom_test.hpp"
#include "temp_dir.hpp"

namespace {

namespace fs = std::filesystem;
using namespace loom::data;
using Bytes = std::vector<std::uint8_t>;
using Catch::Contains;

// CMake passes the configured folder; a hand-built test uses the library default.
#ifdef LOOM_TEST_DATA_DIR
const std::string real_dir = LOOM_TEST_DATA_DIR;
#else
const std::string real_dir = default_fashion_mnist_dir;
#endif

using loom::test::TempDir;

Bytes idx_bytes(const std::vector<std::uint32_t>& dims, const Bytes& data) {
  Bytes bytes{0x00, 0x00, 0x08, static_cast<std::uint8_t>(dims.size())};
  for (std::uint32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8)
      bytes.push_back(static_cast<std::uint8_t>(d >> shift));
  bytes.insert(bytes.end(), data.begin(), data.end());
  return bytes;
}

// Bytes that deflate poorly, so a cut .gz file is cut inside the deflate data.
Bytes noise(std::size_t n, std::uint64_t seed) {
  Bytes bytes(n);
  loom::CounterRng rng(seed, 0);
  for (auto& b : bytes) b = static_cast<std::uint8_t>(rng.next());
  return bytes;
}

void write_plain(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void write_gz(const std::string& path, const Bytes& bytes) {
  gzFile file = gzopen(path.c_str(), "wb");
  REQUIRE(file != nullptr);
  const int written = gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  REQUIRE(gzclose(file) == Z_OK);
  REQUIRE(written == static_cast<int>(bytes.size()));
}

Bytes read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

Bytes read_decompressed(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  REQUIRE(file != nullptr);
  Bytes bytes;
  std::array<std::uint8_t, 1 << 16> chunk;
  int got = 0;
  while ((got = gzread(file, chunk.data(), chunk.size())) > 0)
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + got);
  REQUIRE(got == 0);
  REQUIRE(gzclose(file) == Z_OK);
  return bytes;
}

const Split& real_data() {
  static const Split split = fashion_mnist(real_dir);
  return split;
}

// A small Fashion-MNIST-shaped folder: 3 train and 2 test images of 2x2.
void write_small_fashion_mnist(const TempDir& dir) {
  write_gz(dir.file("train-images-idx3-ubyte.gz"), idx_bytes({3, 2, 2}, noise(12, 1)));
  write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_bytes({3}, {4, 0, 9}));
  write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_bytes({2, 2, 2}, noise(8, 2)));
  write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), idx_bytes({2}, {1, 7}));
}

// Sample i holds the values 1000 i + k, so a batch row names its own index.
Dataset toy_dataset(std::size_t count, std::size_t classes = 10) {
  Dataset set;
  set.name = "toy";
  set.count = count;
  set.channels = 2;
  set.height = 1;
  set.width = 3;
  set.classes = classes;
  for (std::size_t i = 0; i < count; ++i) {
    for (std::size_t k = 0; k < set.sample_size(); ++k)
      set.images.push_back(static_cast<float>(1000 * i + k));
    set.labels.push_back(static_cast<std::int32_t>(i % classes));
  }
  return set;
}

// Runs one epoch, checks that each batch holds exactly the dataset rows of the
// epoch's order at its positions, and returns the sample indices in the order
// they came.
std::vector<std::size_t> run_epoch(Loader& loader, const Dataset& set, const LoaderOptions& options,
                                   std::size_t epoch) {
  const std::vector<std::size_t> order = epoch_order(set.count, options, epoch);
  loader.start_epoch(epoch);
  std::vector<std::size_t> seen;
  std::size_t batches = 0;
  Batch batch;
  while (loader.next(batch)) {
    ++batches;
    REQUIRE(batch.first == seen.size());
    REQUIRE(batch.size > 0);
    REQUIRE(batch.size <= loader.max_batch());
    const std::size_t n = set.sample_size();
    for (std::size_t j = 0; j < batch.size; ++j) {
      const std::size_t index = order[batch.first + j];
      REQUIRE(batch.labels[j] == set.labels[index]);
      REQUIRE(std::equal(batch.images + j * n, batch.images + (j + 1) * n,
                         set.images.begin() + static_cast<std::ptrdiff_t>(index * n)));
      seen.push_back(index);
    }
  }
  REQUIRE(batches == loader.batches_per_epoch());
  REQUIRE_FALSE(loader.next(batch));
  return seen;
}

std::vector<std::size_t> identity(std::size_t n) {
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

}  // namespace

TEST_CASE("data: Fashion-MNIST loads with the published counts and statistics") {
  const Split& split = real_data();
  for (const Dataset* set : {&split.train, &split.test}) {
    REQUIRE(set->channels == 1);
    REQUIRE(set->height == 28);
    REQUIRE(set->width == 28);
    REQUIRE(set->classes == 10);
    REQUIRE(set->sample_size() == 784);
    REQUIRE(set->images.size() == set->count * 784);
    REQUIRE(set->labels.size() == set->count);
  }
  REQUIRE(split.train.count == 60000);
  REQUIRE(split.test.count == 10000);
  REQUIRE(split.train.name == "fashion-mnist-train");
  REQUIRE(split.test.name == "fashion-mnist-test");
  // Class 9 (ankle boot) opens the training file.
  REQUIRE(split.train.labels[0] == 9);

  std::array<std::size_t, 10> train_hist{}, test_hist{};
  for (std::int32_t label : split.train.labels) ++train_hist.at(static_cast<std::size_t>(label));
  for (std::int32_t label : split.test.labels) ++test_hist.at(static_cast<std::size_t>(label));
  for (std::size_t c = 0; c < 10; ++c) {
    INFO("class " << c);
    REQUIRE(train_hist[c] == 6000);
    REQUIRE(test_hist[c] == 1000);
  }

  double sum = 0.0, sum_sq = 0.0;
  for (float v : split.train.images) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(split.train.images.size());
  const double mean = sum / n;
  const double std = std::sqrt(sum_sq / n - mean * mean);
  REQUIRE(std::abs(mean) < 1e-3);
  REQUIRE(std::abs(std - 1.0) < 1e-2);
}

TEST_CASE("data: read_idx reads the real files' headers") {
  const IdxArray labels = read_idx(real_dir + "/train-labels-idx1-ubyte.gz");
  REQUIRE(labels.dims == std::vector<std::size_t>{60000});
  REQUIRE(labels.data.size() == 60000);
  REQUIRE(labels.data[0] == 9);
  REQUIRE(labels.path == real_dir + "/train-labels-idx1-ubyte.gz");
  const IdxArray images = read_idx(real_dir + "/t10k-images-idx3-ubyte.gz");
  REQUIRE(images.dims == std::vector<std::size_t>{10000, 28, 28});
  REQUIRE(images.data.size() == 10000u * 28 * 28);
}

TEST_CASE("data: read_idx reads gzip and plain files alike") {
  TempDir dir;
  const Bytes data = noise(2 * 3 * 5, 3);
  const Bytes bytes = idx_bytes({2, 3, 5}, data);
  write_gz(dir.file("a.gz"), bytes);
  write_plain(dir.file("a"), bytes);
  for (const std::string& path : {dir.file("a.gz"), dir.file("a")}) {
    const IdxArray array = read_idx(path);
    REQUIRE(array.dims == std::vector<std::size_t>{2, 3, 5});
    REQUIRE(array.data == data);
    REQUIRE(array.path == path);
  }
}

TEST_CASE("data: an uncompressed copy loads the same data as the .gz files") {
  TempDir dir;
  for (const char* stem : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    write_plain(dir.file(stem), read_decompressed(real_dir + "/" + stem + ".gz"));
  const Split plain = fashion_mnist(dir.path());
  const Split& gz = real_data();
  REQUIRE(plain.train.count == 60000);
  REQUIRE(plain.test.count == 10000);
  REQUIRE(plain.train.images == gz.train.images);
  REQUIRE(plain.train.labels == gz.train.labels);
  REQUIRE(plain.test.images == gz.test.images);
  REQUIRE(plain.test.labels == gz.test.labels);
}

TEST_CASE("data: fashion_mnist prefers the .gz file when both forms are present") {
  TempDir dir;
  write_small_fashion_mnist(dir);
  for (const char* stem : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    write_plain(dir.file(stem), {'n', 'o', 't', ' ', 'i', 'd', 'x'});
  const Split split = fashion_mnist(dir.path(), Normalize{0.0f, 1.0f});
  REQUIRE(split.train.count == 3);
  REQUIRE(split.train.height == 2);
  REQUIRE(split.train.width == 2);
  REQUIRE(split.train.labels == std::vector<std::int32_t>{4, 0, 9});
  REQUIRE(split.test.labels == std::vector<std::int32_t>{1, 7});
  const Bytes pixels = noise(12, 1);
  for (std::size_t i = 0; i < pixels.size(); ++i)
    REQUIRE(split.train.images[i] == static_cast<float>(pixels[i] / 255.0));
}

TEST_CASE("data: make_image_dataset normalises with the given mean and std") {
  IdxArray images{{2, 1, 2}, {0, 255, 51, 102}, "imgs"};
  IdxArray labels{{2}, {3, 1}, "labs"};
  const Dataset set = make_image_dataset(images, labels, 4, Normalize{0.2f, 0.5f}, "tiny");
  REQUIRE(set.name == "tiny");
  REQUIRE(set.count == 2);
  REQUIRE(set.classes == 4);
  REQUIRE(set.labels == std::vector<std::int32_t>{3, 1});
  loom::test::require_close(set.images, std::vector<double>{-0.4, 1.6, 0.0, 0.4},
                            loom::test::Tolerance{1e-6, 1e-6}, "normalised pixels");
}

TEST_CASE("data: read_idx reports a missing or unreadable file") {
  TempDir dir;
  const std::string missing = dir.file("train-images-idx3-ubyte.gz");
  REQUIRE_THROWS_AS(read_idx(missing), loom::Error);
  REQUIRE_THROWS_WITH(read_idx(missing), Contains(missing) && Contains("cannot open") &&
                                             Contains("No such file or directory") &&
                                             Contains("dataset-fashion-mnist") &&
                                             Contains("--data DIR"));
  // A folder opens but cannot be read (tests may run as root, so permission
  // bits cannot make a file unreadable here).
  REQUIRE_THROWS_WITH(read_idx(dir.path()), Contains(dir.path()) && Contains("cannot read") &&
                                                Contains("Is a directory") &&
                                                Contains("--data DIR"));
}

TEST_CASE("data: read_idx reports a wrong magic number") {
  TempDir dir;
  const std::string path = dir.file("image.pgm");
  write_plain(path, {'P', '5', '\n', '2', '8', ' ', '2', '8'});
  REQUIRE_THROWS_AS(read_idx(path), loom::Error);
  REQUIRE_THROWS_WITH(read_idx(path), Contains(path) && Contains("wrong magic") &&
                                          Contains("found 0x50 0x35 0x0a 0x32") &&
                                          Contains("expected 0x00 0x00 <type> <rank>"));
}

TEST_CASE("data: an images file of rank 4 is refused for its rank, from the header") {
  TempDir dir;
  write_small_fashion_mnist(dir);
  // The images file's rank byte edited from 3 to 4: its 4th dimension would
  // be read from the pixels, and the size misreported.
  write_gz(dir.file("train-images-idx3-ubyte.gz"), idx_bytes({3, 2, 2, 1}, noise(12, 1)));
  const std::string path = dir.file("train-images-idx3-ubyte.gz");
  REQUIRE_THROWS_WITH(fashion_mnist(dir.path()),
                      Contains("IDX file '" + path + "' has 4 dimensions (its magic number ends "
                               "in 0x04), but 3 were expected") &&
                          !Contains("trailing"));
  REQUIRE(read_idx(path).dims == std::vector<std::size_t>{3, 2, 2, 1});
}

TEST_CASE("data: read_idx rejects element types other than unsigned byte") {
  TempDir dir;
  const std::string path = dir.file("floats.idx");
  write_plain(path, {0x00, 0x00, 0x0D, 0x01, 0x00, 0x00, 0x00, 0x01, 0, 0, 0, 0});
  REQUIRE_THROWS_WITH(read_idx(path), Contains(path) && Contains("type 0x0d (float)") &&
                                          Contains("only unsigned byte (0x08)"));
}

TEST_CASE("data: read_idx reports a truncated header") {
  TempDir dir;
  const std::string short_magic = dir.file("short-magic");
  write_plain(short_magic, {0x00, 0x00});
  REQUIRE_THROWS_WITH(read_idx(short_magic), Contains(short_magic) &&
                                                 Contains("truncated header") &&
                                                 Contains("holds 2 bytes"));
  const std::string short_dims = dir.file("short-dims.gz");
  write_gz(short_dims, {0x00, 0x00, 0x08, 0x03, 0x00, 0x00, 0xea, 0x60, 0x00, 0x00});
  REQUIRE_THROWS_WITH(read_idx(short_dims), Contains(short_dims) && Contains("truncated header") &&
                                                Contains("rank 3 needs 12 bytes") &&
                                                Contains("file holds 6"));
}

TEST_CASE("data: read_idx reports truncated data") {
  TempDir dir;
  const Bytes labels = read_decompressed(real_dir + "/train-labels-idx1-ubyte.gz");
  const Bytes half(labels.begin(), labels.begin() + 8 + 30000);

  const std::string plain = dir.file("train-labels-idx1-ubyte");
  write_plain(plain, half);
  REQUIRE_THROWS_WITH(read_idx(plain),
                      Contains(plain) && Contains("truncated") &&
                          Contains("header says 60000 = 60000 bytes, file holds 30000"));

  const std::string gz = dir.file("train-labels-idx1-ubyte.gz");
  write_gz(gz, half);
  REQUIRE_THROWS_WITH(
      read_idx(gz), Contains(gz) && Contains("header says 60000 = 60000 bytes, file holds 30000"));

  const std::string images = dir.file("images");
  write_plain(images, idx_bytes({3, 2, 2}, noise(10, 4)));
  REQUIRE_THROWS_WITH(read_idx(images),
                      Contains(images) && Contains("header says 3x2x2 = 12 bytes, file holds 10"));
}

TEST_CASE("data: read_idx reports a cut-short gzip file") {
  TempDir dir;
  const std::string whole = dir.file("whole.gz");
  write_gz(whole, idx_bytes({4, 32, 32}, noise(4 * 32 * 32, 5)));
  const Bytes gz = read_raw(whole);

  const std::string half = dir.file("half.gz");
  write_plain(half, Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
  REQUIRE_THROWS_WITH(read_idx(half), Contains(half) && Contains("is truncated") &&
                                          Contains("header says 4x32x32 = 4096 bytes") &&
                                          Contains("unexpected end of file"));

  // Only the gzip trailer (CRC and length) is missing: every data byte arrives.
  const std::string no_trailer = dir.file("no-trailer.gz");
  write_plain(no_trailer, Bytes(gz.begin(), gz.end() - 8));
  REQUIRE_THROWS_WITH(read_idx(no_trailer), Contains(no_trailer) && Contains("is truncated") &&
                                                Contains("unexpected end of file"));
}

TEST_CASE("data: read_idx reports a corrupt gzip stream") {
  TempDir dir;
  const std::string source = dir.file("source.gz");
  write_gz(source, idx_bytes({4, 32, 32}, noise(4 * 32 * 32, 6)));
  const Bytes gz = read_raw(source);

  // gzopen("wb") writes a 10-byte gzip header; the next byte opens the first
  // deflate block, and block type 3 is reserved.
  Bytes bad_block = gz;
  bad_block[10] |= 0x06;
  const std::string block = dir.file("bad-block.gz");
  write_plain(block, bad_block);
  REQUIRE_THROWS_WITH(read_idx(block), Contains(block) && Contains("corrupt gzip stream") &&
                                           Contains("invalid block type"));

  Bytes bad_crc = gz;
  bad_crc[gz.size() - 8] ^= 0xff;
  const std::string crc = dir.file("bad-crc.gz");
  write_plain(crc, bad_crc);
  REQUIRE_THROWS_WITH(read_idx(crc), Contains(crc) && Contains("corrupt gzip stream") &&
                                         Contains("incorrect data check"));
}

TEST_CASE("data: read_idx reports trailing garbage") {
  TempDir dir;
  Bytes bytes = idx_bytes({3}, {1, 2, 3});
  bytes.insert(bytes.end(), {0xde, 0xad, 0xbe, 0xef, 0x00});
  const std::string plain = dir.file("labels");
  write_plain(plain, bytes);
  REQUIRE_THROWS_WITH(read_idx(plain),
                      Contains(plain) &&
                          Contains("5 bytes of trailing garbage after the 3 bytes") &&
                          Contains("(3)"));
  const std::string gz = dir.file("labels.gz");
  write_gz(gz, bytes);
  REQUIRE_THROWS_WITH(read_idx(gz), Contains(gz) && Contains("5 bytes of trailing garbage"));
}

TEST_CASE("data: fashion_mnist reports a missing folder") {
  TempDir dir;
  const std::string missing = dir.file("nowhere");
  REQUIRE_THROWS_AS(fashion_mnist(missing), loom::Error);
  REQUIRE_THROWS_WITH(fashion_mnist(missing), Contains(missing + "/train-images-idx3-ubyte.gz") &&
                                                  Contains(missing + "/train-images-idx3-ubyte'") &&
                                                  Contains("not found") &&
                                                  Contains("dataset-fashion-mnist") &&
                                                  Contains("--data DIR"));
}

TEST_CASE("data: fashion_mnist reports image and label counts that differ") {
  TempDir dir;
  write_small_fashion_mnist(dir);
  const std::string labels = dir.file("t10k-labels-idx1-ubyte.gz");
  write_gz(labels, idx_bytes({3}, {1, 7, 2}));
  REQUIRE_THROWS_WITH(fashion_mnist(dir.path()),
                      Contains(dir.file("t10k-images-idx3-ubyte.gz") + "' holds 2 images") &&
                          Contains(labels + "' holds 3 labels"));
}

TEST_CASE("data: fashion_mnist reports a label outside the classes") {
  TempDir dir;
  write_small_fashion_mnist(dir);
  const std::string labels = dir.file("train-labels-idx1-ubyte.gz");
  write_gz(labels, idx_bytes({3}, {4, 12, 9}));
  REQUIRE_THROWS_WITH(fashion_mnist(dir.path()), Contains(labels) &&
                                                     Contains("label 12 at index 1") &&
                                                     Contains("expected 0..9"));
}

TEST_CASE("data: make_image_dataset checks ranks and classes") {
  const IdxArray images{{2, 1, 2}, {0, 1, 2, 3}, "imgs"};
  const IdxArray labels{{2}, {0, 1}, "labs"};
  const IdxArray flat{{4}, {0, 1, 2, 3}, "flat"};
  const IdxArray grid{{2, 1}, {0, 1}, "grid"};
  REQUIRE_THROWS_WITH(make_image_dataset(flat, labels, 10, {}, "x"),
                      Contains("'flat' has rank 1 (4); expected rank 3"));
  REQUIRE_THROWS_WITH(make_image_dataset(images, grid, 10, {}, "x"),
                      Contains("'grid' has rank 2 (2x1); expected rank 1"));
  REQUIRE_THROWS_WITH(make_image_dataset(images, labels, 1, {}, "x"),
                      Contains("'labs' has label 1 at index 1; expected 0..0"));
  const IdxArray short_images{{2, 1, 2}, {0, 1, 2}, "short"};
  REQUIRE_THROWS_WITH(make_image_dataset(short_images, labels, 10, {}, "x"),
                      Contains("'short' has dims 2x1x2 = 4 bytes but holds 3"));
  REQUIRE_THROWS_WITH(make_image_dataset(images, labels, 10, Normalize{0.5f, 0.0f}, "x"),
                      Contains("std must be positive"));
}

TEST_CASE("data: Loader visits every sample exactly once per epoch") {
  for (std::size_t count : {1u, 10u, 37u}) {
    const Dataset set = toy_dataset(count);
    for (std::size_t batch_size : {1u, 3u, 5u, 10u, 64u}) {
      for (bool drop_last : {false, true}) {
        const LoaderOptions options{.batch_size = batch_size, .seed = 11, .drop_last = drop_last};
        INFO("count " << count << ", batch " << batch_size << ", drop_last " << drop_last);
        Loader loader(set, options);
        const std::size_t full = count / batch_size;
        const std::size_t expected_batches =
            drop_last ? full : (count + batch_size - 1) / batch_size;
        REQUIRE(loader.batches_per_epoch() == expected_batches);
        REQUIRE(loader.max_batch() == (expected_batches ? std::min(batch_size, count) : 0));
        for (std::size_t epoch : {0u, 1u}) {
          const std::vector<std::size_t> seen = run_epoch(loader, set, options, epoch);
          REQUIRE(seen.size() == (drop_last ? full * batch_size : count));
          std::vector<std::size_t> sorted = seen;
          std::sort(sorted.begin(), sorted.end());
          REQUIRE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
          if (!drop_last) REQUIRE(sorted == identity(count));
        }
      }
    }
  }
}

TEST_CASE("data: Loader batches hold the dataset rows at the permuted indices") {
  const Dataset& train = real_data().train;
  const LoaderOptions options{.batch_size = 256, .seed = 7};
  Loader loader(train, options);
  const std::vector<std::size_t> seen = run_epoch(loader, train, options, 1);
  REQUIRE(seen == epoch_order(train.count, options, 1));
  REQUIRE(seen != identity(train.count));

  // Toy rows name their own index, so this check does not lean on epoch_order.
  const Dataset toy = toy_dataset(23, 4);
  const LoaderOptions toy_options{.batch_size = 4, .seed = 3};
  Loader toy_loader(toy, toy_options);
  toy_loader.start_epoch(2);
  std::vector<std::size_t> from_rows;
  Batch batch;
  while (toy_loader.next(batch))
    for (std::size_t j = 0; j < batch.size; ++j) {
      const auto index = static_cast<std::size_t>(batch.images[j * toy.sample_size()]) / 1000;
      REQUIRE(batch.labels[j] == static_cast<std::int32_t>(index % 4));
      for (std::size_t k = 0; k < toy.sample_size(); ++k)
        REQUIRE(batch.images[j * toy.sample_size() + k] == static_cast<float>(1000 * index + k));
      from_rows.push_back(index);
    }
  REQUIRE(from_rows == epoch_order(23, toy_options, 2));
}

TEST_CASE("data: Loader order depends only on seed and epoch") {
  const Dataset set = toy_dataset(100);
  const LoaderOptions options{.batch_size = 7, .seed = 42};
  Loader a(set, options);
  Loader b(set, options);
  const std::vector<std::size_t> a3 = run_epoch(a, set, options, 3);
  run_epoch(b, set, options, 5);
  REQUIRE(run_epoch(b, set, options, 3) == a3);
  REQUIRE(run_epoch(a, set, options, 3) == a3);
  REQUIRE(run_epoch(a, set, options, 4) != a3);
  REQUIRE(a3 != identity(100));

  LoaderOptions other_seed = options;
  other_seed.seed = 43;
  Loader c(set, other_seed);
  REQUIRE(run_epoch(c, set, other_seed, 3) != a3);
}

TEST_CASE("data: Loader without shuffle keeps the dataset order") {
  const Dataset set = toy_dataset(29);
  const LoaderOptions options{.batch_size = 8, .shuffle = false, .seed = 9};
  Loader loader(set, options);
  REQUIRE(run_epoch(loader, set, options, 0) == identity(29));
  REQUIRE(run_epoch(loader, set, options, 6) == identity(29));
}

TEST_CASE("data: Loader restarts mid-epoch") {
  const Dataset set = toy_dataset(50);
  const LoaderOptions options{.batch_size = 6, .seed = 5};
  Loader loader(set, options);
  loader.start_epoch(0);
  Batch batch;
  REQUIRE(loader.next(batch));
  REQUIRE(loader.next(batch));
  REQUIRE(batch.first == 6);
  const std::vector<std::size_t> epoch1 = run_epoch(loader, set, options, 1);
  REQUIRE(epoch1 == epoch_order(50, options, 1));

  // Restarting before taking any batch, and restarting the same epoch.
  loader.start_epoch(2);
  REQUIRE(run_epoch(loader, set, options, 2) == epoch_order(50, options, 2));
}

TEST_CASE("data: destroying a Loader mid-epoch returns") {
  const Dataset set = toy_dataset(40);
  const LoaderOptions options{.batch_size = 3, .seed = 1};
  std::size_t destroyed = 0;
  for (int round = 0; round < 50; ++round) {
    {
      Loader loader(set, options);
      loader.start_epoch(static_cast<std::size_t>(round));
      Batch batch;
      for (int i = 0; i < round % 4; ++i) REQUIRE(loader.next(batch));
    }
    ++destroyed;
  }
  { Loader never_started(set, options); }
  ++destroyed;
  REQUIRE(destroyed == 51);
}

TEST_CASE("data: Loader carries an exception from the prefetch thread to next()") {
  Dataset set = toy_dataset(12);
  set.labels[5] = 10;
  const LoaderOptions options{.batch_size = 4, .shuffle = false};
  Loader loader(set, options);
  loader.start_epoch(0);
  Batch batch;
  REQUIRE(loader.next(batch));
  REQUIRE(batch.first == 0);
  REQUIRE_THROWS_AS(loader.next(batch), loom::Error);
  REQUIRE_FALSE(loader.next(batch));

  loader.start_epoch(0);
  REQUIRE(loader.next(batch));
  REQUIRE_THROWS_WITH(loader.next(batch), Contains("dataset 'toy' has label 10 at sample 5") &&
                                              Contains("expected 0..9"));

  set.labels[5] = 5;
  REQUIRE(run_epoch(loader, set, options, 0) == identity(12));
}

TEST_CASE("data: Loader rejects bad options and misuse") {
  const Dataset set = toy_dataset(5);
  REQUIRE_THROWS_WITH(Loader(set, LoaderOptions{.batch_size = 0}), Contains("batch_size is 0"));

  Loader loader(set, {});
  Batch batch;
  REQUIRE_THROWS_WITH(loader.next(batch), Contains("before start_epoch()"));

  Dataset broken = toy_dataset(5);
  broken.labels.pop_back();
  REQUIRE_THROWS_WITH(Loader(broken, {}),
                      Contains("dataset 'toy' declares 5 samples of 6 values") &&
                          Contains("30 image values and 4 labels"));
}

TEST_CASE("data: Loader with drop_last over fewer samples than a batch yields none") {
  const Dataset set = toy_dataset(5);
  Loader loader(set, LoaderOptions{.batch_size = 8, .drop_last = true});
  REQUIRE(loader.batches_per_epoch() == 0);
  REQUIRE(loader.max_batch() == 0);
  loader.start_epoch(0);
  Batch batch;
  REQUIRE_FALSE(loader.next(batch));
}

namespace {

// n CIFAR-10 records: record r has label r % 10 and pixel i = (r + i) % 256.
Bytes cifar_records(std::size_t n) {
  Bytes bytes;
  for (std::size_t r = 0; r < n; ++r) {
    bytes.push_back(static_cast<std::uint8_t>(r % 10));
    for (std::size_t i = 0; i < loom::data::cifar_pixels; ++i)
      bytes.push_back(static_cast<std::uint8_t>((r + i) % 256));
  }
  return bytes;
}

}  // namespace

TEST_CASE("data: the CIFAR-10 reader lays records out as NCHW, normalised per channel") {
  TempDir dir;
  for (int k = 1; k <= 5; ++k)
    write_plain(dir.file("data_batch_" + std::to_string(k) + ".bin"), cifar_records(k));
  write_plain(dir.file("test_batch.bin"), cifar_records(3));
  const auto split = loom::data::cifar10(dir.path());
  REQUIRE(split.train.count == 1 + 2 + 3 + 4 + 5);
  REQUIRE(split.test.count == 3);
  REQUIRE(split.train.sample_size() == 3 * 32 * 32);
  REQUIRE(split.train.images.size() == 15 * 3072);
  REQUIRE(split.train.name == "cifar10-train");
  // The second file's second record (record 1 of its own file): label 1.
  REQUIRE(split.train.labels[2] == 1);
  const loom::data::CifarNormalize norm;
  for (std::size_t i : {0u, 1023u, 1024u, 2047u, 2048u, 3071u}) {
    const std::size_t c = i / 1024;
    const double pixel = static_cast<double>((1 + i) % 256);
    REQUIRE(std::abs(split.train.images[2 * 3072 + i] -
                     (pixel / 255.0 - norm.mean[c]) / norm.std[c]) < 1e-6);
  }
}

TEST_CASE("data: the CIFAR-10 reader reports missing, empty, cut-short and mislabelled files") {
  TempDir dir;
  using Catch::Contains;
  REQUIRE_THROWS_WITH(loom::data::cifar10(dir.path()),
                      Contains("CIFAR-10 file '" + dir.file("data_batch_1.bin") +
                               "' not found; extract the binary version") &&
                          Contains("cifar-10-batches-bin"));
  write_plain(dir.file("empty.bin"), {});
  REQUIRE_THROWS_WITH(loom::data::read_cifar10({dir.file("empty.bin")}, "x"),
                      Contains("CIFAR-10 file '" + dir.file("empty.bin") +
                               "' is empty; expected records of 3073 bytes"));
  Bytes cut = cifar_records(3);
  cut.resize(cut.size() - 100);
  write_plain(dir.file("cut.bin"), cut);
  REQUIRE_THROWS_WITH(loom::data::read_cifar10({dir.file("cut.bin")}, "x"),
                      Contains("holds 9119 bytes, not a whole number of 3073-byte records: record "
                               "2 is cut short after 2973 bytes"));
  Bytes bad = cifar_records(4);
  bad[3 * 3073] = 57;
  write_plain(dir.file("bad.bin"), bad);
  REQUIRE_THROWS_WITH(loom::data::read_cifar10({dir.file("bad.bin")}, "x"),
                      Contains("has label 57 in record 3; expected 0..9"));
  REQUIRE_THROWS_WITH(
      loom::data::read_cifar10({dir.file("bad.bin")}, "x", {.std = {0.2f, 0.0f, 0.2f}}),
      Contains("CifarNormalize channel 1") && Contains("std must be positive"));
}

TEST_CASE("data: SpecAugment masks each sample's valid frames as its seeded draw says") {
  // 6 sequences of up to 50 frames of 8 features, 10..50 of them valid.
  Dataset set;
  set.name = "features";
  set.count = 6;
  set.height = 50;
  set.width = 8;
  set.labels = {0, 1, 2, 3, 4, 5};
  set.frames = {10, 50, 23, 37, 12, 44};
  set.images.assign(6 * 400, 0.0f);
  for (std::size_t i = 0; i < 6; ++i)
    for (std::size_t k = 0; k < static_cast<std::size_t>(set.frames[i]) * 8; ++k)
      set.images[i * 400 + k] = static_cast<float>(1 + i * 400 + k);
  const SpecAugmentOptions spec{.frequency_masks = 1, .max_frequency_width = 3,
                                .time_masks = 2, .max_time_width = 5, .fill = -7.0f};
  const LoaderOptions options{.batch_size = 4, .seed = 11, .augment = {.spec = spec}};
  Loader loader(set, options);
  const auto order = epoch_order(set.count, options, 1);
  loader.start_epoch(1);
  Batch batch;
  std::size_t masked = 0;
  while (loader.next(batch)) {
    for (std::size_t j = 0; j < batch.size; ++j) {
      const std::size_t index = order[batch.first + j];
      const auto valid = static_cast<std::size_t>(set.frames[index]);
      std::vector<float> expected(set.images.begin() + static_cast<std::ptrdiff_t>(index * 400),
                                  set.images.begin() + static_cast<std::ptrdiff_t>(index * 400 + 400));
      spec_augment(std::span<float>(expected.data(), valid * 8), valid, 8, spec, 11, 1, index);
      const float* got = batch.images + j * 400;
      REQUIRE(std::equal(got, got + 400, expected.begin()));
      // The padding stays zero: no mask reaches past the sample's frames.
      REQUIRE(std::all_of(got + valid * 8, got + 400, [](float v) { return v == 0.0f; }));
      masked += static_cast<std::size_t>(std::count(got, got + 400, -7.0f));
    }
  }
  CHECK(masked > 0);
  // The draw is the sample's: another epoch masks elsewhere.
  std::vector<float> a(set.images.begin() + 400, set.images.begin() + 800), b = a;
  spec_augment(std::span<float>(a), 50, 8, spec, 11, 1, 1);
  spec_augment(std::span<float>(b), 50, 8, spec, 11, 2, 1);
  CHECK(a != b);
}

TEST_CASE("data: augmentation crops and flips each sample as its seeded draw says") {
  Dataset set;
  set.name = "ramp";
  set.count = 6;
  set.channels = 2;
  set.height = 3;
  set.width = 4;
  set.labels = {0, 1, 2, 3, 4, 5};
  for (std::size_t i = 0; i < 6 * 24; ++i) set.images.push_back(static_cast<float>(i + 1));
  const LoaderOptions options{.batch_size = 4, .shuffle = true, .seed = 5,
                              .augment = {.crop_padding = 1, .horizontal_flip = true}};
  Loader loader(set, options);
  const auto order = epoch_order(set.count, options, 2);
  loader.start_epoch(2);
  Batch batch;
  std::vector<float> scratch;
  while (loader.next(batch)) {
    for (std::size_t j = 0; j < batch.size; ++j) {
      const std::size_t index = order[batch.first + j];
      const float* got = batch.images + j * 24;
      std::vector<float> expected(set.images.begin() + static_cast<std::ptrdiff_t>(index * 24),
                                  set.images.begin() + static_cast<std::ptrdiff_t>(index * 24 + 24));
      loom::data::augment_image(expected.data(), 2, 3, 4, options.augment, 5, 2, index, scratch);
      REQUIRE(std::equal(got, got + 24, expected.begin()));
    }
  }

  // Flips alone: each image comes back unchanged or mirrored, about half each.
  std::vector<float> image{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const std::vector<float> mirrored{4, 3, 2, 1, 8, 7, 6, 5, 12, 11, 10, 9};
  std::size_t mirrors = 0;
  for (std::size_t index = 0; index < 1000; ++index) {
    auto copy = image;
    loom::data::augment_image(copy.data(), 1, 3, 4, {.horizontal_flip = true}, 9, 0, index,
                              scratch);
    REQUIRE((copy == image || copy == mirrored));
    mirrors += copy == mirrored;
  }
  CHECK(mirrors > 430);
  CHECK(mirrors < 570);

  // A crop with padding 1 shifted by (dy, dx) = (1, -1), no flip, by hand.
  std::vector<float> expected{0, 5, 6, 7, 0, 9, 10, 11, 0, 0, 0, 0};
  // Some draw among the first 200 makes it (9 shifts are equally likely).
  bool found = false;
  for (std::size_t index = 0; index < 200 && !found; ++index) {
    auto copy = image;
    loom::data::augment_image(copy.data(), 1, 3, 4, {.crop_padding = 1}, 9, 0, index, scratch);
    found = copy == expected;
  }
  CHECK(found);
}

namespace {

// `count` sequences of 1..400 frames with a long tail (Pareto, shape 1.5,
// from 20 frames: half are under 32, one in twenty over 150); each row of
// sample i holds i, so a batch row names its sample.
Dataset skewed_sequences(std::size_t count) {
  std::vector<float> images;
  std::vector<std::int32_t> frames;
  for (std::size_t i = 0; i < count; ++i) {
    const double u = loom::uniform01(17, 1, i);
    frames.push_back(
        static_cast<std::int32_t>(std::min(400.0, 20.0 * std::pow(1.0 - u, -1.0 / 1.5))));
    images.insert(images.end(), 400, static_cast<float>(i));
  }
  return Dataset{.name = "skewed",
                 .count = count,
                 .channels = 1,
                 .height = 400,
                 .width = 1,
                 .classes = 2,
                 .images = std::move(images),
                 .labels = {},
                 .max_target = 1,
                 .targets = std::vector<std::int32_t>(count, 1),
                 .target_lengths = std::vector<std::int32_t>(count, 1),
                 .frames = std::move(frames)};
}

// An epoch's batches as sample indices, from the Loader, each row checked
// against its sample (frames and target too).
std::vector<std::vector<std::size_t>> loaded_batches(Loader& loader, const Dataset& set,
                                                     std::size_t epoch, std::size_t first = 0) {
  loader.start_epoch(epoch, first);
  std::vector<std::vector<std::size_t>> batches;
  Batch batch;
  while (loader.next(batch)) {
    std::vector<std::size_t>& samples = batches.emplace_back();
    for (std::size_t j = 0; j < batch.size; ++j) {
      const auto index = static_cast<std::size_t>(batch.images[j * set.sample_size()]);
      REQUIRE(batch.targets.frames[j] == set.frames[index]);
      REQUIRE(batch.targets.sequence_lengths[j] == 1);
      samples.push_back(index);
    }
  }
  return batches;
}

std::vector<std::vector<std::size_t>> cut(const std::vector<std::size_t>& order, std::size_t size) {
  std::vector<std::vector<std::size_t>> batches;
  for (std::size_t first = 0; first < order.size(); first += size)
    batches.emplace_back(
        order.begin() + static_cast<std::ptrdiff_t>(first),
        order.begin() + static_cast<std::ptrdiff_t>(std::min(first + size, order.size())));
  return batches;
}

// Frames past each sample's own, over the frames of the batches padded to
// their longest sample.
double padding_fraction(const std::vector<std::vector<std::size_t>>& batches, const Dataset& set) {
  double frames = 0.0, padded = 0.0;
  for (const auto& batch : batches) {
    std::int32_t longest = 0;
    for (const std::size_t i : batch) {
      frames += set.frames[i];
      longest = std::max(longest, set.frames[i]);
    }
    padded += static_cast<double>(longest) * static_cast<double>(batch.size());
  }
  return 1.0 - frames / padded;
}

// Over the batches: the largest replica's frames over the smallest's, when
// each batch is split as loom::batch_share splits a global batch.
struct ShareBalance {
  double worst = 1.0, mean = 0.0;
};
ShareBalance share_balance(const std::vector<std::vector<std::size_t>>& batches, const Dataset& set,
                           std::size_t replicas) {
  ShareBalance balance;
  for (const auto& batch : batches) {
    double most = 0.0, least = 1e300;
    for (std::size_t r = 0; r < replicas; ++r) {
      const loom::BatchShare share = loom::batch_share(batch.size(), replicas, r);
      REQUIRE(share.count >= 1);  // every replica takes every step
      double frames = 0.0;
      for (std::size_t j = share.first; j < share.first + share.count; ++j)
        frames += set.frames[batch[j]];
      most = std::max(most, frames);
      least = std::min(least, frames);
    }
    balance.worst = std::max(balance.worst, most / least);
    balance.mean += most / least / static_cast<double>(batches.size());
  }
  return balance;
}

}  // namespace

TEST_CASE("data: bucketed batches are a function of (seed, epoch), each sample once, resumable") {
  const Dataset set = skewed_sequences(250);  // 10 batches of 24, then 10
  const LoaderOptions options{.batch_size = 24, .seed = 4, .bucket = 3};
  const auto order = epoch_order(set, options, 2);
  REQUIRE(order == epoch_order(set, options, 2));
  REQUIRE(order != epoch_order(set, options, 3));
  REQUIRE(order != epoch_order(set, LoaderOptions{.batch_size = 24, .seed = 5, .bucket = 3}, 2));
  // bucket 0 is the plain shuffle.
  REQUIRE(epoch_order(set, LoaderOptions{.batch_size = 24, .seed = 4}, 2) ==
          epoch_order(set.count, options, 2));
  std::vector<std::size_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == identity(set.count));

  // Each batch's samples come from one bucket of the shuffled order (3
  // batches' worth; the last, 216..249, holds the short batch, last), and
  // the full batches' order is shuffled: not bucket by bucket.
  const auto shuffled = epoch_order(set.count, options, 2);
  std::vector<std::size_t> bucket_of(set.count);
  for (std::size_t p = 0; p < set.count; ++p) bucket_of[shuffled[p]] = p / 72;
  const auto batches = cut(order, 24);
  REQUIRE(batches.size() == 11);
  std::vector<std::size_t> buckets;
  for (std::size_t b = 0; b < batches.size(); ++b) {
    INFO("batch " << b);
    REQUIRE(batches[b].size() == (b < 10 ? 24u : 10u));
    for (const std::size_t i : batches[b]) REQUIRE(bucket_of[i] == bucket_of[batches[b][0]]);
    buckets.push_back(bucket_of[batches[b][0]]);
  }
  REQUIRE(buckets.back() == 3);
  REQUIRE_FALSE(std::is_sorted(buckets.begin(), buckets.end()));
  // Within a bucket, a batch holds a run of its samples sorted by length:
  // batches of one bucket overlap at most at equal lengths (the short
  // batch holds the last bucket's longest).
  for (std::size_t a = 0; a < 11; ++a)
    for (std::size_t b = 0; b < 11; ++b) {
      if (a == b || buckets[a] != buckets[b]) continue;
      const auto length = [&](std::size_t i) { return set.frames[i]; };
      std::int32_t a_max = 0, b_min = 1 << 30;
      for (const std::size_t i : batches[a]) a_max = std::max(a_max, length(i));
      for (const std::size_t i : batches[b]) b_min = std::min(b_min, length(i));
      std::int32_t a_min = 1 << 30, b_max = 0;
      for (const std::size_t i : batches[a]) a_min = std::min(a_min, length(i));
      for (const std::size_t i : batches[b]) b_max = std::max(b_max, length(i));
      REQUIRE((a_max <= b_min || b_max <= a_min));
    }

  // The Loader draws that order; a resumed epoch the same batches from its
  // first one on; another Loader the same.
  Loader loader(set, options);
  const auto loaded = loaded_batches(loader, set, 2);
  REQUIRE(loaded == batches);
  const auto resumed = loaded_batches(loader, set, 2, 7);
  REQUIRE(resumed == std::vector(batches.begin() + 7, batches.end()));
  Loader other(set, options);
  loaded_batches(other, set, 5);
  REQUIRE(loaded_batches(other, set, 2) == batches);

  // drop_last leaves out the short batch: the shuffled order's last 10
  // samples, random, not the longest.
  LoaderOptions drop = options;
  drop.drop_last = true;
  const auto with_drop = epoch_order(set, drop, 2);
  REQUIRE(std::is_permutation(with_drop.begin() + 240, with_drop.end(), shuffled.begin() + 240));
  Loader dropping(set, drop);
  const auto kept = loaded_batches(dropping, set, 2);
  const auto with_drop_batches = cut(with_drop, 24);
  REQUIRE(kept == std::vector(with_drop_batches.begin(), with_drop_batches.begin() + 10));
  // Without shuffle: buckets in order, the same every epoch.
  LoaderOptions fixed = options;
  fixed.shuffle = false;
  REQUIRE(epoch_order(set, fixed, 0) == epoch_order(set, fixed, 1));
  const auto in_order = cut(epoch_order(set, fixed, 0), 24);
  REQUIRE(*std::max_element(in_order[0].begin(), in_order[0].end(), [&](auto a, auto b) {
    return set.frames[a] < set.frames[b];
  }) <= 71);  // the first bucket's samples are 0..71

  // Bucketing needs the samples' lengths.
  Dataset no_frames = set;
  no_frames.frames.clear();
  REQUIRE_THROWS_WITH(Loader(no_frames, options),
                      Contains("LoaderOptions::bucket is 3 but dataset 'skewed' has no sample "
                               "lengths (Dataset::frames)"));
}

TEST_CASE(
    "data: bucketed batches pad less and split into balanced shares for 2, 3 and 4 replicas") {
  // 100 batches of 24, then one of 12: each divisible by 2, 3 and 4, so
  // every replica's share holds as many samples and only their lengths differ.
  const Dataset set = skewed_sequences(2412);
  const LoaderOptions plain{.batch_size = 24, .seed = 8};
  LoaderOptions bucketed = plain;
  bucketed.bucket = 10;
  double unbucketed_padding = 0.0, bucketed_padding = 0.0;
  for (std::size_t epoch = 0; epoch < 3; ++epoch) {
    const auto batches = cut(epoch_order(set, bucketed, epoch), 24);
    unbucketed_padding += padding_fraction(cut(epoch_order(set, plain, epoch), 24), set) / 3;
    bucketed_padding += padding_fraction(batches, set) / 3;
    // The same batches sorted by length, as a bucket cuts them: the
    // contiguous split gives the first replica the shortest samples.
    auto sorted = batches;
    for (auto& batch : sorted)
      std::stable_sort(batch.begin(), batch.end(),
                       [&](std::size_t a, std::size_t b) { return set.frames[a] < set.frames[b]; });
    for (const std::size_t replicas : {2u, 3u, 4u}) {
      INFO("epoch " << epoch << ", " << replicas << " replicas");
      // Measured over the 3 epochs: the largest share over the smallest at
      // worst 1.14, 1.30 and 1.42 for 2, 3 and 4 replicas, 1.035 at most
      // on average; sorted by length, 2.7 to 4.4 at worst, 1.21 to 1.37 on
      // average.
      const ShareBalance balanced = share_balance(batches, set, replicas);
      const ShareBalance by_length = share_balance(sorted, set, replicas);
      CHECK(balanced.worst < 1.6);
      CHECK(balanced.mean < 1.05);
      CHECK(by_length.mean > 1.15);
    }
  }
  // Measured: 0.80 of the padded frames are padding without buckets, 0.31
  // with buckets of 10 batches (of the epoch's 100), 0.07 with 50.
  CHECK(unbucketed_padding > 0.75);
  CHECK(bucketed_padding < 0.35);
  LoaderOptions wide = plain;
  wide.bucket = 50;
  CHECK(padding_fraction(cut(epoch_order(set, wide, 0), 24), set) < 0.1);
}

TEST_CASE("text: the fortunes corpus reads whole, in file-name order, without its indexes") {
  const auto corpus = read_fortunes();
  // Debian's fortunes: about 2.4 MB of text in some 40 files.
  REQUIRE(corpus.text.size() > 2'000'000);
  REQUIRE(corpus.files.size() >= 40);
  REQUIRE(std::is_sorted(corpus.files.begin(), corpus.files.end()));
  for (const auto& file : corpus.files) {
    REQUIRE_FALSE(file.ends_with(".dat"));
    REQUIRE_FALSE(file.ends_with(".u8"));
  }
  REQUIRE(corpus.text.find("\n%\n") != std::string::npos);
  REQUIRE_THROWS_WITH(read_fortunes("/no/such/folder"),
                      Catch::Contains("no fortune files in '/no/such/folder'") &&
                          Catch::Contains("apt-get install fortunes"));
}

TEST_CASE("text: a window's targets are its bytes shifted by one, the windows fixed by the seed") {
  const std::string text = "the quick brown fox jumps over the lazy dog";
  const auto set = text_windows(text, 8, 50, 3, "fox");
  REQUIRE(set.count == 50);
  REQUIRE(set.sample_size() == 8);
  REQUIRE(set.target_kind() == loom::TargetKind::class_per_position);
  REQUIRE(set.max_target == 8);
  bool starts_differ = false;
  for (std::size_t s = 0; s < set.count; ++s) {
    // The window is text[start, start + 9): find it by its first 8 bytes.
    std::string window;
    for (std::size_t p = 0; p < 8; ++p) window += static_cast<char>(set.images[s * 8 + p]);
    window += static_cast<char>(set.targets[s * 8 + 7]);
    REQUIRE(text.find(window) != std::string::npos);
    for (std::size_t p = 0; p + 1 < 8; ++p)
      REQUIRE(set.targets[s * 8 + p] == static_cast<std::int32_t>(set.images[s * 8 + p + 1]));
    starts_differ = starts_differ || set.images[s * 8] != set.images[0];
  }
  REQUIRE(starts_differ);
  const auto again = text_windows(text, 8, 50, 3, "fox");
  REQUIRE(again.images == set.images);
  REQUIRE(again.targets == set.targets);
  REQUIRE(text_windows(text, 8, 50, 4, "fox").images != set.images);
  // Bytes above 127 (UTF-8) are ids 128..255, not negative.
  const auto utf8 = text_windows("caf\xc3\xa9 au lait", 4, 20, 1, "utf-8");
  for (const float id : utf8.images) REQUIRE((id >= 0.0f && id < 256.0f));
}

TEST_CASE("text: a text shorter than one window is refused, naming both lengths") {
  REQUIRE_THROWS_WITH(text_windows("short", 8, 4, 1, "tiny corpus"),
                      Catch::Contains("the text 'tiny corpus' holds 5 bytes, fewer than one "
                                      "window of context + 1 = 9"));
  TextCorpus corpus{.name = "small", .text = std::string(100, 'a'), .files = {}};
  REQUIRE_THROWS_WITH(text_split(corpus, 64, 1),
                      Catch::Contains("the text 'small (validation text)' holds 10 bytes"));
  const auto split = text_split(corpus, 8, 1, 0, 0.2, 7);
  REQUIRE(split.train.count == 10);  // 80 bytes of training text, contexts of 8
  REQUIRE(split.test.count == 7);
  REQUIRE(text_split(corpus, 8, 1, 33, 0.2, 7).train.count == 33);
}
