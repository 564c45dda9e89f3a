// The speech example's network, named once for the example and its
// benchmark against PyTorch (benchmarks/speech_bench.cpp).
#pragma once

#include <cstddef>
#include <loom/loom.hpp>

namespace loom::examples {

// 4.48 s of frames: the longest utterance of scripts/make-digits-corpus's
// default corpus is 4.37 s (7 digits at the slowest speed, with its silences).
inline constexpr std::size_t speech_frames = 448, speech_mels = 80;
inline constexpr std::size_t speech_classes = 12;  // CTC's blank and zero, oh, one ... nine

// A Conv1d front end halving the frames, BatchNorm over time, two
// bidirectional GRU layers and a Linear per frame into CTC.
using DigitReader = Sequential<Input<speech_frames, speech_mels>,                //
                               Conv1d<128, 5, 2, 2>, BatchNorm1d, ReLU,          //
                               BiGRU<96>, BiGRU<96>,                             //
                               Linear<speech_classes>>;
static_assert(DigitReader::output_shape::dims[0] == speech_frames / 2);
static_assert(DigitReader::output_shape::dims[1] == speech_classes);

}  // namespace loom::examples
