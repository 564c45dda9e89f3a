// What the processes of a multi-process run must agree on before they
// train or load, and the one collective that compares it. Every process
// sends a row of a fixed size (whatever the fields, phase or failure), so
// processes that disagree on what to do next still meet in the same
// collective and all raise at once: none crashes on a mismatched message,
// none waits for the collective timeout.
#pragma once

#include <algorithm>
#include <charconv>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/error.hpp"
#include "../core/linkage.hpp"
#include "../core/meta.hpp"
#include "../data/dataset.hpp"

namespace loom {

// Named values that must be the same on every process: the trainer adds
// its network, policy, optimizer and options, the data and the fit's
// options; callbacks add theirs (on_fit_prepare).
class Fingerprint {
 public:
  template <class V>
  Fingerprint& add(std::string name, const V& value) {
    fields_.emplace_back(std::move(name), text(value));
    return *this;
  }

  const std::vector<std::pair<std::string, std::string>>& fields() const { return fields_; }

  // A data set by its size, its sample shape and a digest of its first
  // samples (images and labels): the same files on every process.
  Fingerprint& add_data(const std::string& name, const data::Dataset& set);

 private:
  template <class V>
  static std::string text(const V& value) {
    if constexpr (std::is_same_v<V, bool>) {
      return value ? "true" : "false";
    } else if constexpr (std::is_arithmetic_v<V>) {
      // Shortest text that reads back to the same value: 0.1f prints 0.1.
      char buffer[64];
      const auto [end, error] = std::to_chars(buffer, buffer + sizeof buffer, value);
      return std::string(buffer, end);
    } else if constexpr (std::is_enum_v<V>) {
      return std::to_string(static_cast<long long>(value));
    } else if constexpr (std::is_convertible_v<const V&, std::string_view>) {
      return std::string(std::string_view(value));
    } else if constexpr (requires { value.string(); }) {  // std::filesystem::path
      return value.string();
    } else if constexpr (requires { value.begin(); value.end(); }) {
      std::string joined = "[";
      for (const auto& item : value) joined += (joined.size() > 1 ? ", " : "") + text(item);
      return joined + "]";
    } else {
      std::ostringstream out;
      out << value;
      return out.str();
    }
  }

  std::vector<std::pair<std::string, std::string>> fields_;
};

namespace detail {

// What a process is about to do, compared first: a process that loads a
// checkpoint while another starts fit() is told so.
enum class AgreementPhase { fit = 1, load = 2 };

inline const char* phase_call(AgreementPhase phase) {
  return phase == AgreementPhase::fit ? "Trainer::fit" : "Trainer::load";
}

// row r of the result: rank r's row (every rank passes one of the same size).
using GatherRows = std::function<std::vector<double>(std::span<const double>)>;

// How the ranks differ, the first difference found: a rank failed before
// the collective, ranks are in different calls, or a field differs.
struct Disagreement {
  enum class Kind { none, failed, phase, field } kind = Kind::none;
  std::size_t rank = 0;  // the first failing rank, or the first that differs from rank 0
  std::string failure;   // failed: that rank's message (at most `text_slots` characters)
  std::vector<AgreementPhase> phases;  // phase: each rank's call
  std::string name;                    // field: its name where every rank names it alike
  std::vector<std::string> values;     // field: each rank's value ("name = value" otherwise)
};

// A row: phase, failed, field count, one 48-bit digest per field, then the
// failure's text, a character a slot. Digests and characters are below
// 2^53: the sum that gathers the rows (one non-zero term a slot) is exact.
inline constexpr std::size_t field_slots = 96, text_slots = 400;
inline constexpr std::size_t row_size = 3 + field_slots + text_slots;

// Defined below; compiled once under LOOM_SEPARATE_COMPILATION (core/linkage.hpp).
LOOM_DECL Disagreement compare_across_ranks(AgreementPhase phase, const Fingerprint& mine,
                                            const std::string* failure, const GatherRows& gather);
LOOM_DECL std::string ranks_values(const std::vector<std::string>& values);
LOOM_DECL std::string disagreement_text(const Disagreement& d, AgreementPhase phase,
                                        std::size_t rank);

#if LOOM_IMPLEMENT
LOOM_DECL void put_text(std::span<double> slots, std::string_view text) {
  for (std::size_t i = 0; i < slots.size() && i < text.size(); ++i)
    slots[i] = static_cast<double>(static_cast<unsigned char>(text[i]));
}

LOOM_DECL std::string get_text(std::span<const double> slots) {
  std::string text;
  for (const double c : slots) {
    if (c == 0.0) break;
    text += static_cast<char>(static_cast<unsigned char>(c));
  }
  return text;
}

LOOM_DECL double field_digest(const std::pair<std::string, std::string>& field) {
  const std::uint64_t h =
      fnv1a(field.second, fnv1a(std::string_view("="), fnv1a(std::string_view(field.first))));
  return static_cast<double>(h >> 16);
}

// Compares `mine` with every rank's (`gather` gives every rank's row) (a collective: every rank calls it,
// with its own phase and fingerprint, or its failure's text when it could
// not make one). Two rounds at most, both of fixed sizes; the second, each
// rank's text of the first field that differs, runs on every rank or none.
LOOM_DECL Disagreement compare_across_ranks(AgreementPhase phase, const Fingerprint& mine,
                                            const std::string* failure, const GatherRows& gather) {
  const auto& fields = mine.fields();
  // Too many fields is this rank's failure, sent like any other: it must
  // still take part in the gather, or the others would wait for it.
  const std::string too_many =
      "its fingerprint has " + std::to_string(fields.size()) + " fields, more than the " +
      std::to_string(field_slots) + " the agreement carries";
  if (failure == nullptr && fields.size() > field_slots) failure = &too_many;
  std::vector<double> row(row_size, 0.0);
  row[0] = static_cast<double>(phase);
  row[1] = failure != nullptr ? 1.0 : 0.0;
  row[2] = static_cast<double>(std::min(fields.size(), field_slots));
  for (std::size_t f = 0; f < fields.size() && f < field_slots; ++f)
    row[3 + f] = field_digest(fields[f]);
  if (failure != nullptr)
    put_text(std::span<double>(row).subspan(3 + field_slots), *failure);
  const std::vector<double> all = gather(row);
  const std::size_t ranks = all.size() / row_size;
  LOOM_CHECK(ranks >= 1 && all.size() % row_size == 0, "loom: the agreement gathered ",
             all.size(), " values, not rows of ", row_size);
  const auto row_of = [&](std::size_t r) {
    return std::span<const double>(all).subspan(r * row_size, row_size);
  };

  Disagreement found;
  for (std::size_t r = 0; r < ranks; ++r) {
    if (row_of(r)[1] != 0.0) {
      found.kind = Disagreement::Kind::failed;
      found.rank = r;
      found.failure = get_text(row_of(r).subspan(3 + field_slots));
      return found;
    }
  }
  for (std::size_t r = 0; r < ranks; ++r) found.phases.push_back(AgreementPhase(int(row_of(r)[0])));
  for (std::size_t r = 1; r < ranks; ++r) {
    if (found.phases[r] != found.phases[0]) {
      found.kind = Disagreement::Kind::phase;
      found.rank = r;
      return found;
    }
  }
  found.phases.clear();
  std::size_t most = 0;
  for (std::size_t r = 0; r < ranks; ++r)
    most = std::max(most, static_cast<std::size_t>(row_of(r)[2]));
  const auto count = [&](std::size_t r) { return static_cast<std::size_t>(row_of(r)[2]); };
  const auto differs = [&](std::size_t r, std::size_t f) {
    const bool here = f < count(0), there = f < count(r);
    return here != there || (here && row_of(r)[3 + f] != row_of(0)[3 + f]);
  };
  std::size_t field = most;
  for (std::size_t f = 0; f < most && field == most; ++f)
    for (std::size_t r = 1; r < ranks && field == most; ++r)
      if (differs(r, f)) {
        field = f;
        found.rank = r;
      }
  if (field == most) return found;  // every rank holds the same fields

  // Round two: each rank's text of that field.
  std::vector<double> text(text_slots, 0.0);
  const std::string own = field < fields.size()
                              ? fields[field].first + " = " + fields[field].second
                              : std::string("(no field ") + std::to_string(field + 1) + ")";
  put_text(text, own);
  const std::vector<double> texts = gather(text);
  found.kind = Disagreement::Kind::field;
  std::vector<std::string> named;
  for (std::size_t r = 0; r < ranks; ++r)
    named.push_back(get_text(std::span<const double>(texts).subspan(r * text_slots, text_slots)));
  // Where every rank names the field alike, the message names it once.
  const auto name_of = [](const std::string& t) { return t.substr(0, t.find(" = ")); };
  bool same_name = true;
  for (const auto& t : named)
    same_name = same_name && t.find(" = ") != std::string::npos && name_of(t) == name_of(named[0]);
  if (same_name) {
    found.name = name_of(named[0]);
    for (const auto& t : named) found.values.push_back(t.substr(t.find(" = ") + 3));
  } else {
    found.values = std::move(named);
  }
  return found;
}

// "rank 0 has 64, rank 1 has 32" (ranks that agree are listed together).
LOOM_DECL std::string ranks_values(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<std::size_t>>> groups;
  for (std::size_t r = 0; r < values.size(); ++r) {
    auto at = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == values[r]; });
    if (at == groups.end()) groups.push_back({values[r], {r}});
    else at->second.push_back(r);
  }
  std::string text;
  for (const auto& [value, ranks] : groups) {
    if (!text.empty()) text += ", ";
    text += ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t i = 0; i < ranks.size() && i < 8; ++i) {
      if (i > 0) text += ' ';
      text += std::to_string(ranks[i]);
    }
    if (ranks.size() > 8) text += " ...";
    text += " has " + (value.empty() ? std::string("''") : value);
  }
  return text;
}

// The message every rank raises for a disagreement over `phase`'s fields
// (the failing rank raises its own error instead).
LOOM_DECL std::string disagreement_text(const Disagreement& d, AgreementPhase phase,
                                        std::size_t rank) {
  std::ostringstream text;
  text << "loom: ";
  const char* call = phase_call(phase);
  switch (d.kind) {
    case Disagreement::Kind::none:
      break;
    case Disagreement::Kind::failed:
      text << call << ": process " << d.rank << " could not start (this is process " << rank
           << "): " << d.failure;
      break;
    case Disagreement::Kind::phase:
      text << call << ": the processes are in different calls: process 0 is in "
           << phase_call(d.phases[0]) << ", process " << d.rank << " in "
           << phase_call(d.phases[d.rank])
           << "; every process must make the same calls in the same order (a checkpoint to "
              "resume given to some processes only?)";
      break;
    case Disagreement::Kind::field:
      if (!d.name.empty())
        text << call << ": the processes disagree on " << d.name << ": "
             << ranks_values(d.values);
      else
        text << call << ": the processes' settings differ: " << ranks_values(d.values);
      text << "; start every process with the same options, data and callbacks";
      break;
  }
  return text.str();
}

#endif  // LOOM_IMPLEMENT

}  // namespace detail

#if LOOM_IMPLEMENT
LOOM_DECL Fingerprint& Fingerprint::add_data(const std::string& name, const data::Dataset& set) {
  add(name + ".samples", set.count);
  add(name + ".shape", std::to_string(set.channels) + "x" + std::to_string(set.height) + "x" +
                           std::to_string(set.width));
  const std::size_t head = std::min<std::size_t>(set.count, 256);
  std::uint64_t h = detail::fnv1a(set.images.data(), head * set.sample_size() * sizeof(float));
  // Their targets: the classes, or the label sequences, their lengths and frames.
  for (const auto* targets : {&set.labels, &set.targets, &set.target_lengths, &set.frames}) {
    const std::size_t per_sample = targets == &set.targets ? set.max_target : 1;
    if (!targets->empty())
      h = detail::fnv1a(targets->data(), head * per_sample * sizeof(std::int32_t), h);
  }
  return add(name + ".first_samples_digest", h >> 16);
}
#endif  // LOOM_IMPLEMENT

}  // namespace loom
