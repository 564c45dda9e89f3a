// Reader for IDX files, the format Fashion-MNIST (and MNIST) ship in. zlib's gz*
// calls read gzip and plain files alike, so one code path serves both; every way
// a file can be wrong becomes a loom::Error that names the file and says what was
// expected and what was found.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <loom/core/error.hpp>
#include <loom/core/linkage.hpp>
#include <memory>
#include <string>
#include <vector>

namespace loom::data {

// An IDX tensor of unsigned bytes, row-major, with the file it came from so
// later checks can name it.
struct IdxArray {
  std::vector<std::size_t> dims;
  std::vector<std::uint8_t> data;
  std::string path;
};

namespace detail {

inline constexpr const char* missing_data_hint =
    "install Debian's dataset-fashion-mnist or pass --data DIR";

struct GzClose {
  void operator()(gzFile file) const { gzclose(file); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzClose>;

inline std::string shape_text(const std::vector<std::size_t>& dims) {
  std::string text;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) text += 'x';
    text += std::to_string(dims[i]);
  }
  return text;
}

}  // namespace detail

// expected_rank > 0: a file of another rank is refused from its header
// (its dimensions would be read from the data, and a wrong size reported).
LOOM_DECL IdxArray read_idx(const std::string& path, std::size_t expected_rank = 0);

#if LOOM_IMPLEMENT
namespace detail {

LOOM_DECL std::string hex_byte(std::uint8_t byte) {
  char text[5];
  std::snprintf(text, sizeof text, "0x%02x", byte);
  return text;
}

LOOM_DECL const char* idx_type_name(std::uint8_t type) {
  switch (type) {
    case 0x08:
      return "unsigned byte";
    case 0x09:
      return "signed byte";
    case 0x0B:
      return "int16";
    case 0x0C:
      return "int32";
    case 0x0D:
      return "float";
    case 0x0E:
      return "double";
    default:
      return "not an IDX type";
  }
}

// zlib reports a gzip stream that simply stops (a cut-short download) as a soft
// error: gzread returns the bytes it had and only gzerror tells. This turns that
// state into text to append to a truncation message, or "" when zlib saw none.
LOOM_DECL std::string gz_truncation_note(gzFile file) {
  int errnum = Z_OK;
  const char* message = gzerror(file, &errnum);
  if (errnum == Z_OK) return {};
  return std::string("; zlib: ") + message + " (the gzip stream is cut short)";
}

// Reads up to n bytes; a short count means the data ran out. I/O errors and
// corrupt gzip data throw here, so callers only have to judge short counts.
LOOM_DECL std::size_t read_up_to(gzFile file, const std::string& path, std::uint8_t* out,
                                 std::size_t n) {
  // gzread takes an unsigned and returns an int, so larger reads go in steps.
  constexpr std::size_t max_step = std::size_t{1} << 30;
  std::size_t done = 0;
  while (done < n) {
    const auto step = static_cast<unsigned>(std::min(n - done, max_step));
    const int got = gzread(file, out + done, step);
    if (got < 0) {
      int errnum = Z_OK;
      const char* message = gzerror(file, &errnum);
      if (errnum == Z_ERRNO)
        LOOM_FAIL("cannot read IDX file '", path, "': ", message, "; ", missing_data_hint);
      LOOM_FAIL("IDX file '", path, "' is a corrupt gzip stream (zlib: ", message,
                "); the file is damaged, fetch or install it again");
    }
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  return done;
}

}  // namespace detail

LOOM_DECL IdxArray read_idx(const std::string& path, std::size_t expected_rank) {
  errno = 0;
  const detail::GzHandle file(gzopen(path.c_str(), "rb"));
  if (!file) {
    // gzopen leaves errno at 0 when only its own allocation failed.
    const char* reason = errno ? std::strerror(errno) : "zlib could not allocate its state";
    LOOM_FAIL("cannot open IDX file '", path, "': ", reason, "; ", detail::missing_data_hint);
  }
  gzFile gz = file.get();

  std::uint8_t magic[4];
  const std::size_t magic_bytes = detail::read_up_to(gz, path, magic, sizeof magic);
  if (magic_bytes < sizeof magic)
    LOOM_FAIL("IDX file '", path, "' has a truncated header: it holds ", magic_bytes,
              " bytes but the magic number alone needs 4", detail::gz_truncation_note(gz));
  if (magic[0] != 0 || magic[1] != 0)
    LOOM_FAIL("IDX file '", path, "' has the wrong magic number: found ",
              detail::hex_byte(magic[0]), ' ', detail::hex_byte(magic[1]), ' ',
              detail::hex_byte(magic[2]), ' ', detail::hex_byte(magic[3]),
              ", expected 0x00 0x00 <type> <rank> (0x00 0x00 0x08 0x03 for images, "
              "0x00 0x00 0x08 0x01 for labels); is this an IDX file?");
  if (magic[2] != 0x08)
    LOOM_FAIL("IDX file '", path, "' holds elements of type ", detail::hex_byte(magic[2]), " (",
              detail::idx_type_name(magic[2]), "); only unsigned byte (0x08) is supported");
  const std::size_t rank = magic[3];
  LOOM_CHECK(rank > 0, "IDX file '", path, "' declares rank 0; expected at least one dimension");
  LOOM_CHECK(expected_rank == 0 || rank == expected_rank, "IDX file '", path, "' has ", rank,
             " dimensions (its magic number ends in ", detail::hex_byte(magic[3]), "), but ",
             expected_rank, " were expected (0x00 0x00 0x08 0x03 for images: count, rows, "
             "columns; 0x00 0x00 0x08 0x01 for labels: count)");

  std::uint8_t dim_bytes[4 * 255];
  const std::size_t dim_bytes_read = detail::read_up_to(gz, path, dim_bytes, 4 * rank);
  if (dim_bytes_read < 4 * rank)
    LOOM_FAIL("IDX file '", path, "' has a truncated header: rank ", rank, " needs ", 4 * rank,
              " bytes of dimensions after the magic, file holds ", dim_bytes_read,
              detail::gz_truncation_note(gz));

  IdxArray array;
  array.path = path;
  array.dims.resize(rank);
  std::size_t total = 1;
  for (std::size_t i = 0; i < rank; ++i) {
    const std::uint8_t* b = dim_bytes + 4 * i;
    const std::size_t dim = (std::size_t{b[0]} << 24) | (std::size_t{b[1]} << 16) |
                            (std::size_t{b[2]} << 8) | std::size_t{b[3]};
    array.dims[i] = dim;
    if (dim != 0 && total > std::numeric_limits<std::size_t>::max() / dim)
      LOOM_FAIL("IDX file '", path, "' has a header whose dimensions overflow a size_t; ",
                "the header is corrupt");
    total *= dim;
  }

  // A corrupt header can claim far more bytes than the file holds, so memory
  // grows with what is actually read instead of trusting the header up front:
  // from 64 KiB, doubling, at most 16 MiB a step. (A first step of 16 MiB
  // had a 24-byte file claiming gigabytes allocate and zero 16 MiB; fuzzing
  // ran at 350 inputs/s on that.)
  constexpr std::size_t first_chunk = std::size_t{1} << 16, max_chunk = std::size_t{1} << 24;
  std::size_t filled = 0;
  while (filled < total) {
    const std::size_t step = std::min({total - filled, max_chunk, std::max(filled, first_chunk)});
    array.data.resize(filled + step);
    const std::size_t got = detail::read_up_to(gz, path, array.data.data() + filled, step);
    filled += got;
    if (got < step) break;
  }
  if (filled < total)
    LOOM_FAIL("IDX file '", path, "' is truncated: header says ", detail::shape_text(array.dims),
              " = ", total, " bytes, file holds ", filled, detail::gz_truncation_note(gz));

  std::uint8_t extra[4096];
  std::size_t trailing = 0;
  while (const std::size_t got = detail::read_up_to(gz, path, extra, sizeof extra)) trailing += got;
  if (trailing)
    LOOM_FAIL("IDX file '", path, "' has ", trailing, " bytes of trailing garbage after the ",
              total, " bytes its header (", detail::shape_text(array.dims), ") declares");
  // The data can be complete while the gzip trailer (its CRC) is missing.
  const std::string note = detail::gz_truncation_note(gz);
  if (!note.empty())
    LOOM_FAIL("IDX file '", path, "' is truncated: all ", total,
              " data bytes were read but the gzip stream ends early", note);
  return array;
}
#endif  // LOOM_IMPLEMENT

}  // namespace loom::data
