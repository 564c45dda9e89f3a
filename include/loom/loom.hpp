// loom: include this one header. Compiled by a host compiler it gives the
// CPU backend; the CUDA backend joins when compiled by nvcc.
#pragma once

#include "backend/cpu/cpu.hpp"
#include "comm/communicator.hpp"
#include "comm/local_comm.hpp"
#include "core/activation.hpp"
#include "core/arena.hpp"
#include "core/device.hpp"
#include "core/error.hpp"
#include "core/meta.hpp"
#include "core/rng.hpp"
#include "core/shape.hpp"
#include "data/data.hpp"
#include "io/safetensors.hpp"
#include "layers/layers.hpp"
#include "loss/softmax_cross_entropy.hpp"
#include "net/block.hpp"
#include "net/fusion.hpp"
#include "net/model.hpp"
#include "net/residual.hpp"
#include "net/sequential.hpp"
#include "net/tensors.hpp"
#include "net/transformer.hpp"
#include "optim/adam.hpp"
#include "optim/any_optimizer.hpp"
#include "optim/clip.hpp"
#include "optim/lr_schedule.hpp"
#include "optim/sgd.hpp"
#include "parallel/buckets.hpp"
#include "parallel/data_parallel.hpp"
#include "parallel/hybrid.hpp"
#include "parallel/model_split.hpp"
#include "parallel/partition.hpp"
#include "parallel/schedule.hpp"
#include "parallel/single_device.hpp"
#include "parallel/tensor_parallel.hpp"
#include "train/batch_size.hpp"
#include "train/callbacks.hpp"
#include "train/stop_on_signal.hpp"
#include "train/trainer.hpp"

// Compiled by nvcc: the CUDA executor, with which Trainers run on GPUs,
// and NCCL's communicator.
#if defined(__CUDACC__)
#include "comm/nccl_comm.hpp"
#include "gpu/trainer_executor.cuh"
#endif

// With loom::mpi (Open MPI): dist::Environment and MpiComm.
#if defined(LOOM_WITH_MPI)
#include "comm/mpi.hpp"
#endif
