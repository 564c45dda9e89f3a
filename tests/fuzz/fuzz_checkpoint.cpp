// Fuzz target: checkpoint loading on any bytes, for a small LeNet-like
// network trained with SGD and momentum. On top of the safetensors parse it
// checks names, shapes, dtypes, the optimizer's buffers and options and the
// metadata's numbers. The reader is called directly, since Trainer::load
// turns every exception into a loom::Error (for its processes to agree) and
// would hide the other kinds; a file the reader accepts must then load into
// a trainer bit for bit.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint_net.hpp"
#include "fuzz.hpp"

namespace {

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

}  // namespace

loom::fuzz::Outcome loom::fuzz::run(std::span<const std::uint8_t> bytes) {
  // One trainer for the process: building one per input would cost more than
  // the load.
  static CheckpointTrainer trainer = make_checkpoint_trainer();
  static const std::vector<std::string> buffers{std::string(trainer.optimizer().buffer_name(0))};
  static const auto options = trainer.optimizer().options().hyperparameters();
  const std::string& path = scratch_file(bytes);
  return outcome_of([&] {
    const auto image = detail::read_checkpoint(path, SGD::name, buffers, options,
                                               tensor_table<CheckpointNet>(),
                                               CheckpointNet::parameter_count,
                                               CheckpointNet::state_count);
    detail::check_resumed_options(image, options, path);  // load() resumes
    LOOM_FUZZ_REQUIRE(outcome_of([&] { trainer.load(path); }) == Outcome::parsed);
    LOOM_FUZZ_REQUIRE(same_bits(trainer.model().parameters(), image.parameters));
    LOOM_FUZZ_REQUIRE(same_bits(trainer.model().state(), image.state));
    LOOM_FUZZ_REQUIRE(same_bits(trainer.optimizer().buffer(0), image.buffers.at(0)));
    LOOM_FUZZ_REQUIRE(trainer.steps() == image.steps);
    LOOM_FUZZ_REQUIRE(trainer.nonfinite_steps() == image.nonfinite_steps);
  });
}
