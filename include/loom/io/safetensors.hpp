// The safetensors file format (huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON naming each tensor's dtype, shape and byte
// range, then the tensor bytes. The reader trusts nothing in a file: every
// field is checked before it is used, and each way a file can be wrong becomes
// a loom::Error that names the file and says what is wrong.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include "../core/file.hpp"
#include <loom/core/error.hpp>
#include <loom/core/linkage.hpp>
#include <loom/io/atomic_file.hpp>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#if LOOM_IMPLEMENT
#include <nlohmann/json.hpp>
#endif
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::io {

static_assert(std::endian::native == std::endian::little,
              "loom's safetensors reader and writer copy tensor bytes as they lie in memory, "
              "and safetensors stores little-endian data; a big-endian host needs byte swaps");
static_assert(sizeof(std::size_t) == sizeof(std::uint64_t),
              "safetensors sizes and offsets are 64-bit; loom needs a 64-bit size_t");

// One tensor of a file; begin and end are byte offsets into the data buffer
// that follows the header, as in the file.
struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;
};

namespace detail {

using Json = nlohmann::json;

// The reference implementation's limit: a larger header is a corrupt length.
inline constexpr std::uint64_t max_header_bytes = 100'000'000;
// A valid header is 3 levels deep (file, tensor, shape); the limit only stops a
// corrupt header of nested brackets from growing memory without bound.
inline constexpr int max_header_depth = 64;
inline constexpr const char* corrupt_hint =
    "the file is damaged or not a safetensors file; write it again";

struct DtypeSize {
  std::string_view name;
  std::size_t bytes;
};
inline constexpr std::array<DtypeSize, 15> dtype_sizes{{{"BOOL", 1},
                                                        {"U8", 1},
                                                        {"I8", 1},
                                                        {"F8_E5M2", 1},
                                                        {"F8_E4M3", 1},
                                                        {"I16", 2},
                                                        {"U16", 2},
                                                        {"F16", 2},
                                                        {"BF16", 2},
                                                        {"I32", 4},
                                                        {"U32", 4},
                                                        {"F32", 4},
                                                        {"I64", 8},
                                                        {"U64", 8},
                                                        {"F64", 8}}};

// 0 for a dtype this reader does not know.
inline std::size_t dtype_bytes(std::string_view dtype) {
  for (const DtypeSize& d : dtype_sizes)
    if (d.name == dtype) return d.bytes;
  return 0;
}

inline std::string shape_text(const std::vector<std::size_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ',';
    text += std::to_string(shape[i]);
  }
  return text + ']';
}

// False when the product does not fit in 64 bits.
inline bool element_count(const std::vector<std::size_t>& shape, std::size_t& count) {
  count = 1;
  for (std::size_t d : shape)
    if (__builtin_mul_overflow(count, d, &count)) return false;
  return true;
}

inline std::string range_text(std::size_t begin, std::size_t end) {
  std::string text = "[";
  text += std::to_string(begin);
  text += ", ";
  text += std::to_string(end);
  return text + ')';
}

}  // namespace detail

// Collects float tensors and string metadata, then writes them as one
// safetensors file that either appears whole or not at all.
class SafetensorsWriter {
 public:
  void add(std::string name, std::span<const float> values, std::vector<std::size_t> shape);
  void set_metadata(std::string key, std::string value);
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    std::string name;
    std::vector<std::size_t> shape;
    std::vector<float> values;
  };
  std::string header_text() const;

  std::vector<Entry> entries_;
  std::set<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

// A whole safetensors file in memory, validated when it is read.
class SafetensorsFile {
 public:
  static SafetensorsFile read(const std::filesystem::path& path);
  static SafetensorsFile parse(std::span<const std::byte> bytes, std::string source_name);

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::string metadata(const std::string& key) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // In the order of their bytes in the file (empty tensors at one offset by
  // name): for a file from SafetensorsWriter, the order they were added.
  // nlohmann's objects sort their keys, so the header's own order is lost.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo& info(const std::string& name) const;
  void read(const std::string& name, std::span<float> out,
            const std::vector<std::size_t>& shape) const;

 private:
  SafetensorsFile(std::vector<std::byte> bytes, std::string source);
  void validate();
  void add_tensor(const std::string& name, const detail::Json& entry);
  void read_metadata(const detail::Json& metadata);
  std::string where() const { return "safetensors file '" + source_ + "'"; }

  std::vector<std::byte> bytes_;
  std::string source_;
  std::size_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
};

#if LOOM_IMPLEMENT
// ---- SafetensorsWriter ------------------------------------------------------

namespace detail {

// nlohmann refuses to write invalid UTF-8, so it is refused here, where the
// caller can still see which string was at fault.
LOOM_DECL void require_utf8(const std::string& text, const std::string& what) {
  try {
    (void)Json(text).dump();
  } catch (const Json::exception&) {
    LOOM_FAIL("SafetensorsWriter: ", what,
              " is not valid UTF-8; safetensors headers are JSON, "
              "so names and metadata must be UTF-8 text");
  }
}

}  // namespace detail

LOOM_DECL void SafetensorsWriter::add(std::string name, std::span<const float> values,
                                      std::vector<std::size_t> shape) {
  LOOM_CHECK(!name.empty(),
             "SafetensorsWriter::add: the tensor name is empty; give each "
             "tensor a unique non-empty name");
  LOOM_CHECK(name != "__metadata__",
             "SafetensorsWriter::add: '__metadata__' is the key "
             "safetensors reserves for metadata; use set_metadata or another tensor name");
  detail::require_utf8(name, "a tensor name");
  LOOM_CHECK(!names_.count(name), "SafetensorsWriter::add: tensor '", name,
             "' was already added; each tensor needs a unique name");
  std::size_t count = 0;
  LOOM_CHECK(detail::element_count(shape, count), "SafetensorsWriter::add: tensor '", name,
             "' has shape ", detail::shape_text(shape), " whose element count overflows 64 bits");
  LOOM_CHECK(count == values.size(), "SafetensorsWriter::add: tensor '", name, "' has shape ",
             detail::shape_text(shape), " (", count, " values) but ", values.size(),
             " values were given; pass the values and the shape of the same tensor");
  names_.insert(name);
  entries_.push_back({std::move(name), std::move(shape), {values.begin(), values.end()}});
}

LOOM_DECL void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  detail::require_utf8(key, "a metadata key");
  detail::require_utf8(value, "the metadata value for key '" + key + "'");
  metadata_.insert_or_assign(std::move(key), std::move(value));
}

LOOM_DECL std::string SafetensorsWriter::header_text() const {
  detail::Json header = detail::Json::object();
  std::size_t offset = 0;
  for (const Entry& e : entries_) {
    const std::size_t end = offset + e.values.size() * sizeof(float);
    header[e.name] = {{"dtype", "F32"}, {"shape", e.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string text = header.dump();
  // The format pads the header with spaces so the tensor bytes start 8-aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

LOOM_DECL void SafetensorsWriter::write(const std::filesystem::path& path) const {
  const std::string header = header_text();
  std::array<unsigned char, 8> length{};
  for (std::size_t i = 0; i < length.size(); ++i)
    length[i] = static_cast<unsigned char>(std::uint64_t{header.size()} >> (8 * i));
  std::size_t bytes = length.size() + header.size();
  for (const Entry& e : entries_) bytes += e.values.size() * sizeof(float);
  write_file_atomically(path, "safetensors file", bytes, [&](std::FILE* file) {
    const auto put = [&](const void* data, std::size_t n) {
      return n == 0 || std::fwrite(data, 1, n, file) == n;
    };
    bool ok = put(length.data(), length.size()) && put(header.data(), header.size());
    for (const Entry& e : entries_)
      ok = ok && put(e.values.data(), e.values.size() * sizeof(float));
    return ok;
  });
}

// ---- SafetensorsFile --------------------------------------------------------

LOOM_DECL SafetensorsFile::SafetensorsFile(std::vector<std::byte> bytes, std::string source)
    : bytes_(std::move(bytes)), source_(std::move(source)) {
  validate();
}

LOOM_DECL SafetensorsFile SafetensorsFile::parse(std::span<const std::byte> bytes,
                                                 std::string source_name) {
  return SafetensorsFile({bytes.begin(), bytes.end()}, std::move(source_name));
}

LOOM_DECL SafetensorsFile SafetensorsFile::read(const std::filesystem::path& path) {
  const File file(std::fopen(path.c_str(), "rb"));
  if (!file)
    LOOM_FAIL("cannot open safetensors file '", path.string(), "': ", std::strerror(errno),
              "; check the path");
  std::error_code size_error;
  const auto size_hint = std::filesystem::file_size(path, size_error);
  std::vector<std::byte> bytes;
  if (!size_error) bytes.reserve(size_hint);
  // Read until end of file rather than trusting the size: the file may change
  // underneath, or not be a regular file.
  std::array<std::byte, 1 << 16> chunk;
  while (const std::size_t got = std::fread(chunk.data(), 1, chunk.size(), file.get()))
    bytes.insert(bytes.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(got));
  if (std::ferror(file.get()))
    LOOM_FAIL("cannot read safetensors file '", path.string(), "': ", std::strerror(errno),
              "; check the path and the disk");
  return SafetensorsFile(std::move(bytes), path.string());
}

LOOM_DECL void SafetensorsFile::validate() {
  LOOM_CHECK(bytes_.size() >= 8, where(), " is too short: ", bytes_.size(),
             " bytes, but the header length alone takes 8; ", detail::corrupt_hint);
  std::uint64_t header_bytes = 0;
  for (std::size_t i = 0; i < 8; ++i)
    header_bytes |= std::uint64_t{std::to_integer<unsigned char>(bytes_[i])} << (8 * i);
  LOOM_CHECK(header_bytes <= detail::max_header_bytes, where(), " declares a header of ",
             header_bytes, " bytes, over the limit of ", detail::max_header_bytes, "; ",
             detail::corrupt_hint);
  LOOM_CHECK(header_bytes <= bytes_.size() - 8, where(), " declares a header of ", header_bytes,
             " bytes but only ", bytes_.size() - 8, " bytes follow the header length; ",
             detail::corrupt_hint);
  data_start_ = 8 + header_bytes;

  const auto* text = reinterpret_cast<const char*>(bytes_.data() + 8);
  const detail::Json::parser_callback_t limit_depth = [this](int depth, auto, auto&) {
    LOOM_CHECK(depth <= detail::max_header_depth, where(), " has a header nested deeper than ",
               detail::max_header_depth, " levels; ", detail::corrupt_hint);
    return true;
  };
  detail::Json header;
  try {
    header = detail::Json::parse(text, text + header_bytes, limit_depth);
  } catch (const detail::Json::exception& e) {
    LOOM_FAIL(where(), " has a header that is not valid JSON (", e.what(), "); ",
              detail::corrupt_hint);
  }
  LOOM_CHECK(header.is_object(), where(), " has a header that is a JSON ", header.type_name(),
             ", not an object; ", detail::corrupt_hint);

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__")
      read_metadata(entry);
    else
      add_tensor(name, entry);
  }

  // Laid out by offset, each tensor must start where the one before ended:
  // anything else is a hole or an overlap. A tie (empty tensors) sorts by name.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const std::size_t data_bytes = bytes_.size() - data_start_;
  std::size_t covered = 0;
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const TensorInfo& t = tensors_[i];
    if (t.begin > covered)
      LOOM_FAIL(where(), ": bytes ", detail::range_text(covered, t.begin),
                " of the data buffer belong to no tensor (a hole before tensor '", t.name, "'); ",
                detail::corrupt_hint);
    if (t.begin < covered)
      LOOM_FAIL(where(), ": tensor '", t.name, "' (bytes ", detail::range_text(t.begin, t.end),
                ") overlaps tensor '", tensors_[i - 1].name, "' (bytes ",
                detail::range_text(tensors_[i - 1].begin, tensors_[i - 1].end), "); ",
                detail::corrupt_hint);
    covered = t.end;
    index_.emplace(t.name, i);
  }
  LOOM_CHECK(covered == data_bytes, where(), ": bytes ", detail::range_text(covered, data_bytes),
             " of the data buffer belong to no tensor (after the last one); ",
             detail::corrupt_hint);
}

LOOM_DECL void SafetensorsFile::add_tensor(const std::string& name, const detail::Json& entry) {
  const std::string tensor = where() + ": tensor '" + name + "'";
  LOOM_CHECK(entry.is_object(), tensor, " is a JSON ", entry.type_name(),
             ", not an object with \"dtype\", \"shape\" and \"data_offsets\"; ",
             detail::corrupt_hint);
  const auto field = [&](const char* key) -> const detail::Json& {
    const auto it = entry.find(key);
    LOOM_CHECK(it != entry.end(), tensor, " has no \"", key, "\"; ", detail::corrupt_hint);
    return *it;
  };
  const detail::Json& dtype = field("dtype");
  const detail::Json& shape = field("shape");
  const detail::Json& offsets = field("data_offsets");

  TensorInfo info;
  info.name = name;
  LOOM_CHECK(dtype.is_string(), tensor, ": \"dtype\" is a JSON ", dtype.type_name(),
             ", expected a string such as \"F32\"; ", detail::corrupt_hint);
  info.dtype = dtype.get<std::string>();
  const std::size_t element_bytes = detail::dtype_bytes(info.dtype);
  if (element_bytes == 0) {
    std::string known;
    for (const detail::DtypeSize& d : detail::dtype_sizes)
      known += (known.empty() ? "" : ", ") + std::string(d.name);
    LOOM_FAIL(tensor, " has unknown dtype \"", info.dtype, "\" (known: ", known,
              "); was it written by a newer safetensors version?");
  }

  LOOM_CHECK(shape.is_array(), tensor, ": \"shape\" is a JSON ", shape.type_name(),
             ", expected an array of non-negative integers; ", detail::corrupt_hint);
  for (std::size_t i = 0; i < shape.size(); ++i) {
    LOOM_CHECK(shape[i].is_number_unsigned(), tensor, ": \"shape\" entry ", i, " is ",
               shape[i].dump(), ", expected a non-negative integer; ", detail::corrupt_hint);
    info.shape.push_back(shape[i].get<std::size_t>());
  }

  LOOM_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                 offsets[1].is_number_unsigned(),
             tensor, ": \"data_offsets\" is ", offsets.dump(),
             ", expected [begin, end] with two non-negative integers; ", detail::corrupt_hint);
  info.begin = offsets[0].get<std::size_t>();
  info.end = offsets[1].get<std::size_t>();
  LOOM_CHECK(info.begin <= info.end, tensor, " has data_offsets [", info.begin, ", ", info.end,
             "] that end before they begin; ", detail::corrupt_hint);
  const std::size_t data_bytes = bytes_.size() - data_start_;
  LOOM_CHECK(info.end <= data_bytes, tensor, " has data_offsets [", info.begin, ", ", info.end,
             "] past the end of the data buffer (", data_bytes,
             " bytes); the file is cut short "
             "or damaged; write it again");

  std::size_t count = 0, byte_size = 0;
  LOOM_CHECK(detail::element_count(info.shape, count) &&
                 !__builtin_mul_overflow(count, element_bytes, &byte_size),
             tensor, " has shape ", detail::shape_text(info.shape),
             " whose size in bytes overflows 64 bits; ", detail::corrupt_hint);
  LOOM_CHECK(byte_size == info.end - info.begin, tensor, " is ", info.dtype, " of shape ",
             detail::shape_text(info.shape), ", which takes ", byte_size,
             " bytes, but its data_offsets [", info.begin, ", ", info.end, "] span ",
             info.end - info.begin, "; ", detail::corrupt_hint);
  tensors_.push_back(std::move(info));
}

LOOM_DECL void SafetensorsFile::read_metadata(const detail::Json& metadata) {
  LOOM_CHECK(metadata.is_object(), where(), ": \"__metadata__\" is a JSON ", metadata.type_name(),
             ", expected an object of strings; ", detail::corrupt_hint);
  for (const auto& [key, value] : metadata.items()) {
    LOOM_CHECK(value.is_string(), where(), ": \"__metadata__\" value for key '", key,
               "' is a JSON ", value.type_name(), ", expected a string; ", detail::corrupt_hint);
    metadata_.emplace(key, value.get<std::string>());
  }
}

LOOM_DECL std::string SafetensorsFile::metadata(const std::string& key) const {
  const auto it = metadata_.find(key);
  if (it == metadata_.end())
    LOOM_FAIL(where(), " has no metadata key '", key, "' (it has ", metadata_.size(),
              " keys); was it written by a program that sets this key?");
  return it->second;
}

LOOM_DECL const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    std::string names;
    for (std::size_t i = 0; i < tensors_.size() && i < 8; ++i)
      names += (i ? ", '" : "'") + tensors_[i].name + "'";
    if (tensors_.size() > 8) names += ", ...";
    LOOM_FAIL(where(), " has no tensor '", name, "' (it holds ", tensors_.size(), " tensors",
              names.empty() ? "" : ": ", names,
              "); check that the file was written for this network");
  }
  return tensors_[it->second];
}

LOOM_DECL void SafetensorsFile::read(const std::string& name, std::span<float> out,
                                     const std::vector<std::size_t>& shape) const {
  std::size_t count = 0;
  LOOM_CHECK(detail::element_count(shape, count), "reading tensor '", name, "' of ", where(),
             ": the expected shape ", detail::shape_text(shape),
             " has an element count that overflows 64 bits; check the expected shape");
  LOOM_CHECK(count == out.size(), "reading tensor '", name, "' of ", where(), ": the output holds ",
             out.size(), " floats but the expected shape ", detail::shape_text(shape), " has ",
             count, "; pass an output of the expected shape's size");
  const TensorInfo& t = info(name);
  LOOM_CHECK(t.dtype == "F32", where(), ": tensor '", name, "' is ", t.dtype,
             " in the file but F32 is expected; convert the file's tensors to F32");
  LOOM_CHECK(t.shape == shape, where(), ": tensor '", name, "' has shape ",
             detail::shape_text(t.shape), " in the file but the caller expects ",
             detail::shape_text(shape), "; check that the file was written for this network");
  if (count) std::memcpy(out.data(), bytes_.data() + data_start_ + t.begin, count * sizeof(float));
}

#endif  // LOOM_IMPLEMENT

}  // namespace loom::io
