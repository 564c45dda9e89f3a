// A speech front end whose second Conv1d spans more frames than the first
// leaves: 16 frames at stride 2 give 7, and 3 taps 4 frames apart span 9.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<16, 8>, Conv1d<32, 3, 2>, ReLU, Conv1d<32, 3, 1, 0, 4>, Linear<5>>;
#else
using Net = Sequential<Input<16, 8>, Conv1d<32, 3, 2>, ReLU, Conv1d<32, 3, 1, 0, 2>, Linear<5>>;
#endif

int main() { return Net::parameter_count > 0 ? 0 : 1; }
