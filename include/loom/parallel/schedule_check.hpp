// Pipeline schedules checked before they run. From a schedule generator (the
// order of passes each stage runs) this derives each stage's ordered sends
// and receives, checks that every pair of neighbouring stages sends and
// receives them in the same order, and simulates the whole pipeline with
// every transfer a rendezvous, as NCCL's send/recv are (a send may wait
// until its receive is posted, and a graph-captured exchange must match on
// both ends). A schedule that fails would deadlock a GPU pipeline, or pair
// one micro-batch's activations with another's. Megatron-LM meets such
// schedules only in CI (Megatron-LM#5100); loom refuses them at compile
// time (schedule.hpp: the policies' schedules) or with a loom::Error before
// a step runs (check_pipeline_schedule, a schedule chosen at run time).
//
// Transfers: stage k's forward of micro-batch i receives its input from
// stage k - 1 (k > 0) and sends its output to k + 1 (k < S - 1); a backward
// receives its gradient from k + 1 (k < S - 1) and sends one to k - 1
// (k > 0). The send that ends a pass and the receive that starts the
// stage's next pass are posted together, one NCCL group, as Megatron's
// send_forward_recv_backward: each of the group's transfers completes when
// its peer has posted the matching one, and the stage goes on when all have.
// Posted one at a time instead, 1F1B deadlocks for every S, M >= 2: in its
// steady state stage k sends an activation while stage k + 1 sends a
// gradient back, and neither posts the receive the other waits for.
//
// A schedule generator is a type with
//   template <class F>
//   static constexpr void for_each_op(std::size_t stages, std::size_t stage,
//                                     std::size_t micro_batches, F&& f);
// calling f(PipelineOp) for each pass stage `stage` runs, in order
// (schedule.hpp: BuiltinSchedule<PipelineKind::gpipe>, <one_f_one_b>).
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <vector>

#include "../core/meta.hpp"

namespace loom {

struct PipelineOp {
  bool forward = true;
  std::size_t micro_batch = 0;
};

enum class PipelineTransfer : unsigned char {
  receive_activation,
  send_activation,
  receive_gradient,
  send_gradient
};

// One send or receive of a stage. Its group is posted between the stage's
// passes group - 1 and group.
struct PipelineComm {
  PipelineTransfer transfer = PipelineTransfer::receive_activation;
  std::size_t micro_batch = 0;
  std::size_t group = 0;
};

constexpr const char* pipeline_transfer_name(PipelineTransfer transfer) {
  switch (transfer) {
    case PipelineTransfer::receive_activation: return "receives the activation";
    case PipelineTransfer::send_activation: return "sends the activation";
    case PipelineTransfer::receive_gradient: return "receives the gradient";
    case PipelineTransfer::send_gradient: return "sends the gradient";
  }
  return "";
}

// The stage at the other end of `stage`'s transfer.
constexpr std::size_t pipeline_peer(PipelineTransfer transfer, std::size_t stage) {
  return transfer == PipelineTransfer::receive_activation ||
                 transfer == PipelineTransfer::send_gradient
             ? stage - 1
             : stage + 1;
}

// What the peer posts for it: the receive of a send, the send of a receive.
constexpr PipelineTransfer matching_transfer(PipelineTransfer transfer) {
  switch (transfer) {
    case PipelineTransfer::receive_activation: return PipelineTransfer::send_activation;
    case PipelineTransfer::send_activation: return PipelineTransfer::receive_activation;
    case PipelineTransfer::receive_gradient: return PipelineTransfer::send_gradient;
    case PipelineTransfer::send_gradient: return PipelineTransfer::receive_gradient;
  }
  return transfer;
}

// Calls f(PipelineComm) for the transfers of `stage`'s pass number `pass`
// (its receive, then its send), in the order the stage posts them.
template <class F>
constexpr void for_each_pass_comm(std::size_t stages, std::size_t stage, PipelineOp op,
                                  std::size_t pass, F&& f) {
  const bool from_before = op.forward ? stage > 0 : stage + 1 < stages;
  const bool to_after = op.forward ? stage + 1 < stages : stage > 0;
  if (from_before)
    f(PipelineComm{op.forward ? PipelineTransfer::receive_activation
                              : PipelineTransfer::receive_gradient,
                   op.micro_batch, pass});
  if (to_after)
    f(PipelineComm{op.forward ? PipelineTransfer::send_activation : PipelineTransfer::send_gradient,
                   op.micro_batch, pass + 1});
}

// Calls f(PipelineComm) for each transfer stage `stage` of `stages` posts
// under Generator over `micro_batches`, in order.
template <class Generator, class F>
constexpr void for_each_pipeline_comm(std::size_t stages, std::size_t stage,
                                      std::size_t micro_batches, F&& f) {
  std::size_t pass = 0;
  Generator::for_each_op(stages, stage, micro_batches, [&](PipelineOp op) {
    for_each_pass_comm(stages, stage, op, pass++, f);
  });
}

enum class PipelineScheduleFault : unsigned char {
  none,
  malformed,     // a stage does not run each micro-batch's forward once, then its backward once
  out_of_order,  // a stage receives micro-batches in another order than its peer sends them
  deadlock       // every stage left waits on a transfer its peer has not posted
};

// The first fault found, in that order of checks: `stage`'s `op` (malformed:
// its pass; else its transfer, numbered in the stage's list) with
// `micro_batch`; out_of_order: `peer_micro_batch` is what the peer sends in
// its place.
struct PipelineScheduleCheck {
  PipelineScheduleFault fault = PipelineScheduleFault::none;
  std::size_t stage = 0;
  std::size_t op = 0;
  PipelineTransfer transfer = PipelineTransfer::receive_activation;
  std::size_t micro_batch = 0;
  std::size_t peer_micro_batch = 0;

  constexpr bool ok() const { return fault == PipelineScheduleFault::none; }
};

// What a check found, after the schedule's name in a loom::Error: "deadlocks:
// stage 2's transfer 5 (receives the gradient of micro-batch 0) waits on
// stage 3, itself stuck before posting its match".
inline std::string describe(const PipelineScheduleCheck& r) {
  const std::string stage = "stage " + std::to_string(r.stage);
  const std::string micro = "micro-batch " + std::to_string(r.micro_batch);
  const std::string transfer = stage + "'s transfer " + std::to_string(r.op) + " (" +
                               pipeline_transfer_name(r.transfer) + " of " + micro + ")";
  const std::string peer = "stage " + std::to_string(pipeline_peer(r.transfer, r.stage));
  switch (r.fault) {
    case PipelineScheduleFault::none: return "completes";
    case PipelineScheduleFault::malformed:
      return "is malformed: " + stage + "'s pass " + std::to_string(r.op) + " does not run " +
             micro + "'s forward once and then its backward once";
    case PipelineScheduleFault::out_of_order:
      return "sends and receives out of order: " + transfer + " meets " + peer +
             "'s of micro-batch " + std::to_string(r.peer_micro_batch);
    case PipelineScheduleFault::deadlock:
      return "deadlocks: " + transfer + " waits on " + peer + ", itself stuck before posting its match";
  }
  return "";
}

namespace detail {

// The check's memory: std::arrays at compile time, vectors at run time.
// Plain pointers: g++ counts a std::span access as tens of constexpr
// operations, and its limit (-fconstexpr-ops-limit, 2^25) bounds the
// pipelines a policy can check.
struct ScheduleBuffers {
  PipelineComm* comms;    // stages * 4 * micro-batches: stage k's from begin[k]
  std::size_t* begin;     // stages + 1
  std::size_t* cursor;    // stages: each stage's first transfer of its current group
  unsigned char* done;    // per transfer: matched
  unsigned char* passes;  // micro-batches: a stage's passes of each so far
};

// Derives each stage's transfers into `b`, checking as it goes that the
// stage runs each micro-batch's forward once and then its backward once.
template <class Generator>
constexpr PipelineScheduleCheck derive_transfers(std::size_t stages, std::size_t micro_batches,
                                                 const ScheduleBuffers& b) {
  PipelineScheduleCheck fault;
  std::size_t end = 0;
  for (std::size_t k = 0; k < stages; ++k) {
    b.begin[k] = end;
    for (std::size_t i = 0; i < micro_batches; ++i) b.passes[i] = 0;
    std::size_t pass = 0;
    Generator::for_each_op(stages, k, micro_batches, [&](PipelineOp op) {
      const std::size_t i = op.micro_batch;
      if (fault.ok() && (i >= micro_batches || b.passes[i] != (op.forward ? 0 : 1)))
        fault = {PipelineScheduleFault::malformed, k, pass, {}, i, 0};
      if (fault.ok()) {
        b.passes[i] = op.forward ? 1 : 2;
        for_each_pass_comm(stages, k, op, pass, [&](PipelineComm c) { b.comms[end++] = c; });
      }
      ++pass;
    });
    for (std::size_t i = 0; i < micro_batches && fault.ok(); ++i)
      if (b.passes[i] != 2) fault = {PipelineScheduleFault::malformed, k, pass, {}, i, 0};
    if (!fault.ok()) return fault;
  }
  b.begin[stages] = end;
  return fault;
}

constexpr std::size_t next_transfer(const PipelineComm* comms, std::size_t from,
                                    std::size_t end, PipelineTransfer transfer) {
  while (from < end && comms[from].transfer != transfer) ++from;
  return from;
}

// Stage `receiver` receives `transfer` in the order `sender` sends them
// (both post one per micro-batch: derive_transfers has checked that).
constexpr PipelineScheduleCheck check_order(std::size_t receiver, std::size_t sender,
                                            PipelineTransfer transfer,
                                            std::size_t micro_batches,
                                            const ScheduleBuffers& b) {
  const PipelineTransfer send = matching_transfer(transfer);
  std::size_t r = b.begin[receiver], s = b.begin[sender];
  for (std::size_t n = 0; n < micro_batches; ++n, ++r, ++s) {
    r = next_transfer(b.comms, r, b.begin[receiver + 1], transfer);
    s = next_transfer(b.comms, s, b.begin[sender + 1], send);
    if (b.comms[r].micro_batch != b.comms[s].micro_batch)
      return {PipelineScheduleFault::out_of_order, receiver, r - b.begin[receiver], transfer,
              b.comms[r].micro_batch, b.comms[s].micro_batch};
  }
  return {};
}

// The first transfer of stage k's current group: its group ends where the
// next begins.
constexpr std::size_t group_end(const ScheduleBuffers& b, std::size_t k) {
  std::size_t i = b.cursor[k];
  while (i < b.begin[k + 1] && b.comms[i].group == b.comms[b.cursor[k]].group) ++i;
  return i;
}

// Every stage posts its current group; a transfer completes when its peer's
// current group holds the matching one, and a stage whose group has
// completed posts its next. Runs until every stage is done or none moves.
constexpr PipelineScheduleCheck simulate(std::size_t stages, const ScheduleBuffers& b) {
  for (std::size_t k = 0; k < stages; ++k) b.cursor[k] = b.begin[k];
  for (std::size_t i = 0; i < b.begin[stages]; ++i) b.done[i] = 0;
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t k = 0; k < stages; ++k) {
      if (b.cursor[k] == b.begin[k + 1]) continue;
      const std::size_t end = group_end(b, k);
      bool complete = true;
      for (std::size_t i = b.cursor[k]; i < end; ++i) {
        if (b.done[i]) continue;
        const std::size_t peer = pipeline_peer(b.comms[i].transfer, k);
        const std::size_t peer_end = group_end(b, peer);
        std::size_t j = b.cursor[peer];
        while (j < peer_end &&
               (b.done[j] || b.comms[j].transfer != matching_transfer(b.comms[i].transfer) ||
                b.comms[j].micro_batch != b.comms[i].micro_batch))
          ++j;
        if (j < peer_end) {
          b.done[i] = b.done[j] = 1;
        } else {
          complete = false;
        }
      }
      if (complete) {
        b.cursor[k] = end;
        moved = true;
      }
    }
  }
  for (std::size_t k = 0; k < stages; ++k) {
    if (b.cursor[k] == b.begin[k + 1]) continue;
    std::size_t i = b.cursor[k];
    while (b.done[i]) ++i;
    return {PipelineScheduleFault::deadlock, k, i - b.begin[k], b.comms[i].transfer,
            b.comms[i].micro_batch, 0};
  }
  return {};
}

template <class Generator>
constexpr PipelineScheduleCheck check_schedule(std::size_t stages, std::size_t micro_batches,
                                               const ScheduleBuffers& b) {
  auto result = derive_transfers<Generator>(stages, micro_batches, b);
  for (std::size_t k = 0; k + 1 < stages && result.ok(); ++k) {
    result = check_order(k + 1, k, PipelineTransfer::receive_activation, micro_batches, b);
    if (result.ok())
      result = check_order(k, k + 1, PipelineTransfer::receive_gradient, micro_batches, b);
  }
  return result.ok() ? simulate(stages, b) : result;
}

}  // namespace detail

// Generator's schedule over Stages stages and MicroBatches micro-batches,
// checked at compile time.
template <class Generator, std::size_t Stages, std::size_t MicroBatches>
constexpr PipelineScheduleCheck pipeline_schedule_check() {
  static_assert(Stages >= 1 && MicroBatches >= 1,
                "pipeline_schedule_check: a pipeline has at least one stage and one micro-batch");
  constexpr std::size_t transfers = Stages * 4 * MicroBatches;
  std::array<PipelineComm, transfers> comms{};
  std::array<std::size_t, Stages + 1> begin{};
  std::array<std::size_t, Stages> cursor{};
  std::array<unsigned char, transfers> done{};
  std::array<unsigned char, MicroBatches> passes{};
  return detail::check_schedule<Generator>(
      Stages, MicroBatches,
      {comms.data(), begin.data(), cursor.data(), done.data(), passes.data()});
}

// The same at run time (stages, micro_batches >= 1).
template <class Generator>
PipelineScheduleCheck pipeline_schedule_check(std::size_t stages, std::size_t micro_batches) {
  const std::size_t transfers = stages * 4 * micro_batches;
  std::vector<PipelineComm> comms(transfers);
  std::vector<std::size_t> begin(stages + 1), cursor(stages);
  std::vector<unsigned char> done(transfers), passes(micro_batches);
  return detail::check_schedule<Generator>(
      stages, micro_batches,
      {comms.data(), begin.data(), cursor.data(), done.data(), passes.data()});
}

// The compiler's messages for a schedule that fails, with the failing
// stage, op and micro-batch in their template arguments.
template <class Generator, std::size_t Stages, std::size_t MicroBatches, std::size_t Stage,
          std::size_t Pass, std::size_t MicroBatch>
struct pipeline_schedule_malformed {
  static_assert(dependent_false<Generator>,
                "loom pipeline schedule check: stage Stage's pass number Pass does not run "
                "micro-batch MicroBatch's forward once and then its backward once");
};

template <class Generator, std::size_t Stages, std::size_t MicroBatches, std::size_t Stage,
          std::size_t Op, PipelineTransfer Transfer, std::size_t MicroBatch,
          std::size_t PeerMicroBatch>
struct pipeline_schedule_out_of_order {
  static_assert(dependent_false<Generator>,
                "loom pipeline schedule check: stage Stage's transfer number Op receives "
                "micro-batch MicroBatch where its peer sends micro-batch PeerMicroBatch: the "
                "neighbouring stages send and receive in different orders");
};

template <class Generator, std::size_t Stages, std::size_t MicroBatches, std::size_t Stage,
          std::size_t Op, PipelineTransfer Transfer, std::size_t MicroBatch>
struct pipeline_schedule_deadlocks {
  static_assert(dependent_false<Generator>,
                "loom pipeline schedule check: the pipeline deadlocks, stage Stage waiting on its "
                "transfer number Op (Transfer, micro-batch MicroBatch), which its peer never "
                "posts while it waits");
};

// True for a schedule that completes; one that does not fails to compile
// with one of the messages above.
template <class Generator, std::size_t Stages, std::size_t MicroBatches>
constexpr bool pipeline_schedule_holds() {
  constexpr PipelineScheduleCheck r = pipeline_schedule_check<Generator, Stages, MicroBatches>();
  if constexpr (r.fault == PipelineScheduleFault::malformed)
    return sizeof(pipeline_schedule_malformed<Generator, Stages, MicroBatches, r.stage, r.op,
                                              r.micro_batch>) == 0;
  else if constexpr (r.fault == PipelineScheduleFault::out_of_order)
    return sizeof(pipeline_schedule_out_of_order<Generator, Stages, MicroBatches, r.stage, r.op,
                                                 r.transfer, r.micro_batch,
                                                 r.peer_micro_batch>) == 0;
  else if constexpr (r.fault == PipelineScheduleFault::deadlock)
    return sizeof(pipeline_schedule_deadlocks<Generator, Stages, MicroBatches, r.stage, r.op,
                                              r.transfer, r.micro_batch>) == 0;
  else
    return true;
}

}  // namespace loom
