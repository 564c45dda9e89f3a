// SoftmaxCrossEntropy over a class per position: the loss says what it
// trains and which loss trains the other.
#include <loom/loom.hpp>

using namespace loom;

using Net = Sequential<Input<6, 8>, Linear<5>>;
#ifdef LOOM_COMPILE_FAIL
using Loss = SoftmaxCrossEntropy;
#else
using Loss = PositionCrossEntropy;
#endif

int main() { return Trainer<Net, SingleDevice, SGD, Loss>::classes == 5 ? 0 : 1; }
