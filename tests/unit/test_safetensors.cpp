// The safetensors reader and writer: round trips, the exact bytes of a small
// file, every way a file can be broken (each one a loom::Error naming the file),
// and the writer's all-or-nothing replacement of the target file.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <loom/io/safetensors.hpp>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "loom_test.hpp"
#include "temp_dir.hpp"

namespace {

namespace fs = std::filesystem;
using Catch::Contains;
using loom::io::SafetensorsFile;
using loom::io::SafetensorsWriter;

using loom::test::TempDir;

std::span<const std::byte> bytes_of(const std::string& bytes) {
  return std::as_bytes(std::span<const char>(bytes));
}

// The 8-byte little-endian length, the header as given, then `data_bytes` bytes.
std::string file_bytes(const std::string& header, std::size_t data_bytes) {
  std::string bytes;
  for (int i = 0; i < 8; ++i)
    bytes += static_cast<char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  return bytes + header + std::string(data_bytes, '\x5a');
}

std::string read_raw(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

SafetensorsWriter one_tensor_writer(float value) {
  SafetensorsWriter writer;
  const std::vector<float> values{value, value + 1};
  writer.add("w", values, {2});
  return writer;
}

float first_value(const std::string& path) {
  std::vector<float> out(2);
  SafetensorsFile::read(path).read("w", out, {2});
  return out[0];
}

}  // namespace

TEST_CASE("safetensors: tensors and metadata survive a round trip in the order added") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const auto weight = loom::test::random_vector<float>(12, 1);
  const auto bias = loom::test::random_vector<float>(4, 2);
  const std::vector<float> scalar{-7.5f};

  SafetensorsWriter writer;
  writer.add("conv.weight", weight, {4, 3});
  writer.add("empty", {}, {0, 5});
  writer.add("scalar", scalar, {});
  writer.add("a.bias", bias, {4});
  writer.set_metadata("format", "pt");
  writer.set_metadata("epoch", "3");
  writer.set_metadata("epoch", "4");
  writer.write(path);

  const SafetensorsFile file = SafetensorsFile::read(path);
  const auto& tensors = file.tensors();
  REQUIRE(tensors.size() == 4);
  REQUIRE(tensors[0].name == "conv.weight");
  REQUIRE(tensors[1].name == "empty");
  REQUIRE(tensors[2].name == "scalar");
  REQUIRE(tensors[3].name == "a.bias");
  REQUIRE(tensors[0].shape == std::vector<std::size_t>{4, 3});
  REQUIRE(tensors[1].shape == std::vector<std::size_t>{0, 5});
  REQUIRE(tensors[2].shape.empty());
  REQUIRE(tensors[3].dtype == "F32");
  REQUIRE(tensors[0].begin == 0);
  REQUIRE(tensors[0].end == 48);
  REQUIRE(tensors[1].begin == 48);
  REQUIRE(tensors[1].end == 48);
  REQUIRE(tensors[2].end == 52);
  REQUIRE(tensors[3].end == 68);
  REQUIRE(&file.info("scalar") == &tensors[2]);
  REQUIRE(file.contains("a.bias"));
  REQUIRE_FALSE(file.contains("a.weight"));

  REQUIRE(file.metadata() == std::map<std::string, std::string>{{"epoch", "4"}, {"format", "pt"}});
  REQUIRE(file.metadata("epoch") == "4");

  std::vector<float> got(12);
  file.read("conv.weight", got, {4, 3});
  REQUIRE(std::memcmp(got.data(), weight.data(), sizeof(float) * 12) == 0);
  got.assign(4, 0.0f);
  file.read("a.bias", got, {4});
  REQUIRE(std::memcmp(got.data(), bias.data(), sizeof(float) * 4) == 0);
  got.assign(1, 0.0f);
  file.read("scalar", got, {});
  REQUIRE(got[0] == -7.5f);
  file.read("empty", std::span<float>(), {0, 5});

  REQUIRE(dir.entries() == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("safetensors: a small file has exactly the bytes the format prescribes") {
  TempDir dir;
  SECTION("with metadata: 79 bytes of JSON padded to 80") {
    SafetensorsWriter writer;
    const std::vector<float> values{1.0f, -2.0f};
    writer.add("a", values, {2});
    writer.set_metadata("k", "v");
    writer.write(dir.file("a.safetensors"));
    const std::string expected =
        std::string("\x50\0\0\0\0\0\0\0", 8) +
        R"({"__metadata__":{"k":"v"},"a":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}} )" +
        std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);
    REQUIRE(read_raw(dir.file("a.safetensors")) == expected);
  }
  SECTION("without metadata: no __metadata__ key, 54 bytes of JSON padded to 56") {
    SafetensorsWriter writer;
    const std::vector<float> values{1.0f, -2.0f};
    writer.add("a", values, {2});
    writer.write(dir.file("a.safetensors"));
    const std::string expected = std::string("\x38\0\0\0\0\0\0\0", 8) +
                                 R"({"a":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}}  )" +
                                 std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0", 8);
    REQUIRE(read_raw(dir.file("a.safetensors")) == expected);
  }
  SECTION("no tensors: {} padded to 8") {
    SafetensorsWriter().write(dir.file("a.safetensors"));
    const std::string bytes = read_raw(dir.file("a.safetensors"));
    REQUIRE(bytes == std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
    REQUIRE(SafetensorsFile::parse(bytes_of(bytes), "empty").tensors().empty());
  }
}

TEST_CASE("safetensors: a file written elsewhere reads, whatever its key order and padding") {
  // As the Rust writer lays it out: metadata first, then tensors by dtype
  // alignment, the F16 tensor's bytes after the F32 one's.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"z":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F16","shape":[3],"data_offsets":[8,14],"extra":{"x":[1]}}}   )";
  std::string bytes = file_bytes(header, 0);
  const float values[2] = {0.5f, 3.0f};
  bytes.append(reinterpret_cast<const char*>(values), sizeof values);
  bytes.append(6, '\0');
  const SafetensorsFile file = SafetensorsFile::parse(bytes_of(bytes), "rust.safetensors");
  REQUIRE(file.tensors().size() == 2);
  REQUIRE(file.tensors()[0].name == "z");
  REQUIRE(file.info("b").dtype == "F16");
  REQUIRE(file.info("b").begin == 8);
  REQUIRE(file.metadata("format") == "pt");
  std::vector<float> out(2);
  file.read("z", out, {1, 2});
  REQUIRE(out == std::vector<float>{0.5f, 3.0f});
}

TEST_CASE("safetensors: each kind of corrupt header is an error naming the file and the fault") {
  struct Case {
    std::string header;
    std::size_t data_bytes;
    std::string phrase;
  };
  const auto entry = [](const std::string& fields) { return R"({"t":{)" + fields + "}}"; };
  const std::vector<Case> cases{
      {R"({"t":)", 0, "not valid JSON"},
      {"", 0, "not valid JSON"},
      {"{\"\xff\":1}", 0, "not valid JSON"},
      {R"({"t":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})", 4, "not valid JSON"},
      {std::string(100, '[') + std::string(100, ']'), 0, "nested deeper than 64 levels"},
      {"[1,2]", 0, "header that is a JSON array, not an object"},
      {R"("abc")", 0, "header that is a JSON string, not an object"},
      {R"({"t":3})", 0, "tensor 't' is a JSON number, not an object"},
      {entry(R"("shape":[1],"data_offsets":[0,4])"), 4, R"(tensor 't' has no "dtype")"},
      {entry(R"("dtype":"F32","data_offsets":[0,4])"), 4, R"(tensor 't' has no "shape")"},
      {entry(R"("dtype":"F32","shape":[1])"), 4, R"(tensor 't' has no "data_offsets")"},
      {entry(R"("dtype":32,"shape":[1],"data_offsets":[0,4])"), 4,
       R"("dtype" is a JSON number, expected a string)"},
      {entry(R"("dtype":"F33","shape":[1],"data_offsets":[0,4])"), 4, R"(unknown dtype "F33")"},
      {entry(R"("dtype":"F32","shape":"1","data_offsets":[0,4])"), 4,
       R"("shape" is a JSON string, expected an array)"},
      {entry(R"("dtype":"F32","shape":[-1],"data_offsets":[0,4])"), 4,
       R"("shape" entry 0 is -1, expected a non-negative integer)"},
      {entry(R"("dtype":"F32","shape":[1,1.5],"data_offsets":[0,4])"), 4,
       R"("shape" entry 1 is 1.5, expected a non-negative integer)"},
      {entry(R"("dtype":"F32","shape":[null],"data_offsets":[0,4])"), 4,
       R"("shape" entry 0 is null)"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[4])"), 4,
       R"("data_offsets" is [4], expected [begin, end])"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[0,4,8])"), 8,
       R"("data_offsets" is [0,4,8])"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[-4,0])"), 4,
       R"("data_offsets" is [-4,0])"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":{"begin":0})"), 4,
       R"("data_offsets" is {"begin":0})"},
      {entry(R"("dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4])"), 4,
       "shape [4294967296,4294967296] whose size in bytes overflows 64 bits"},
      {entry(R"("dtype":"F32","shape":[4611686018427387904,2],"data_offsets":[0,4])"), 4,
       "whose size in bytes overflows 64 bits"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[8,4])"), 8,
       "data_offsets [8, 4] that end before they begin"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,8])"), 4,
       "data_offsets [0, 8] past the end of the data buffer (4 bytes)"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615])"), 4,
       "past the end of the data buffer"},
      {entry(R"("dtype":"F32","shape":[2],"data_offsets":[0,4])"), 4,
       "is F32 of shape [2], which takes 8 bytes, but its data_offsets [0, 4] span 4"},
      {entry(R"("dtype":"BF16","shape":[3],"data_offsets":[0,4])"), 4,
       "is BF16 of shape [3], which takes 6 bytes"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       12, "bytes [4, 8) of the data buffer belong to no tensor (a hole before tensor 'b')"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[4,8])"), 8,
       "bytes [0, 4) of the data buffer belong to no tensor"},
      {entry(R"("dtype":"F32","shape":[1],"data_offsets":[0,4])"), 6,
       "bytes [4, 6) of the data buffer belong to no tensor (after the last one)"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "tensor 'b' (bytes [4, 12)) overlaps tensor 'a' (bytes [0, 8))"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       4, "tensor 'b' (bytes [0, 4)) overlaps tensor 'a'"},
      {R"({"__metadata__":["pt"]})", 0,
       R"("__metadata__" is a JSON array, expected an object of strings)"},
      {R"({"__metadata__":{"epoch":4}})", 0,
       R"("__metadata__" value for key 'epoch' is a JSON number, expected a string)"},
      {R"({"__metadata__":null})", 0, R"("__metadata__" is a JSON null)"},
  };
  for (const Case& c : cases) {
    INFO("header: " << c.header);
    const std::string bytes = file_bytes(c.header, c.data_bytes);
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(bytes_of(bytes), "bad.safetensors"),
                        Contains("safetensors file 'bad.safetensors'") && Contains(c.phrase));
  }
}

TEST_CASE("safetensors: a header length that is short, over the limit or past the end is refused") {
  for (std::size_t n = 0; n < 8; ++n) {
    INFO("file of " << n << " bytes");
    REQUIRE_THROWS_WITH(
        SafetensorsFile::parse(bytes_of(std::string(n, '\0')), "short.st"),
        Contains("safetensors file 'short.st' is too short: " + std::to_string(n) + " bytes"));
  }
  std::string huge = file_bytes("{}", 0);
  huge[7] = '\x80';
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(bytes_of(huge), "huge.st"),
                      Contains("'huge.st' declares a header of 9223372036854775810 bytes, over "
                               "the limit of 100000000"));
  std::string past = file_bytes("{}", 0);
  past[0] = 3;
  REQUIRE_THROWS_WITH(SafetensorsFile::parse(bytes_of(past), "past.st"),
                      Contains("'past.st' declares a header of 3 bytes but only 2 bytes follow"));
}

TEST_CASE("safetensors: every truncation of a valid file is an error, never a crash") {
  TempDir dir;
  SafetensorsWriter writer;
  const auto values = loom::test::random_vector<float>(6, 3);
  writer.add("x", values, {2, 3});
  writer.add("y", std::span(values).first(2), {2});
  writer.set_metadata("note", "cut me");
  writer.write(dir.file("full.safetensors"));
  const std::string bytes = read_raw(dir.file("full.safetensors"));
  REQUIRE(SafetensorsFile::parse(bytes_of(bytes), "full").tensors().size() == 2);

  for (std::size_t n = 0; n < bytes.size(); ++n) {
    INFO("cut to " << n << " of " << bytes.size() << " bytes");
    REQUIRE_THROWS_WITH(SafetensorsFile::parse(bytes_of(bytes.substr(0, n)), "cut.safetensors"),
                        Contains("safetensors file 'cut.safetensors'"));
  }
  write_raw(dir.file("cut.safetensors"), bytes.substr(0, bytes.size() - 1));
  REQUIRE_THROWS_WITH(SafetensorsFile::read(dir.file("cut.safetensors")),
                      Contains(dir.file("cut.safetensors")) &&
                          Contains("past the end of the data buffer") && Contains("cut short"));
}

TEST_CASE("safetensors: any single corrupted byte gives a loom::Error or a valid file") {
  SafetensorsWriter writer;
  const auto values = loom::test::random_vector<float>(6, 4);
  writer.add("x", values, {2, 3});
  writer.add("y", std::span(values).first(1), {});
  writer.set_metadata("k", "v");
  TempDir dir;
  writer.write(dir.file("f.safetensors"));
  const std::string bytes = read_raw(dir.file("f.safetensors"));
  std::size_t errors = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (const char replacement : {'\0', '\xff', '[', '{', '"', '-', '9', ' ', ','}) {
      std::string corrupt = bytes;
      corrupt[i] = replacement;
      try {
        (void)SafetensorsFile::parse(bytes_of(corrupt), "flip");
      } catch (const loom::Error&) {
        ++errors;
      }
    }
  }
  // Most header bytes matter; data bytes and the padding do not.
  REQUIRE(errors > bytes.size());
}

TEST_CASE("safetensors: read reports a missing file and a folder by path and errno") {
  TempDir dir;
  const std::string missing = dir.file("missing.safetensors");
  REQUIRE_THROWS_WITH(SafetensorsFile::read(missing),
                      Contains("cannot open safetensors file '" + missing + "'") &&
                          Contains("No such file or directory"));
  REQUIRE_THROWS_WITH(SafetensorsFile::read(dir.path()),
                      Contains("cannot read safetensors file '" + dir.path() + "'") &&
                          Contains("Is a directory"));
}

TEST_CASE("safetensors: reading a tensor checks its name, dtype, shape and the output size") {
  const std::string header = R"({"w":{"dtype":"F32","shape":[4,3],"data_offsets":[0,48]},)"
                             R"("h":{"dtype":"F16","shape":[2],"data_offsets":[48,52]}})";
  const std::string bytes = file_bytes(header, 52);
  const SafetensorsFile file = SafetensorsFile::parse(bytes_of(bytes), "net.safetensors");
  std::vector<float> out(12);
  REQUIRE_THROWS_WITH(file.read("w", out, {3, 4}),
                      Contains("safetensors file 'net.safetensors': tensor 'w' has shape [4,3] in "
                               "the file but the caller expects [3,4]"));
  REQUIRE_THROWS_WITH(file.read("w", out, {12, 1, 1, 1}),
                      Contains("has shape [4,3] in the file but the caller expects [12,1,1,1]"));
  std::vector<float> two(2);
  REQUIRE_THROWS_WITH(file.read("h", two, {2}),
                      Contains("'net.safetensors': tensor 'h' is F16 in the file but F32 is "
                               "expected"));
  REQUIRE_THROWS_WITH(file.read("w", two, {4, 3}),
                      Contains("reading tensor 'w' of safetensors file 'net.safetensors': the "
                               "output holds 2 floats but the expected shape [4,3] has 12"));
  REQUIRE_THROWS_WITH(file.read("bias", two, {2}),
                      Contains("'net.safetensors' has no tensor 'bias' (it holds 2 tensors: "
                               "'w', 'h')"));
  REQUIRE_THROWS_WITH(file.info("bias"), Contains("has no tensor 'bias'"));
  REQUIRE_THROWS_WITH(file.metadata("epoch"),
                      Contains("'net.safetensors' has no metadata key 'epoch'"));
  REQUIRE(file.metadata().empty());
}

TEST_CASE("safetensors: add and set_metadata refuse names the format cannot hold") {
  SafetensorsWriter writer;
  const std::vector<float> six(6);
  REQUIRE_THROWS_WITH(writer.add("w", six, {2, 2}),
                      Contains("tensor 'w' has shape [2,2] (4 values) but 6 values were given"));
  REQUIRE_THROWS_WITH(writer.add("w", six, {std::size_t{1} << 32, std::size_t{1} << 32}),
                      Contains("element count overflows 64 bits"));
  REQUIRE_THROWS_WITH(writer.add("", six, {6}), Contains("the tensor name is empty"));
  REQUIRE_THROWS_WITH(writer.add("__metadata__", six, {6}),
                      Contains("'__metadata__' is the key safetensors reserves"));
  REQUIRE_THROWS_WITH(writer.add("bad\xff", six, {6}),
                      Contains("a tensor name is not valid UTF-8"));
  REQUIRE_THROWS_WITH(writer.set_metadata("k", "\xc3"),
                      Contains("metadata value for key 'k' is not valid UTF-8"));
  writer.add("w", six, {2, 3});
  REQUIRE_THROWS_WITH(writer.add("w", six, {6}), Contains("tensor 'w' was already added"));

  TempDir dir;
  writer.write(dir.file("w.safetensors"));
  REQUIRE(SafetensorsFile::read(dir.file("w.safetensors")).tensors().size() == 1);
}

TEST_CASE("safetensors: writing into a missing folder fails naming the path and leaves nothing") {
  TempDir dir;
  const std::string path = dir.file("missing/model.safetensors");
  REQUIRE_THROWS_WITH(one_tensor_writer(1).write(path),
                      Contains("cannot write safetensors file '" + path + "'") &&
                          Contains("No such file or directory") &&
                          Contains("check that the folder exists"));
  REQUIRE(dir.entries().empty());
}

TEST_CASE("safetensors: write replaces an existing file, and a failed write keeps the old one") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  one_tensor_writer(1).write(path);
  one_tensor_writer(5).write(path);
  REQUIRE(first_value(path) == 5);
  REQUIRE(dir.entries() == std::vector<std::string>{"model.safetensors"});

  SECTION("the temporary file cannot be created") {
    const std::string temp = path + ".tmp-" + std::to_string(::getpid());
    fs::create_directory(temp);
    REQUIRE_THROWS_WITH(
        one_tensor_writer(9).write(path),
        Contains("cannot write safetensors file '" + path + "'") &&
            Contains("temporary file '" + temp + "'): creating it failed: Is a directory"));
    REQUIRE(first_value(path) == 5);
    REQUIRE(fs::is_directory(temp));
  }
  SECTION("the rename fails: the target is a folder") {
    const std::string folder = dir.file("folder.safetensors");
    fs::create_directory(folder);
    write_raw(folder + "/keep", "kept");
    REQUIRE_THROWS_WITH(one_tensor_writer(9).write(folder),
                        Contains("cannot write safetensors file '" + folder + "'") &&
                            Contains("renaming it over the target failed: Is a directory"));
    REQUIRE(read_raw(folder + "/keep") == "kept");
    REQUIRE(dir.entries() == std::vector<std::string>{"folder.safetensors", "model.safetensors"});
    REQUIRE(first_value(path) == 5);
  }
}

TEST_CASE("safetensors: a path without a folder writes into the current folder") {
  TempDir dir;
  const fs::path previous = fs::current_path();
  fs::current_path(dir.path());
  try {
    one_tensor_writer(2).write("model.safetensors");
  } catch (...) {
    fs::current_path(previous);
    throw;
  }
  fs::current_path(previous);
  REQUIRE(first_value(dir.file("model.safetensors")) == 2);
  REQUIRE(dir.entries() == std::vector<std::string>{"model.safetensors"});
}
