// Speech data in memory, in the form a CTC model consumes: per-utterance
// log-mel features (frames x mels, frame-major, normalised per utterance and
// band) and int32 labels 1..V (0 is CTC's blank). read_tsv_corpus reads a
// "path<TAB>transcript" listing (scripts/make-digits-corpus writes one),
// computes the features in worker threads and caches them next to the
// listing. Not included by <loom/loom.hpp>: it needs libsndfile and KissFFT,
// which loom::loom links, but a program that reads no audio need not
// compile their headers.
//
// Audio is read at one sample rate (16 kHz by default) and a file at another
// rate is refused, not resampled: a corpus with mixed rates is usually a
// mistake in how it was made, and silent resampling would hide it (convert
// it once, e.g. `sox in.wav -r 16000 out.wav`).
#pragma once

#include <kiss_fftr.h>
#include <sndfile.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <loom/core/file.hpp>
#include <loom/data/spec_augment.hpp>
#include <loom/core/error.hpp>
#include <loom/core/rng.hpp>
#include <loom/core/stop_signals.hpp>
#include <loom/data/dataset.hpp>
#include <loom/io/atomic_file.hpp>
#include <memory>
#include <numbers>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace loom::data {

// Words and their labels: words()[i] has label i + 1, since label 0 is CTC's
// blank and never a word.
class Vocabulary {
 public:
  explicit Vocabulary(std::vector<std::string> words) : words_(std::move(words)) {
    LOOM_CHECK(!words_.empty(), "a Vocabulary needs at least one word");
    for (std::size_t i = 0; i < words_.size(); ++i) {
      const std::string& word = words_[i];
      LOOM_CHECK(!word.empty() && word.find_first_of(" \t\r\n") == std::string::npos,
                 "vocabulary word ", i + 1, " ('", word,
                 "') is empty or holds white space; transcripts are split at white space");
      LOOM_CHECK(std::find(words_.begin(), words_.begin() + static_cast<std::ptrdiff_t>(i), word) ==
                     words_.begin() + static_cast<std::ptrdiff_t>(i),
                 "vocabulary word '", word, "' is listed twice");
    }
  }

  // The word's label, or 0 (the blank) when it is not in the vocabulary.
  std::int32_t label(std::string_view word) const {
    const auto found = std::find(words_.begin(), words_.end(), word);
    return found == words_.end() ? 0 : static_cast<std::int32_t>(found - words_.begin() + 1);
  }
  const std::string& word(std::int32_t label) const {
    LOOM_CHECK(label >= 1 && static_cast<std::size_t>(label) <= words_.size(), "label ", label,
               " is not a word of this vocabulary (1..", words_.size(), "; 0 is CTC's blank)");
    return words_[static_cast<std::size_t>(label) - 1];
  }
  // V: the model's outputs are V + 1 (the blank).
  std::size_t size() const { return words_.size(); }
  const std::vector<std::string>& words() const { return words_; }

 private:
  std::vector<std::string> words_;
};

// TIDIGITS' eleven words: "0" is said as "zero" or "oh".
inline Vocabulary digits_vocabulary() {
  return Vocabulary(
      {"zero", "oh", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"});
}

// Log-mel features as torchaudio.transforms.MelSpectrogram computes them with
// n_fft = win_length = window, hop_length = hop, the periodic Hann window (its
// default window_fn; Hann rather than Hamming because that default is what
// most recipes are tuned with), power 2, the HTK mel scale from 0 Hz to
// rate / 2 without filter normalisation (its defaults), then log(x + 1e-6).
// One difference: frames are not centred. Frame t covers samples
// [t * hop, t * hop + window), and only whole frames are kept (no padding), so
//   frames = samples < window ? 0 : 1 + (samples - window) / hop
// (Kaldi's snip_edges); torchaudio's center=True would pad and give
// 1 + samples / hop.
struct FeatureOptions {
  std::size_t sample_rate = 16000;
  std::size_t window = 400;  // samples: 25 ms at 16 kHz; also the FFT size
  std::size_t hop = 160;     // 10 ms
  std::size_t mels = 80;
};

inline std::size_t feature_frames(std::size_t samples, const FeatureOptions& options) {
  return samples < options.window ? 0 : 1 + (samples - options.window) / options.hop;
}

// One utterance: its audio file, its features (frames x mels, frame-major) and
// its labels (1..V).
struct Utterance {
  std::string path;
  std::size_t frames = 0;
  std::vector<float> features;
  std::vector<std::int32_t> labels;
};

struct SpeechCorpus {
  std::string name;  // the listing's path
  std::size_t mels = 0;
  std::vector<Utterance> utterances;
  std::size_t skipped = 0;  // bad files left out under CorpusOptions::skip_bad_files
};

namespace detail {

struct SndfileClose {
  void operator()(SNDFILE* file) const { sf_close(file); }
};

// Reads `path` as mono audio at `rate` into samples in [-1, 1); on failure
// returns false with `reason` saying what is wrong and what to do (without
// the file's line in a listing, which a caller adds).
inline bool load_audio(const std::string& path, std::size_t rate, std::vector<float>& samples,
                       std::string& reason) {
  SF_INFO info{};
  const std::unique_ptr<SNDFILE, SndfileClose> file(sf_open(path.c_str(), SFM_READ, &info));
  if (!file) {
    reason = "cannot read audio file '" + path + "': libsndfile: " + sf_strerror(nullptr) +
             " (it must be a WAV file, or another format libsndfile reads)";
    return false;
  }
  if (info.channels != 1) {
    reason = "audio file '" + path + "' has " + std::to_string(info.channels) +
             " channels; only mono is read (mix it down, e.g. `sox in.wav -c 1 out.wav`)";
    return false;
  }
  if (static_cast<std::size_t>(info.samplerate) != rate) {
    reason = "audio file '" + path + "' is sampled at " + std::to_string(info.samplerate) +
             " Hz but " + std::to_string(rate) +
             " Hz is expected; loom does not resample: convert it (e.g. `sox in.wav -r " +
             std::to_string(rate) + " out.wav`) or set FeatureOptions::sample_rate";
    return false;
  }
  // A WAV cut short opens without error: libsndfile takes the frames the file
  // holds and notes in its log "data : <header's size> (should be <actual>)".
  char log[2048] = {};
  sf_command(file.get(), SFC_GET_LOG_INFO, log, sizeof log);
  if (const char* data = std::strstr(log, "\ndata : ")) {
    const char* end = std::strchr(data + 1, '\n');
    const std::string line(data + 1, end ? end : data + std::strlen(data));
    if (line.find("should be") != std::string::npos) {
      reason = "audio file '" + path + "' is truncated: libsndfile: '" + line +
               "' (bytes of samples its header declares, and what the file holds); "
               "the file is damaged, make or fetch it again";
      return false;
    }
  }
  samples.resize(static_cast<std::size_t>(info.frames));
  const sf_count_t got = sf_readf_float(file.get(), samples.data(), info.frames);
  if (got != info.frames) {
    reason = "audio file '" + path + "' ends after " + std::to_string(got) + " of its " +
             std::to_string(info.frames) + " samples: libsndfile: " + sf_strerror(file.get());
    return false;
  }
  return true;
}

}  // namespace detail

// The samples of a mono file at `rate`, in [-1, 1). Another rate, more than
// one channel, a file libsndfile cannot read and a truncated WAV are each a
// loom::Error naming the file.
inline std::vector<float> read_wav(const std::string& path, std::size_t rate = 16000) {
  std::vector<float> samples;
  std::string reason;
  if (!detail::load_audio(path, rate, samples, reason)) LOOM_FAIL(reason);
  return samples;
}

// Computes the features of FeatureOptions. Holds KissFFT's plan, whose
// scratch buffer makes it single-threaded: each worker thread has its own.
class MelFeatures {
 public:
  explicit MelFeatures(const FeatureOptions& options) : options_(options) {
    LOOM_CHECK(options.sample_rate > 0 && options.hop > 0 && options.mels > 0,
               "FeatureOptions{sample_rate = ", options.sample_rate, ", hop = ", options.hop,
               ", mels = ", options.mels, "}: each must be positive");
    LOOM_CHECK(options.window >= 2 && options.window % 2 == 0, "FeatureOptions::window is ",
               options.window,
               " samples; it is also the FFT size, which must be even (400: "
               "25 ms at 16 kHz)");
    plan_.reset(kiss_fftr_alloc(static_cast<int>(options.window), 0, nullptr, nullptr));
    LOOM_CHECK(plan_ != nullptr, "kiss_fftr_alloc failed for an FFT of ", options.window,
               " points (out of memory)");
    const std::size_t n = options.window;
    // torch.hann_window(n) is periodic: the window of a length-n+1 Hann with the last point cut.
    hann_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      hann_[i] =
          static_cast<float>(0.5 - 0.5 * std::cos(2.0 * std::numbers::pi * static_cast<double>(i) /
                                                  static_cast<double>(n)));
    build_filters();
    frame_.resize(n);
    spectrum_.resize(n / 2 + 1);
    power_.resize(n / 2 + 1);
  }

  const FeatureOptions& options() const { return options_; }

  // log(mel energy + 1e-6), frames x mels, before normalisation.
  std::vector<float> log_mel(std::span<const float> samples) {
    const std::size_t frames = feature_frames(samples.size(), options_), mels = options_.mels;
    std::vector<float> out(frames * mels);
    for (std::size_t t = 0; t < frames; ++t) {
      const float* x = samples.data() + t * options_.hop;
      for (std::size_t i = 0; i < options_.window; ++i) frame_[i] = x[i] * hann_[i];
      kiss_fftr(plan_.get(), frame_.data(), spectrum_.data());
      for (std::size_t k = 0; k < spectrum_.size(); ++k)
        power_[k] = spectrum_[k].r * spectrum_[k].r + spectrum_[k].i * spectrum_[k].i;
      for (std::size_t m = 0; m < mels; ++m) {
        const Filter& filter = filters_[m];
        double energy = 0.0;
        for (std::size_t j = 0; j < filter.weights.size(); ++j)
          energy += static_cast<double>(filter.weights[j]) * power_[filter.first_bin + j];
        out[t * mels + m] = static_cast<float>(std::log(energy + 1e-6));
      }
    }
    return out;
  }

  // log_mel, then each band shifted and scaled to mean 0 and standard
  // deviation 1 over the utterance (per-utterance CMVN: it removes the
  // channel and the loudness, which for synthetic speech say nothing).
  std::vector<float> compute(std::span<const float> samples) {
    std::vector<float> features = log_mel(samples);
    normalize_bands(features, options_.mels);
    return features;
  }

  // Mean 0 and standard deviation 1 per band of frames x mels features; a
  // band constant over the utterance becomes 0 (its deviation is floored).
  static void normalize_bands(std::vector<float>& features, std::size_t mels) {
    const std::size_t frames = features.size() / mels;
    if (frames == 0) return;
    for (std::size_t m = 0; m < mels; ++m) {
      double sum = 0.0;
      for (std::size_t t = 0; t < frames; ++t) sum += features[t * mels + m];
      const double mean = sum / static_cast<double>(frames);
      double squares = 0.0;
      for (std::size_t t = 0; t < frames; ++t) {
        const double d = features[t * mels + m] - mean;
        squares += d * d;
      }
      const double scale = 1.0 / std::max(std::sqrt(squares / static_cast<double>(frames)), 1e-5);
      for (std::size_t t = 0; t < frames; ++t)
        features[t * mels + m] = static_cast<float>((features[t * mels + m] - mean) * scale);
    }
  }

 private:
  struct Filter {
    std::size_t first_bin = 0;
    std::vector<float> weights;  // over bins first_bin, first_bin + 1, ...
  };
  struct PlanFree {
    void operator()(kiss_fftr_cfg plan) const { kiss_fftr_free(plan); }
  };

  // torchaudio.functional.melscale_fbanks(mel_scale="htk", norm=None):
  // triangles whose corners are evenly spaced in mel, evaluated at the FFT
  // bins' frequencies.
  void build_filters() {
    const auto mel = [](double hz) { return 2595.0 * std::log10(1.0 + hz / 700.0); };
    const auto hz = [](double m) { return 700.0 * (std::pow(10.0, m / 2595.0) - 1.0); };
    const std::size_t bins = options_.window / 2 + 1, mels = options_.mels;
    const double nyquist = static_cast<double>(options_.sample_rate) / 2.0;
    std::vector<double> corners(mels + 2);
    for (std::size_t i = 0; i < corners.size(); ++i)
      corners[i] = hz(mel(nyquist) * static_cast<double>(i) / static_cast<double>(mels + 1));
    filters_.resize(mels);
    for (std::size_t m = 0; m < mels; ++m) {
      const double low = corners[m], centre = corners[m + 1], high = corners[m + 2];
      Filter& filter = filters_[m];
      for (std::size_t k = 0; k < bins; ++k) {
        const double f = nyquist * static_cast<double>(k) / static_cast<double>(bins - 1);
        const double w =
            std::max(0.0, std::min((f - low) / (centre - low), (high - f) / (high - centre)));
        if (w <= 0.0) continue;
        if (filter.weights.empty()) filter.first_bin = k;
        filter.weights.resize(k - filter.first_bin + 1, 0.0f);
        filter.weights.back() = static_cast<float>(w);
      }
      LOOM_CHECK(!filter.weights.empty(), "mel band ", m, " of ", mels, " (", low, " to ", high,
                 " Hz) holds no FFT bin of a ", options_.window, "-point FFT at ",
                 options_.sample_rate, " Hz (bins ", nyquist / static_cast<double>(bins - 1),
                 " Hz apart); use fewer mels or a longer window");
    }
  }

  FeatureOptions options_;
  std::unique_ptr<kiss_fftr_state, PlanFree> plan_;
  std::vector<float> hann_;
  std::vector<Filter> filters_;
  std::vector<float> frame_, power_;
  std::vector<kiss_fft_cpx> spectrum_;
};

struct CorpusOptions {
  FeatureOptions features{};
  Vocabulary vocabulary = digits_vocabulary();
  // Longest utterance accepted, in frames (1000: 10 s at a 10 ms hop); a
  // longer one is an error (or skipped): it would pad every batch it joins.
  std::size_t max_frames = 1000;
  // false: a bad audio file stops the read with an error naming its line.
  // true: it is left out and counted in SpeechCorpus::skipped. Bad files are
  // those that cannot be read as mono audio at the rate, are longer than
  // max_frames, or are too short for their transcript under CTC. A listing
  // that is wrong itself (no tab, an empty transcript, a word not in the
  // vocabulary) is always an error: skipping would hide a broken listing.
  bool skip_bad_files = false;
  std::size_t threads = 2;  // worker threads computing features
  // The feature cache: "<listing>.loom-features" next to the listing, or in
  // cache_dir when one is given; use_cache = false neither reads nor writes it.
  std::string cache_dir{};
  bool use_cache = true;
};

// What read_tsv_corpus did about its cache, for logs and tests.
struct CorpusCacheReport {
  std::string path;          // the cache file ("" without use_cache)
  bool hit = false;          // features came from the cache
  std::size_t computed = 0;  // utterances whose features were computed
  std::string note;          // why the cache was not used, or could not be written
};

namespace detail {

// 64-bit hash of a byte stream fed in pieces: 8-byte words through mix64,
// fast enough to check a cache of hundreds of megabytes in a fraction of
// its read time.
class StreamHash {
 public:
  explicit StreamHash(std::uint64_t seed = 0) : hash_(mix64(seed)) {}
  void add(const void* data, std::size_t bytes) {
    if (bytes == 0) return;
    const auto* p = static_cast<const unsigned char*>(data);
    length_ += bytes;
    if (pending_ > 0) {
      const std::size_t take = std::min(bytes, sizeof tail_ - pending_);
      std::memcpy(tail_ + pending_, p, take);
      pending_ += take;
      p += take;
      bytes -= take;
      if (pending_ < sizeof tail_) return;
      add_word(tail_);
      pending_ = 0;
    }
    for (; bytes >= 8; bytes -= 8, p += 8) add_word(p);
    std::memcpy(tail_, p, bytes);
    pending_ = bytes;
  }
  void add_u64(std::uint64_t value) { add(&value, sizeof value); }
  void add_string(std::string_view text) {
    add_u64(text.size());
    add(text.data(), text.size());
  }
  std::uint64_t value() const {
    std::uint64_t word = 0;
    std::memcpy(&word, tail_, pending_);
    return mix64(mix64(hash_ ^ word) ^ length_);
  }

 private:
  void add_word(const unsigned char* p) {
    std::uint64_t word;
    std::memcpy(&word, p, sizeof word);
    hash_ = mix64(hash_ ^ word);
  }
  std::uint64_t hash_;
  std::uint64_t length_ = 0;
  unsigned char tail_[8] = {};
  std::size_t pending_ = 0;
};

// A listing's line, parsed.
struct CorpusLine {
  std::size_t line = 0;
  std::string path;  // resolved against the listing's folder
  std::vector<std::int32_t> labels;
};

// Bumped when the features or the cache layout change, so old caches are rebuilt.
inline constexpr std::uint64_t feature_cache_version = 1;
inline constexpr char feature_cache_magic[8] = {'L', 'O', 'O', 'M', 'F', 'E', 'A', 'T'};

// CTC emits a blank between two equal labels, so a transcript needs
// labels + repeats frames.
inline std::size_t ctc_min_frames(const std::vector<std::int32_t>& labels) {
  std::size_t frames = labels.size();
  for (std::size_t i = 1; i < labels.size(); ++i) frames += labels[i] == labels[i - 1];
  return frames;
}

// The cache's key: everything the corpus read from the listing depends on.
// A WAV's size and modification time stand for its contents (hashing every
// sample would cost as much as a good part of computing the features).
inline std::uint64_t corpus_cache_key(const std::string& listing,
                                      const std::vector<CorpusLine>& lines,
                                      const CorpusOptions& options) {
  StreamHash hash(feature_cache_version);
  hash.add_string(listing);
  for (const CorpusLine& line : lines) {
    hash.add_string(line.path);
    struct stat info {};
    if (::stat(line.path.c_str(), &info) == 0) {
      hash.add_u64(static_cast<std::uint64_t>(info.st_size));
      hash.add_u64(static_cast<std::uint64_t>(info.st_mtim.tv_sec));
      hash.add_u64(static_cast<std::uint64_t>(info.st_mtim.tv_nsec));
    } else {
      hash.add_u64(~std::uint64_t{0});
    }
  }
  const FeatureOptions& f = options.features;
  for (const std::size_t value : {f.sample_rate, f.window, f.hop, f.mels, options.max_frames,
                                  std::size_t{options.skip_bad_files}})
    hash.add_u64(value);
  for (const std::string& word : options.vocabulary.words()) hash.add_string(word);
  return hash.value();
}

// Writes pieces of a cache file to a sink; the same order serves hashing,
// sizing and writing.
template <class Sink>
void emit_corpus(const SpeechCorpus& corpus, Sink&& sink) {
  const auto u64 = [&](std::uint64_t value) { sink(&value, sizeof value); };
  u64(corpus.mels);
  u64(corpus.skipped);
  u64(corpus.utterances.size());
  for (const Utterance& u : corpus.utterances) {
    u64(u.path.size());
    sink(u.path.data(), u.path.size());
    u64(u.frames);
    u64(u.labels.size());
    sink(u.labels.data(), u.labels.size() * sizeof(std::int32_t));
    sink(u.features.data(), u.features.size() * sizeof(float));
  }
}

// The corpus in a cache file whose key is `key`, or false with `note` saying
// why not (absent, for other inputs, or corrupt: any doubt means a rebuild).
inline bool read_feature_cache(const std::string& path, std::uint64_t key, SpeechCorpus& corpus,
                               std::string& note) {
  const File file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    note = "no cache file '" + path + "' (" + std::strerror(errno) + ")";
    return false;
  }
  struct stat info {};
  if (::fstat(::fileno(file.get()), &info) != 0) {
    note = "cannot stat the cache file";
    return false;
  }
  const std::uint64_t file_bytes = static_cast<std::uint64_t>(info.st_size);
  char magic[8];
  std::uint64_t header[4];  // version, key, payload bytes, payload hash
  if (std::fread(magic, 1, sizeof magic, file.get()) != sizeof magic ||
      std::memcmp(magic, feature_cache_magic, sizeof magic) != 0 ||
      std::fread(header, sizeof header, 1, file.get()) != 1) {
    note = "the cache file '" + path + "' is corrupt (no header)";
    return false;
  }
  if (header[0] != feature_cache_version || header[1] != key) {
    note = "the cache file '" + path + "' was written for other inputs or options";
    return false;
  }
  std::uint64_t left = header[2];
  if (left != file_bytes - sizeof magic - sizeof header) {
    note = "the cache file '" + path + "' is corrupt (its size is not what its header says)";
    return false;
  }
  StreamHash hash;
  bool ok = true;
  const auto read = [&](void* out, std::uint64_t bytes) {
    ok = ok && bytes <= left && std::fread(out, 1, bytes, file.get()) == bytes;
    if (!ok) return false;
    left -= bytes;
    hash.add(out, bytes);
    return true;
  };
  const auto u64 = [&]() {
    std::uint64_t value = 0;
    read(&value, sizeof value);
    return value;
  };
  SpeechCorpus cached;
  cached.name = corpus.name;
  cached.mels = u64();
  cached.skipped = u64();
  const std::uint64_t count = u64();
  // Each utterance takes at least 24 bytes: a count beyond that is corrupt.
  ok = ok && count <= left / 24;
  if (ok) cached.utterances.resize(count);
  for (std::uint64_t i = 0; ok && i < count; ++i) {
    Utterance& u = cached.utterances[i];
    const std::uint64_t path_bytes = u64();
    ok = ok && path_bytes <= left;
    if (!ok) break;
    u.path.resize(path_bytes);
    read(u.path.data(), path_bytes);
    u.frames = u64();
    const std::uint64_t labels = u64();
    ok = ok && labels <= left / sizeof(std::int32_t) && cached.mels > 0 &&
         u.frames <= left / sizeof(float) / cached.mels;
    if (!ok) break;
    u.labels.resize(labels);
    read(u.labels.data(), labels * sizeof(std::int32_t));
    u.features.resize(u.frames * cached.mels);
    read(u.features.data(), u.features.size() * sizeof(float));
  }
  if (!ok || left != 0 || hash.value() != header[3]) {
    note = "the cache file '" + path + "' is corrupt (its contents fail their checksum)";
    return false;
  }
  corpus = std::move(cached);
  return true;
}

inline void write_feature_cache(const std::string& path, std::uint64_t key,
                                const SpeechCorpus& corpus) {
  StreamHash hash;
  std::uint64_t payload = 0;
  emit_corpus(corpus, [&](const void* data, std::size_t bytes) {
    hash.add(data, bytes);
    payload += bytes;
  });
  const std::uint64_t header[4] = {feature_cache_version, key, payload, hash.value()};
  io::write_file_atomically(
      path, "feature cache", sizeof feature_cache_magic + sizeof header + payload,
      [&](std::FILE* file) {
        bool ok = std::fwrite(feature_cache_magic, sizeof feature_cache_magic, 1, file) == 1 &&
                  std::fwrite(header, sizeof header, 1, file) == 1;
        emit_corpus(corpus, [&](const void* data, std::size_t bytes) {
          ok = ok && (bytes == 0 || std::fwrite(data, 1, bytes, file) == bytes);
        });
        return ok;
      });
}

// Lines of "path<TAB>transcript"; empty lines are ignored. Every error names
// listing:line.
inline std::vector<CorpusLine> parse_corpus_listing(const std::string& listing,
                                                    const std::string& tsv_path,
                                                    const Vocabulary& vocabulary) {
  const std::filesystem::path folder = std::filesystem::path(tsv_path).parent_path();
  std::vector<CorpusLine> lines;
  std::istringstream in(listing);
  std::string text;
  for (std::size_t number = 1; std::getline(in, text); ++number) {
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.empty()) continue;
    const std::size_t tab = text.find('\t');
    LOOM_CHECK(tab != std::string::npos, tsv_path, ":", number,
               ": no tab; each line must be 'path<TAB>transcript' (the line is '", text, "')");
    LOOM_CHECK(tab > 0, tsv_path, ":", number, ": the audio path before the tab is empty");
    CorpusLine line;
    line.line = number;
    const std::filesystem::path audio = text.substr(0, tab);
    line.path = (audio.is_absolute() ? audio : folder / audio).lexically_normal().string();
    std::istringstream words(text.substr(tab + 1));
    for (std::string word; words >> word;) {
      const std::int32_t label = vocabulary.label(word);
      if (label == 0) {
        std::string known;
        for (const std::string& w : vocabulary.words()) known += (known.empty() ? "" : " ") + w;
        LOOM_FAIL(tsv_path, ":", number, ": transcript word '", word,
                  "' is not in the vocabulary (", known,
                  "); fix the transcript or pass CorpusOptions::vocabulary");
      }
      line.labels.push_back(label);
    }
    LOOM_CHECK(!line.labels.empty(), tsv_path, ":", number, ": the transcript of '", line.path,
               "' is empty; every utterance needs at least one word");
    lines.push_back(std::move(line));
  }
  return lines;
}

// Features of every line, in `threads` worker threads. `errors[i]` is empty
// when line i is good, else why its file is bad; the first exception that is
// not a verdict on a file (out of memory) is rethrown.
inline std::vector<Utterance> compute_utterances(const std::vector<CorpusLine>& lines,
                                                 const CorpusOptions& options,
                                                 std::vector<std::string>& errors) {
  std::vector<Utterance> utterances(lines.size());
  errors.assign(lines.size(), {});
  std::vector<std::exception_ptr> failures(lines.size());
  std::atomic<std::size_t> next{0};
  // Without skip_bad_files the read stops at the first bad line in listing
  // order; lines after one already found bad are not worth computing.
  std::atomic<std::size_t> first_bad{lines.size()};
  const auto mark_bad = [&](std::size_t i) {
    std::size_t seen = first_bad.load();
    while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
    }
  };
  const auto work = [&] {
    MelFeatures mel(options.features);
    std::vector<float> samples;
    for (std::size_t i; (i = next++) < lines.size();) {
      if (!options.skip_bad_files && i > first_bad.load()) continue;
      const CorpusLine& line = lines[i];
      try {
        std::string reason;
        if (!load_audio(line.path, options.features.sample_rate, samples, reason)) {
          errors[i] = std::move(reason);
          mark_bad(i);
          continue;
        }
        const std::size_t frames = feature_frames(samples.size(), options.features);
        const std::size_t needed = ctc_min_frames(line.labels);
        if (frames > options.max_frames) {
          errors[i] = "'" + line.path + "' is " + std::to_string(frames) +
                      " frames long, more than CorpusOptions::max_frames = " +
                      std::to_string(options.max_frames) +
                      "; raise max_frames, or set skip_bad_files to leave it out";
        } else if (frames < needed) {
          errors[i] = "'" + line.path + "' has " + std::to_string(frames) + " frames (" +
                      std::to_string(samples.size()) + " samples) but its " +
                      std::to_string(line.labels.size()) + " transcript words need at least " +
                      std::to_string(needed) +
                      " under CTC (one per word and a blank between repeated words); the "
                      "audio is cut short or the transcript belongs to another file";
        }
        if (!errors[i].empty()) {
          mark_bad(i);
          continue;
        }
        Utterance& u = utterances[i];
        u.path = line.path;
        u.frames = frames;
        u.features = mel.compute(samples);
        u.labels = line.labels;
      } catch (...) {
        failures[i] = std::current_exception();
        mark_bad(i);
      }
    }
  };
  const std::size_t count = std::max<std::size_t>(1, std::min(options.threads, lines.size()));
  std::vector<std::thread> workers;
  try {
    for (std::size_t t = 0; t < count; ++t)
      workers.push_back(loom::detail::start_quiet_thread("loom-audio", work));
  } catch (...) {
    next = lines.size();
    for (std::thread& worker : workers) worker.join();
    throw;
  }
  for (std::thread& worker : workers) worker.join();
  for (const std::exception_ptr& failure : failures)
    if (failure) std::rethrow_exception(failure);
  return utterances;
}

}  // namespace detail

// Reads a listing of "path<TAB>transcript" lines (paths relative to the
// listing's folder, transcripts as words of options.vocabulary) into
// features and labels. Errors name listing:line (see CorpusOptions for what
// skip_bad_files changes). The result is cached in a file keyed by a hash of
// the listing, each audio file's size and modification time, and the
// options; a cache that does not match or fails its checksum is rebuilt,
// never trusted, and is written atomically (a crash leaves the old one or
// the new one). A cache that cannot be written is reported on stderr and in
// `report`, and the read goes on.
inline SpeechCorpus read_tsv_corpus(const std::string& tsv_path, const CorpusOptions& options = {},
                                    CorpusCacheReport* report = nullptr) {
  LOOM_CHECK(options.threads >= 1,
             "CorpusOptions::threads is 0; at least one thread computes features");
  std::string listing;
  {
    std::ifstream in(tsv_path, std::ios::binary);
    LOOM_CHECK(in, "cannot open corpus listing '", tsv_path, "': ", std::strerror(errno),
               "; scripts/make-digits-corpus writes train.tsv and test.tsv for the digits corpus");
    listing.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::vector<detail::CorpusLine> lines =
      detail::parse_corpus_listing(listing, tsv_path, options.vocabulary);
  // Fails here, before any thread, on impossible options.
  const MelFeatures check(options.features);

  CorpusCacheReport local;
  CorpusCacheReport& cache = report ? *report : local;
  cache = {};
  SpeechCorpus corpus;
  corpus.name = tsv_path;
  corpus.mels = options.features.mels;

  std::uint64_t key = 0;
  if (options.use_cache) {
    const std::filesystem::path listing_path(tsv_path);
    if (options.cache_dir.empty()) {
      cache.path = tsv_path + ".loom-features";
    } else {
      // Listings of the same name from other folders may share cache_dir.
      detail::StreamHash where;
      where.add_string(std::filesystem::absolute(listing_path).lexically_normal().string());
      char tag[17];
      std::snprintf(tag, sizeof tag, "%016llx", static_cast<unsigned long long>(where.value()));
      cache.path = (std::filesystem::path(options.cache_dir) /
                    (listing_path.filename().string() + "-" + tag + ".loom-features"))
                       .string();
    }
    key = detail::corpus_cache_key(listing, lines, options);
    if (detail::read_feature_cache(cache.path, key, corpus, cache.note)) {
      cache.hit = true;
      return corpus;
    }
  }

  std::vector<std::string> errors;
  std::vector<Utterance> utterances = detail::compute_utterances(lines, options, errors);
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (errors[i].empty()) {
      corpus.utterances.push_back(std::move(utterances[i]));
      ++cache.computed;
    } else if (options.skip_bad_files) {
      ++corpus.skipped;
    } else {
      LOOM_FAIL(tsv_path, ":", lines[i].line, ": ", errors[i]);
    }
  }

  if (options.use_cache) {
    try {
      if (!options.cache_dir.empty()) std::filesystem::create_directories(options.cache_dir);
      detail::write_feature_cache(cache.path, key, corpus);
    } catch (const std::exception& e) {
      cache.note = std::string(
                       "the feature cache could not be written, so the next read "
                       "computes the features again: ") +
                   e.what();
      std::cerr << "loom: warning: " << cache.note << '\n';
    }
  }
  return corpus;
}

// The corpus as a Dataset a CTC model trains on: a sample per utterance of
// max_frames x mels (channels 1, height max_frames, width mels), its
// features zero-padded past its frames (0 is each band's mean once
// normalised per utterance), Dataset::frames its own frames, and its
// labels as a target sequence padded to the longest transcript.
// `classes`: the model's outputs, the vocabulary's size + 1 for CTC's
// blank at 0. An utterance longer than max_frames is an error naming its
// file (read_tsv_corpus's CorpusOptions::max_frames refuses or skips them
// as it reads; give the same bound here).
inline Dataset speech_dataset(const SpeechCorpus& corpus, std::size_t max_frames,
                              std::size_t classes) {
  LOOM_CHECK(max_frames >= 1, "speech_dataset: max_frames is 0; samples need at least 1 frame");
  LOOM_CHECK(classes >= 2, "speech_dataset: ", classes,
             " classes; CTC needs the blank (0) and at least one word (the vocabulary's size + 1)");
  LOOM_CHECK(corpus.mels >= 1, "speech_dataset: corpus '", corpus.name, "' has 0 mels");
  Dataset set;
  set.name = corpus.name;
  set.count = corpus.utterances.size();
  set.channels = 1;
  set.height = max_frames;
  set.width = corpus.mels;
  set.classes = classes;
  for (const Utterance& u : corpus.utterances) {
    LOOM_CHECK(u.frames >= 1 && u.frames <= max_frames, "speech_dataset: '", u.path, "' is ",
               u.frames, " frames long; samples of corpus '", corpus.name, "' hold 1..",
               max_frames, " (max_frames): raise max_frames, or leave it out when reading "
               "(CorpusOptions::max_frames with skip_bad_files)");
    LOOM_CHECK(u.features.size() == u.frames * corpus.mels, "speech_dataset: '", u.path,
               "' has ", u.features.size(), " feature values for ", u.frames, " frames of ",
               corpus.mels, " mels");
    LOOM_CHECK(!u.labels.empty(), "speech_dataset: '", u.path, "' has an empty transcript");
    set.max_target = std::max(set.max_target, u.labels.size());
  }
  set.images.assign(set.count * set.sample_size(), 0.0f);
  set.targets.assign(set.count * set.max_target, 0);
  set.target_lengths.resize(set.count);
  set.frames.resize(set.count);
  for (std::size_t i = 0; i < set.count; ++i) {
    const Utterance& u = corpus.utterances[i];
    for (const std::int32_t label : u.labels)
      LOOM_CHECK(label >= 1 && static_cast<std::size_t>(label) < classes, "speech_dataset: '",
                 u.path, "' has label ", label, "; expected 1..", classes - 1, " for ", classes,
                 " classes (0 is CTC's blank; classes is the vocabulary's size + 1)");
    std::copy(u.features.begin(), u.features.end(),
              set.images.begin() + static_cast<std::ptrdiff_t>(i * set.sample_size()));
    std::copy(u.labels.begin(), u.labels.end(),
              set.targets.begin() + static_cast<std::ptrdiff_t>(i * set.max_target));
    set.target_lengths[i] = static_cast<std::int32_t>(u.labels.size());
    set.frames[i] = static_cast<std::int32_t>(u.frames);
  }
  return set;
}


}  // namespace loom::data
