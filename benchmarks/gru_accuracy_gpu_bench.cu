// Wall time to issue 7's sequence-model bar on one GPU: the GRU example's
// network and recipe (rows of the image as a sequence, to 88 % test
// accuracy: batch 64, SGD lr 0.05 momentum 0.9, 10x lower after epoch 7);
// the loop, the timing and the JSON line are accuracy_gpu_bench.cuh's. (No
// ResNet-20 counterpart yet: nvcc's front end takes over 10 minutes on a
// ResNet-20's CPU Model alone, which g++ compiles in 8 s, so it cannot be
// built on the GPU machine in time.)
//
// First, the network's GRU layer alone, forward and backward on the first
// training images' rows, on cuDNN's RNN (what the trainer runs) and on
// loom's own step-by-step runner (used inside Residual blocks), in the same
// run: "gru_layer_step" lines per batch, cuDNN's as library "loom" and the
// step runner's as "loom-step-runner", the peer scripts/gpu-check divides by.
#include <loom/gpu/cudnn_rnn.cuh>
#include <loom/gpu/recurrent.cuh>

#include "accuracy_gpu_bench.cuh"

using RowGru = loom::Sequential<loom::Input<1, 28, 28>, loom::Reshape<28, 28>, loom::GRU<128>,
                                loom::Linear<64>, loom::ReLU, loom::Linear<10>>;

namespace {

using Gru = loom::Bind<loom::GRU<128>, loom::Shape<28, 28>, 1>;

// The median milliseconds of one forward and backward of Runner's GRU over
// the first n images (FP32, FMA math, as the trainer's default).
template <class Runner>
loom::bench::StepTimes time_gru_layer(const loom::data::Dataset& train, std::size_t n, int steps) {
  loom::gpu::DeviceContext context;
  Runner runner(context, n, std::size_t{256} << 20, false);
  std::vector<float> params(Gru::param_count);
  Gru::init(params.data(), 1, false);
  std::size_t saved = n * Gru::saved;
  if constexpr (requires { runner.saved_floats(); }) saved = runner.saved_floats();
  const auto device = [](std::size_t count, const char* what) {
    return loom::gpu::DeviceBuffer<float>(count, what);
  };
  auto weights = device(Gru::param_count, "weights"), grads = device(Gru::param_count, "grads");
  auto x = device(n * Gru::input_shape::size, "x"), dx = device(n * Gru::input_shape::size, "dx");
  auto y = device(n * Gru::output_shape::size, "y"), dy = device(n * Gru::output_shape::size, "dy");
  auto saved_area = device(saved, "saved");
  loom::gpu::DeviceBuffer<unsigned char> scratch(runner.scratch_bytes(), "scratch");
  LOOM_CUDA_CHECK(cudaMemcpy(weights.data(), params.data(), params.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  LOOM_CUDA_CHECK(cudaMemcpy(x.data(), train.images.data(), x.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  const std::vector<float> ones(dy.size(), 1.0f / static_cast<float>(n));
  LOOM_CUDA_CHECK(
      cudaMemcpy(dy.data(), ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
  // The runner's stream does not wait for the legacy stream's copies.
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  loom::gpu::detail::LayerCall c;
  c.weights = weights.data();
  c.bias = weights.data() + Gru::weight_count;
  c.dweights = grads.data();
  c.dbias = grads.data() + Gru::weight_count;
  c.x = x.data();
  c.y = y.data();
  c.dy = dy.data();
  c.dx = dx.data();
  c.saved = saved_area.data();
  c.scratch = scratch.data();
  c.scratch_bytes = scratch.size();
  c.stream = context.stream.get();
  c.training = true;
  return loom::bench::time_gpu_steps(c.stream, 5, steps, [&](int) {
    runner.forward(c);
    runner.backward(c);
  });
}

void compare_gru_runners(const loom::data::Dataset& train) {
  for (const std::size_t n : {std::size_t{64}, std::size_t{256}}) {
    const auto cudnn = time_gru_layer<loom::gpu::CudnnRecurrentRunner<Gru>>(train, n, 50);
    const auto loom_runner = time_gru_layer<loom::gpu::RecurrentRunner<Gru>>(train, n, 50);
    for (const bool on_cudnn : {true, false}) {
      const nlohmann::json line{{"benchmark", "gru_layer_step"},
                                {"library", on_cudnn ? "loom" : "loom-step-runner"},
                                {"runner", on_cudnn ? "cudnn" : "recurrent.cuh"},
                                {"batch", n},
                                {"steps", 28},
                                {"features", 28},
                                {"hidden", 128},
                                {"metric", "median_ms"},
                                {"value", on_cudnn ? cudnn.median_ms : loom_runner.median_ms},
                                {"higher_is_better", false},
                                {"precision", "fp32"},
                                {"data", "fashion-mnist"},
                                {"device", loom::bench::gpu_name()}};
      std::cout << line.dump() << std::endl;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Training time of the GRU example's network to its Fashion-MNIST test accuracy "
               "bar on one GPU (JSON line)"};
  loom::bench::AccuracyRecipe recipe{
      .batch = 64, .lr = 0.05f, .milestones = {7}, .epochs = 10, .target = 0.88};
  loom::bench::add_accuracy_options(app, recipe);
  CLI11_PARSE(app, argc, argv);
  try {
    compare_gru_runners(loom::data::fashion_mnist(recipe.data_dir).train);
  } catch (const loom::Error& error) {
    std::cerr << error.what() << '\n';
    return 1;
  }
  return loom::bench::time_to_accuracy<RowGru>("gru_accuracy_gpu_bench", "row_gru_time_to_accuracy",
                                              recipe);
}
