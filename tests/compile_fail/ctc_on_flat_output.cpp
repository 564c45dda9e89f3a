// CTCLoss over one vector of scores per sample: it needs a score per frame.
#include <loom/loom.hpp>

using namespace loom;

#ifdef LOOM_COMPILE_FAIL
using Net = Sequential<Input<6, 8>, Flatten, Linear<5>>;
#else
using Net = Sequential<Input<6, 8>, Linear<5>>;
#endif

int main() { return Trainer<Net, SingleDevice, SGD, CTCLoss>::classes == 5 ? 0 : 1; }
