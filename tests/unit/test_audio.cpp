// The audio side of speech recognition (data/audio.hpp): the frame rule, the
// log-mel features against torchaudio's numbers, per-utterance normalisation,
// every way a WAV or a listing can be wrong, the feature cache (hit, rebuilt
// when stale or corrupt), SpecAugment's determinism, and the corpus that
// scripts/make-digits-corpus writes.
#include <sndfile.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <loom/data/audio.hpp>
#include <numbers>
#include <string>
#include <vector>

#include "loom_test.hpp"
#include "temp_dir.hpp"

namespace {

namespace fs = std::filesystem;
using namespace loom::data;
using Catch::Contains;
using loom::test::TempDir;

// Interleaved samples in [-1, 1) as 16-bit PCM WAV.
void write_wav(const std::string& path, const std::vector<float>& samples, int rate = 16000,
               int channels = 1) {
  SF_INFO info{};
  info.samplerate = rate;
  info.channels = channels;
  info.format = SF_FORMAT_WAV | SF_FORMAT_PCM_16;
  SNDFILE* file = sf_open(path.c_str(), SFM_WRITE, &info);
  REQUIRE(file != nullptr);
  REQUIRE(sf_write_float(file, samples.data(), static_cast<sf_count_t>(samples.size())) ==
          static_cast<sf_count_t>(samples.size()));
  sf_close(file);
}

std::vector<float> tone(std::size_t count, double hz, double amplitude = 0.5, double phase = 0.0) {
  std::vector<float> x(count);
  for (std::size_t n = 0; n < count; ++n)
    x[n] = static_cast<float>(
        amplitude *
        std::sin(2.0 * std::numbers::pi * hz * static_cast<double>(n) / 16000.0 + phase));
  return x;
}

// A tone with seeded noise, so that every band varies over the frames.
std::vector<float> noisy_tone(std::size_t count, double hz, std::uint64_t seed) {
  std::vector<float> x = tone(count, hz, 0.3);
  const std::vector<float> noise = loom::test::random_vector<float>(count, seed, -0.1, 0.1);
  for (std::size_t n = 0; n < count; ++n) x[n] += noise[n];
  return x;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

double htk_mel(double hz) { return 2595.0 * std::log10(1.0 + hz / 700.0); }

}  // namespace

TEST_CASE("audio: frames are 1 + (samples - window) / hop, whole frames only, no padding",
          "[audio]") {
  const FeatureOptions options;
  CHECK(feature_frames(0, options) == 0);
  CHECK(feature_frames(399, options) == 0);
  CHECK(feature_frames(400, options) == 1);
  CHECK(feature_frames(559, options) == 1);
  CHECK(feature_frames(560, options) == 2);
  CHECK(feature_frames(16000, options) == 98);
  MelFeatures mel(options);
  CHECK(mel.log_mel(tone(559, 440)).size() == 1 * 80);
  CHECK(mel.compute(tone(16000, 440)).size() == 98 * 80);
  MelFeatures mel40(FeatureOptions{.mels = 40});
  CHECK(mel40.compute(tone(1200, 440)).size() == 6 * 40);
}

TEST_CASE("audio: a pure tone's energy peaks in the mel band centred nearest its frequency",
          "[audio]") {
  MelFeatures mel(FeatureOptions{.mels = 40});
  for (const double hz : {300.0, 1000.0, 3000.0, 6500.0}) {
    // Band m's triangle peaks at mel(8000) * (m + 1) / 41.
    const auto expected =
        static_cast<std::size_t>(std::lround(htk_mel(hz) / htk_mel(8000.0) * 41.0 - 1.0));
    const std::vector<float> features = mel.log_mel(tone(4000, hz));
    const std::size_t frames = features.size() / 40;
    REQUIRE(frames == 23);
    for (std::size_t t = 0; t < frames; ++t) {
      const auto row = features.begin() + static_cast<std::ptrdiff_t>(t * 40);
      INFO(hz << " Hz, frame " << t);
      CHECK(static_cast<std::size_t>(std::max_element(row, row + 40) - row) == expected);
    }
  }
}

TEST_CASE("audio: log-mel features equal torchaudio's MelSpectrogram (htk, center=False) + log",
          "[audio]") {
  // torchaudio 0.13.1: MelSpectrogram(sample_rate=16000, n_fft=400, hop_length=160,
  // n_mels=80, center=False, mel_scale="htk"), then log(x + 1e-6); frame 2 of
  // this signal of 1200 samples (6 frames).
  const float expected[80] = {
      -13.814f, -13.811f, -13.812f, -13.813f, -13.810f, -13.813f, -13.812f, -13.810f, -13.812f,
      -13.811f, -13.810f, -13.809f, -13.810f, 5.695f,   7.044f,   7.506f,   6.192f,   -13.806f,
      -13.805f, -13.804f, -13.802f, -13.800f, -13.798f, -13.795f, -13.792f, -13.787f, -13.777f,
      -13.774f, -13.766f, -13.739f, -13.735f, -13.695f, -13.672f, -13.599f, -13.548f, -13.419f,
      -13.256f, -13.043f, -12.728f, -12.300f, -11.738f, -11.026f, -10.139f, -9.037f,  -7.640f,
      -5.743f,  -1.970f,  5.519f,   6.962f,   3.810f,   -3.686f,  -6.768f,  -8.591f,  -10.017f,
      -11.152f, -12.044f, -12.708f, -13.156f, -13.443f, -13.607f, -13.699f, -13.750f, -13.781f,
      -13.798f, -13.809f, -13.814f, -13.811f, -13.787f, -13.666f, -13.038f, -10.703f, -0.855f,
      3.518f,   1.215f,   -10.152f, -12.960f, -13.639f, -13.767f, -13.796f, -13.805f};
  std::vector<float> x(1200);
  for (std::size_t n = 0; n < x.size(); ++n) {
    const double t = static_cast<double>(n) / 16000.0, two_pi = 2.0 * std::numbers::pi;
    x[n] = static_cast<float>(0.5 * std::sin(two_pi * 440 * t) +
                              0.3 * std::sin(two_pi * 2500 * t + 0.3) +
                              0.05 * std::sin(two_pi * 6100 * t));
  }
  MelFeatures mel(FeatureOptions{});
  const std::vector<float> features = mel.log_mel(x);
  REQUIRE(features.size() == 6 * 80);
  const std::vector<float> row(features.begin() + 2 * 80, features.begin() + 3 * 80);
  // The printed reference has 3 decimals; the bands near the floor log(1e-6)
  // hold float32 rounding noise of the FFT.
  loom::test::require_close(row, std::vector<float>(expected, expected + 80), {.abs = 0.01},
                            "frame 2");
}

TEST_CASE("audio: per-utterance normalisation gives every band mean 0 and deviation 1", "[audio]") {
  MelFeatures mel(FeatureOptions{.mels = 40});
  const std::vector<float> features = mel.compute(noisy_tone(16000, 700, 11));
  const std::size_t frames = features.size() / 40;
  REQUIRE(frames == 98);
  for (std::size_t m = 0; m < 40; ++m) {
    double sum = 0, squares = 0;
    for (std::size_t t = 0; t < frames; ++t) sum += features[t * 40 + m];
    const double mean = sum / frames;
    for (std::size_t t = 0; t < frames; ++t)
      squares += (features[t * 40 + m] - mean) * (features[t * 40 + m] - mean);
    INFO("band " << m);
    CHECK(std::abs(mean) < 1e-5);
    CHECK(std::abs(std::sqrt(squares / frames) - 1.0) < 1e-4);
  }
  // A band constant over the utterance becomes 0, not a division by zero.
  std::vector<float> constant(10 * 2, 3.0f);
  MelFeatures::normalize_bands(constant, 2);
  CHECK(std::all_of(constant.begin(), constant.end(), [](float v) { return v == 0.0f; }));
}

TEST_CASE("audio: read_wav refuses another rate, stereo, a truncated WAV and a file that is no WAV",
          "[audio]") {
  TempDir dir;
  write_wav(dir.file("good.wav"), tone(800, 440));
  CHECK(read_wav(dir.file("good.wav")).size() == 800);

  write_wav(dir.file("fast.wav"), tone(800, 440), 22050);
  CHECK_THROWS_WITH(read_wav(dir.file("fast.wav")),
                    Contains("'" + dir.file("fast.wav") +
                             "' is sampled at 22050 Hz but 16000 Hz is "
                             "expected; loom does not resample") &&
                        Contains(" [") && Contains("audio.hpp:"));
  CHECK(read_wav(dir.file("fast.wav"), 22050).size() == 800);

  write_wav(dir.file("stereo.wav"), tone(800, 440), 16000, 2);
  CHECK_THROWS_WITH(read_wav(dir.file("stereo.wav")),
                    Contains("'" + dir.file("stereo.wav") + "' has 2 channels; only mono"));

  write_wav(dir.file("cut.wav"), tone(8000, 440));
  fs::resize_file(dir.file("cut.wav"), 1000);
  CHECK_THROWS_WITH(read_wav(dir.file("cut.wav")),
                    Contains("'" + dir.file("cut.wav") +
                             "' is truncated: libsndfile: 'data : 16000 "
                             "(should be 956)'"));

  write_text(dir.file("text.wav"), "not audio at all\n");
  CHECK_THROWS_WITH(read_wav(dir.file("text.wav")),
                    Contains("cannot read audio file '" + dir.file("text.wav") +
                             "': libsndfile: Format not recognised"));
  CHECK_THROWS_WITH(read_wav(dir.file("absent.wav")),
                    Contains("cannot read audio file '" + dir.file("absent.wav") +
                             "': libsndfile: System error : No such file or directory"));
}

TEST_CASE("audio: a broken listing is an error naming file:line and what is wrong", "[audio]") {
  TempDir dir;
  write_wav(dir.file("a.wav"), noisy_tone(4000, 500, 1));
  const std::string tsv = dir.file("list.tsv");
  const CorpusOptions options{.use_cache = false};

  write_text(tsv, "a.wav\tone two\na.wav one two\n");
  CHECK_THROWS_WITH(read_tsv_corpus(tsv, options),
                    Contains(tsv + ":2: no tab; each line must be 'path<TAB>transcript'"));

  write_text(tsv, "a.wav\tone two\n\na.wav\tone ten two\n");
  CHECK_THROWS_WITH(read_tsv_corpus(tsv, options),
                    Contains(tsv + ":3: transcript word 'ten' is not in the vocabulary (zero oh "
                                   "one two three four five six seven eight nine)"));

  write_text(tsv, "a.wav\t  \n");
  CHECK_THROWS_WITH(read_tsv_corpus(tsv, options),
                    Contains(tsv + ":1: the transcript of '" + dir.file("a.wav") + "' is empty"));
  // skip_bad_files skips files, never a broken listing.
  CHECK_THROWS_WITH(read_tsv_corpus(tsv, {.skip_bad_files = true, .use_cache = false}),
                    Contains(tsv + ":1: the transcript of"));

  CHECK_THROWS_WITH(read_tsv_corpus(dir.file("absent.tsv"), options),
                    Contains("cannot open corpus listing '" + dir.file("absent.tsv") + "'"));
}

TEST_CASE(
    "audio: bad files are errors naming file:line, or skipped and counted with skip_bad_files",
    "[audio]") {
  TempDir dir;
  write_wav(dir.file("good.wav"), noisy_tone(4000, 500, 1));   // 23 frames
  write_wav(dir.file("long.wav"), noisy_tone(16000, 500, 2));  // 98 frames
  write_wav(dir.file("short.wav"), noisy_tone(560, 500, 3));   // 2 frames
  write_wav(dir.file("fast.wav"), noisy_tone(4000, 500, 4), 8000);
  write_text(dir.file("text.wav"), "RIFF? no\n");
  const std::string tsv = dir.file("list.tsv");
  const CorpusOptions strict{.max_frames = 50, .use_cache = false};

  // Line 2 of a listing whose line 1 is good: the error names it.
  const auto line2_fails = [&](const std::string& line, const std::string& message) {
    write_text(tsv, "good.wav\tone\n" + line + "\n");
    CHECK_THROWS_WITH(read_tsv_corpus(tsv, strict), Contains(tsv + ":2: " + message));
  };
  line2_fails(
      "long.wav\tone two",
      "'" + dir.file("long.wav") + "' is 98 frames long, more than CorpusOptions::max_frames = 50");
  // "one one" needs a blank between the repeats: 3 frames, and the file has 2.
  line2_fails("short.wav\tone one", "'" + dir.file("short.wav") +
                                        "' has 2 frames (560 samples) but its 2 transcript words "
                                        "need at least 3 under CTC");
  line2_fails("fast.wav\tone", "audio file '" + dir.file("fast.wav") +
                                   "' is sampled at 8000 Hz but 16000 Hz is expected");
  line2_fails("text.wav\tone",
              "cannot read audio file '" + dir.file("text.wav") + "': libsndfile: ");
  write_text(tsv, "good.wav\tone\nshort.wav\tone two\n");
  CHECK(read_tsv_corpus(tsv, strict).utterances.size() == 2);

  // The first bad line in listing order is the one reported, whatever the threads did.
  write_text(tsv, "good.wav\tone\nfast.wav\tone\ntext.wav\ttwo\nlong.wav\tthree\n");
  CHECK_THROWS_WITH(read_tsv_corpus(tsv, strict), Contains(tsv + ":2: audio file"));

  write_text(tsv,
             "good.wav\tone\nfast.wav\tone\ntext.wav\ttwo\nlong.wav\tthree\nshort.wav\tone one\n"
             "absent.wav\tsix\ngood.wav\toh nine\n");
  CorpusOptions skipping = strict;
  skipping.skip_bad_files = true;
  const SpeechCorpus corpus = read_tsv_corpus(tsv, skipping);
  CHECK(corpus.skipped == 5);
  REQUIRE(corpus.utterances.size() == 2);
  CHECK(corpus.utterances[0].labels == std::vector<std::int32_t>{3});
  CHECK(corpus.utterances[1].labels == std::vector<std::int32_t>{2, 11});
  CHECK(corpus.utterances[1].path == dir.file("good.wav"));
  CHECK(corpus.utterances[1].frames == 23);
  CHECK(corpus.mels == 80);
}

TEST_CASE(
    "audio: features are cached, a second read computes nothing, a stale or corrupt cache "
    "is rebuilt",
    "[audio]") {
  TempDir dir;
  std::string listing;
  for (int i = 0; i < 6; ++i) {
    const std::string name = "u" + std::to_string(i) + ".wav";
    write_wav(dir.file(name),
              noisy_tone(3000 + 500 * static_cast<std::size_t>(i), 300.0 + 100 * i, i));
    listing += name + "\tone two three\n";
  }
  const std::string tsv = dir.file("list.tsv");
  write_text(tsv, listing);
  const CorpusOptions options{.features = {.mels = 40}};

  CorpusCacheReport report;
  const SpeechCorpus first = read_tsv_corpus(tsv, options, &report);
  CHECK_FALSE(report.hit);
  CHECK(report.computed == 6);
  CHECK(report.path == tsv + ".loom-features");
  CHECK(fs::exists(report.path));

  const SpeechCorpus second = read_tsv_corpus(tsv, options, &report);
  CHECK(report.hit);
  CHECK(report.computed == 0);
  REQUIRE(second.utterances.size() == 6);
  for (std::size_t i = 0; i < 6; ++i) {
    CHECK(second.utterances[i].path == first.utterances[i].path);
    CHECK(second.utterances[i].frames == first.utterances[i].frames);
    CHECK(second.utterances[i].labels == first.utterances[i].labels);
    CHECK(second.utterances[i].features == first.utterances[i].features);
  }

  // One flipped byte in the features: the checksum fails and the cache is rebuilt.
  {
    std::fstream file(report.path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(fs::file_size(report.path) / 2));
    const char byte = static_cast<char>(file.peek());
    file.seekp(static_cast<std::streamoff>(fs::file_size(report.path) / 2));
    file.put(static_cast<char>(byte ^ 0x10));
  }
  const SpeechCorpus rebuilt = read_tsv_corpus(tsv, options, &report);
  CHECK_FALSE(report.hit);
  CHECK(report.computed == 6);
  CHECK_THAT(report.note, Contains("is corrupt (its contents fail their checksum)"));
  CHECK(rebuilt.utterances[3].features == first.utterances[3].features);
  read_tsv_corpus(tsv, options, &report);
  CHECK(report.hit);

  // A cache cut short, and one written before a WAV changed, are rebuilt too.
  fs::resize_file(report.path, 100);
  read_tsv_corpus(tsv, options, &report);
  CHECK_FALSE(report.hit);
  CHECK_THAT(report.note, Contains("its size is not what its header says"));
  write_wav(dir.file("u2.wav"), noisy_tone(2000, 900, 9));
  const SpeechCorpus changed = read_tsv_corpus(tsv, options, &report);
  CHECK_FALSE(report.hit);
  CHECK_THAT(report.note, Contains("was written for other inputs or options"));
  CHECK(changed.utterances[2].frames == 11);

  // Other options: another cache key; a cache folder of its own.
  CorpusOptions elsewhere = options;
  elsewhere.cache_dir = dir.file("cache");
  elsewhere.threads = 3;
  const SpeechCorpus moved = read_tsv_corpus(tsv, elsewhere, &report);
  CHECK_FALSE(report.hit);
  CHECK(report.path.starts_with(dir.file("cache") + "/list.tsv-"));
  CHECK(moved.utterances[4].features == first.utterances[4].features);
  read_tsv_corpus(tsv, elsewhere, &report);
  CHECK(report.hit);
}

TEST_CASE("audio: spec_augment masks bands and spans drawn from (seed, epoch, index) alone",
          "[audio]") {
  const std::size_t frames = 60, mels = 40;
  const std::vector<float> original = loom::test::random_vector<float>(frames * mels, 5, 1.0, 2.0);
  const SpecAugmentOptions options{
      .frequency_masks = 2, .max_frequency_width = 8, .time_masks = 2, .max_time_width = 10};
  const auto masked = [&](std::uint64_t seed, std::size_t epoch, std::size_t index) {
    std::vector<float> x = original;
    spec_augment(x, frames, mels, options, seed, epoch, index);
    return x;
  };
  const std::vector<float> a = masked(7, 1, 3);
  CHECK(masked(7, 1, 3) == a);
  CHECK(masked(7, 2, 3) != a);
  CHECK(masked(7, 1, 4) != a);
  CHECK(masked(8, 1, 3) != a);

  // Every masked value lies in a whole masked band or a whole masked frame,
  // and there are at most 2 x 8 bands and 2 x 10 frames of them.
  std::size_t masked_bands = 0, masked_frames = 0, masked_values = 0;
  std::vector<bool> band(mels, true), frame(frames, true);
  for (std::size_t t = 0; t < frames; ++t)
    for (std::size_t m = 0; m < mels; ++m) {
      const bool zero = a[t * mels + m] == 0.0f;
      masked_values += zero;
      if (!zero) band[m] = frame[t] = false;
      if (!zero) CHECK(a[t * mels + m] == original[t * mels + m]);
    }
  masked_bands = static_cast<std::size_t>(std::count(band.begin(), band.end(), true));
  masked_frames = static_cast<std::size_t>(std::count(frame.begin(), frame.end(), true));
  CHECK(masked_bands <= 16);
  CHECK(masked_frames <= 20);
  CHECK(masked_values ==
        masked_bands * frames + masked_frames * mels - masked_bands * masked_frames);

  // Over many samples the widths reach their bounds and no further.
  std::size_t widest_band_run = 0;
  for (std::size_t index = 0; index < 200; ++index) {
    std::vector<float> x = original;
    spec_augment(x, frames, mels, {.frequency_masks = 1, .max_frequency_width = 8, .time_masks = 0},
                 7, 0, index);
    std::size_t run = 0;
    for (std::size_t m = 0; m < mels; ++m) run += x[m] == 0.0f;
    widest_band_run = std::max(widest_band_run, run);
  }
  CHECK(widest_band_run == 8);
  std::vector<float> wrong(10);
  CHECK_THROWS_WITH(spec_augment(wrong, 3, 4, options, 0, 0, 0),
                    Contains("spec_augment: 10 features given for 3 frames x 4 mels = 12"));
}

namespace {

// Utterances of the given frames over 3 mels, feature value = 100 * (u + 1) + t,
// transcript u + 1 words long (each word's label u % 11 + 1).
SpeechCorpus corpus_of(const std::vector<std::size_t>& frames) {
  SpeechCorpus corpus{.name = "toy.tsv", .mels = 3, .utterances = {}, .skipped = 0};
  for (std::size_t u = 0; u < frames.size(); ++u) {
    Utterance utterance{.path = "wav/" + std::to_string(u) + ".wav",
                        .frames = frames[u],
                        .features = {},
                        .labels = {}};
    for (std::size_t t = 0; t < frames[u]; ++t)
      for (std::size_t m = 0; m < 3; ++m)
        utterance.features.push_back(static_cast<float>(100 * (u + 1) + t));
    utterance.labels.assign(u + 1, static_cast<std::int32_t>(u % 11 + 1));
    corpus.utterances.push_back(std::move(utterance));
  }
  return corpus;
}

}  // namespace

TEST_CASE("audio: speech_dataset pads each utterance to max_frames and keeps its frames and labels",
          "[audio]") {
  const SpeechCorpus corpus = corpus_of({4, 2, 6});
  const Dataset set = speech_dataset(corpus, 6, digits_vocabulary().size() + 1);
  CHECK(set.name == "toy.tsv");
  CHECK(set.count == 3);
  CHECK(set.channels == 1);
  CHECK(set.height == 6);
  CHECK(set.width == 3);
  CHECK(set.classes == 12);
  CHECK(set.max_target == 3);
  CHECK(set.frames == std::vector<std::int32_t>{4, 2, 6});
  CHECK(set.target_lengths == std::vector<std::int32_t>{1, 2, 3});
  CHECK(set.targets == std::vector<std::int32_t>{1, 0, 0, 2, 2, 0, 3, 3, 3});
  CHECK(set.labels.empty());
  REQUIRE(set.images.size() == 3 * 6 * 3);
  for (std::size_t u = 0; u < 3; ++u)
    for (std::size_t t = 0; t < 6; ++t)
      for (std::size_t m = 0; m < 3; ++m) {
        INFO("utterance " << u << ", frame " << t << ", mel " << m);
        const float expected = t < static_cast<std::size_t>(set.frames[u])
                                   ? static_cast<float>(100 * (u + 1) + t)
                                   : 0.0f;
        CHECK(set.images[(u * 6 + t) * 3 + m] == expected);
      }
  CHECK_NOTHROW(check_targets(set));
}

TEST_CASE("audio: speech_dataset refuses an utterance past max_frames, naming its file and frames",
          "[audio]") {
  const SpeechCorpus corpus = corpus_of({4, 7, 2});
  CHECK_THROWS_WITH(speech_dataset(corpus, 6, 12),
                    Contains("speech_dataset: 'wav/1.wav' is 7 frames long; samples of corpus "
                             "'toy.tsv' hold 1..6 (max_frames)"));
  CHECK_NOTHROW(speech_dataset(corpus, 7, 12));
  // Labels beyond the classes: the vocabulary and the classes disagree.
  CHECK_THROWS_WITH(speech_dataset(corpus_of({3, 3, 3}), 3, 3),
                    Contains("'wav/2.wav' has label 3; expected 1..2 for 3 classes"));
  CHECK_THROWS_WITH(speech_dataset(corpus, 0, 12), Contains("max_frames is 0"));
}

#ifdef LOOM_DIGITS_SMOKE_DIR
// Run by CTest after scripts/make-digits-corpus has written the corpus
// (tests/unit/CMakeLists.txt); hidden from the discovered tests.
TEST_CASE("audio: the corpus scripts/make-digits-corpus writes reads back whole", "[.][digits]") {
  const std::string dir = LOOM_DIGITS_SMOKE_DIR;
  const Vocabulary vocabulary = digits_vocabulary();
  for (const auto& [split, count] : {std::pair{"train", 40}, std::pair{"test", 10}}) {
    const SpeechCorpus corpus = read_tsv_corpus(dir + "/" + split + ".tsv", {.use_cache = false});
    CHECK(corpus.skipped == 0);
    CHECK(corpus.mels == 80);
    REQUIRE(corpus.utterances.size() == static_cast<std::size_t>(count));
    for (const Utterance& u : corpus.utterances) {
      CHECK(u.labels.size() >= 1);
      CHECK(u.labels.size() <= 7);
      CHECK(u.features.size() == u.frames * 80);
      CHECK(u.frames >= 30);  // at least 0.3 s: one word at 220 words a minute
      CHECK(u.frames <= 1000);
      CHECK(std::all_of(u.labels.begin(), u.labels.end(),
                        [&](std::int32_t l) { return l >= 1 && l <= 11; }));
    }
    const Dataset set = speech_dataset(corpus, 1000, vocabulary.size() + 1);
    CHECK(set.count == static_cast<std::size_t>(count));
    CHECK(set.classes == 12);
    CHECK_NOTHROW(check_targets(set));
  }
}
#endif
