// A c10d backend for simdev tensors that stages through gloo: copy to the host, run the host collective, copy the
// result back (the way a vendor library would be reached, minus the hardware). Registered from Python as
// torch.distributed.Backend "simgloo" for device "simdev", so init_process_group("cpu:gloo,simdev:simgloo") works.
#include "collective.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>

#include <mutex>

namespace simdev {
namespace {

using c10d::Work;
using Tensors = std::vector<at::Tensor>;

// Work that is already complete: the staged collective has run and its results are back on the device.
class DoneWork final : public Work {
 public:
  DoneWork(c10d::OpType type, Tensors outputs)
      : Work(-1, type),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(outputs));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

at::Tensor to_host(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }

Tensors to_host(const Tensors& ts) {
  Tensors out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(to_host(t));
  return out;
}

std::vector<Tensors> to_host(const std::vector<Tensors>& ts) {
  std::vector<Tensors> out;
  for (const auto& t : ts) out.push_back(to_host(t));
  return out;
}

void back(Tensors& dst, const Tensors& src) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}

void back(std::vector<Tensors>& dst, const std::vector<Tensors>& src) {
  for (size_t i = 0; i < dst.size(); ++i) back(dst[i], src[i]);
}

// Work of a posted point-to-point op. The host buffers stay alive until gloo's transfer completes; wait() waits on
// gloo's work and then copies a receive's host buffers onto the device. Posting and waiting are apart because
// torch's pipeline schedules post a batch of sends and receives (batch_isend_irecv) before waiting on any: a send
// that blocked until its peer received would wait on a peer that blocks in its own send.
class StagedWork final : public Work {
 public:
  StagedWork(c10d::OpType type, c10::intrusive_ptr<Work> host_work, Tensors host, Tensors device)
      : Work(-1, type),
        host_work_(std::move(host_work)),
        host_(std::move(host)),
        device_(std::move(device)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_;
  }
  bool isSuccess() const override { return host_work_->isSuccess(); }
  int sourceRank() const override { return host_work_->sourceRank(); }

  bool wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!finished_) {
      host_work_->wait(timeout);  // rethrows gloo's error or timeout
      // the copy is the transfer's write, not an op of the graph: the pipeline stage marks its receive buffer
      // requires_grad between posting the receive and waiting on it (gloo on the host writes such a buffer directly)
      at::NoGradGuard no_grad;
      back(device_, host_);
      finished_ = true;
      future_->markCompleted(c10::IValue(device_));
    }
    return true;
  }

  // completed by wait(): the copy onto the device runs on the waiting thread, not on one of gloo's
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<Work> host_work_;
  Tensors host_;
  Tensors device_;  // empty for a send: nothing comes back
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex mutex_;
  bool finished_ = false;
};

// host buffers shaped like `ts`, left unfilled (a receive overwrites them)
Tensors host_like(const Tensors& ts) {
  Tensors out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(at::empty(t.sizes(), t.options().device(at::kCPU)));
  return out;
}

c10::intrusive_ptr<Work> done(c10d::OpType type, Tensors outputs = {}) {
  return c10::make_intrusive<DoneWork>(type, std::move(outputs));
}

void run(const c10::intrusive_ptr<Work>& work) { work->wait(); }

// gloo has no AVG: reduce with SUM on the host and divide on the way back
c10d::AllreduceOptions host_allreduce(c10d::ReduceOp op, std::chrono::milliseconds timeout, bool* average) {
  c10d::AllreduceOptions ar;
  *average = op == c10d::ReduceOp::AVG;
  ar.reduceOp = *average ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
  ar.timeout = timeout;
  return ar;
}

}  // namespace

StagingBackend::StagingBackend(c10::intrusive_ptr<c10d::Backend> host, int rank, int size)
    : c10d::Backend(rank, size), host_(std::move(host)) {}

c10::intrusive_ptr<Work> StagingBackend::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  auto h = to_host(tensors);
  run(host_->broadcast(h, opts));
  back(tensors, h);
  return done(c10d::OpType::BROADCAST, tensors);
}

c10::intrusive_ptr<Work> StagingBackend::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  auto h = to_host(tensors);
  bool average = false;
  run(host_->allreduce(h, host_allreduce(opts.reduceOp, opts.timeout, &average)));
  if (average) {
    for (auto& t : h) t.div_(getSize());
  }
  back(tensors, h);
  return done(c10d::OpType::ALLREDUCE, tensors);
}

c10::intrusive_ptr<Work> StagingBackend::allreduce_coalesced(Tensors& tensors,
                                                             const c10d::AllreduceCoalescedOptions& opts) {
  c10d::AllreduceOptions one;
  one.reduceOp = opts.reduceOp;
  one.timeout = opts.timeout;
  for (auto& t : tensors) {
    Tensors single{t};
    allreduce(single, one);
  }
  return done(c10d::OpType::ALLREDUCE_COALESCED, tensors);
}

c10::intrusive_ptr<Work> StagingBackend::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  auto h = to_host(tensors);
  run(host_->reduce(h, opts));
  back(tensors, h);
  return done(c10d::OpType::REDUCE, tensors);
}

c10::intrusive_ptr<Work> StagingBackend::allgather(std::vector<Tensors>& outputs, Tensors& inputs,
                                                   const c10d::AllgatherOptions& opts) {
  auto ho = to_host(outputs);
  auto hi = to_host(inputs);
  run(host_->allgather(ho, hi, opts));
  back(outputs, ho);
  return done(c10d::OpType::ALLGATHER, outputs.empty() ? Tensors{} : outputs[0]);
}

c10::intrusive_ptr<Work> StagingBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                         const c10d::AllgatherOptions& opts) {
  // gather into per-rank host buffers, then write each into its slice of the device output
  Tensors in{to_host(input)};
  std::vector<Tensors> out(1);
  for (int r = 0; r < getSize(); ++r) out[0].push_back(at::empty_like(in[0]));
  run(host_->allgather(out, in, opts));
  output.view({getSize(), -1}).copy_(at::stack(out[0]).view({getSize(), -1}));
  return done(c10d::OpType::_ALLGATHER_BASE, {output});
}

c10::intrusive_ptr<Work> StagingBackend::allgather_coalesced(std::vector<Tensors>& outputs, Tensors& inputs,
                                                             const c10d::AllgatherOptions& opts) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<Tensors> o{outputs[i]};
    Tensors in{inputs[i]};
    allgather(o, in, opts);
  }
  return done(c10d::OpType::ALLGATHER_COALESCED);
}

c10::intrusive_ptr<Work> StagingBackend::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                         const c10d::AllgatherOptions& opts) {
  for (size_t i = 0; i < inputs.size(); ++i) _allgather_base(outputs[i], inputs[i], opts);
  return done(c10d::OpType::COALESCED, outputs);
}

c10::intrusive_ptr<Work> StagingBackend::gather(std::vector<Tensors>& outputs, Tensors& inputs,
                                                const c10d::GatherOptions& opts) {
  auto ho = to_host(outputs);
  auto hi = to_host(inputs);
  run(host_->gather(ho, hi, opts));
  back(outputs, ho);
  return done(c10d::OpType::GATHER);
}

c10::intrusive_ptr<Work> StagingBackend::scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                                 const c10d::ScatterOptions& opts) {
  auto ho = to_host(outputs);
  auto hi = to_host(inputs);
  run(host_->scatter(ho, hi, opts));
  back(outputs, ho);
  return done(c10d::OpType::SCATTER, outputs);
}

// reduce_scatter as an allreduce of the stacked inputs, keeping this rank's share: gloo on the host has no
// tensor-form reduce_scatter for every op, and the staged result is the same.
c10::intrusive_ptr<Work> StagingBackend::reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                                                        const c10d::ReduceScatterOptions& opts) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensors h{at::stack(to_host(inputs[i]))};
    bool average = false;
    run(host_->allreduce(h, host_allreduce(opts.reduceOp, opts.timeout, &average)));
    if (average) h[0].div_(getSize());
    outputs[i].copy_(h[0][getRank()]);
  }
  return done(c10d::OpType::REDUCE_SCATTER, outputs);
}

c10::intrusive_ptr<Work> StagingBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                              const c10d::ReduceScatterOptions& opts) {
  Tensors h{to_host(input)};
  bool average = false;
  run(host_->allreduce(h, host_allreduce(opts.reduceOp, opts.timeout, &average)));
  if (average) h[0].div_(getSize());
  output.copy_(h[0].view({getSize(), -1})[getRank()].view(output.sizes()));
  return done(c10d::OpType::_REDUCE_SCATTER_BASE, {output});
}

c10::intrusive_ptr<Work> StagingBackend::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                                         const c10d::ReduceScatterOptions& opts) {
  for (size_t i = 0; i < inputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
  return done(c10d::OpType::COALESCED, outputs);
}

c10::intrusive_ptr<Work> StagingBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                       std::vector<int64_t>& output_splits,
                                                       std::vector<int64_t>& input_splits,
                                                       const c10d::AllToAllOptions& opts) {
  at::Tensor hi = to_host(input);
  at::Tensor ho = to_host(output);
  run(host_->alltoall_base(ho, hi, output_splits, input_splits, opts));
  output.copy_(ho);
  return done(c10d::OpType::ALLTOALL_BASE, {output});
}

c10::intrusive_ptr<Work> StagingBackend::alltoall(Tensors& outputs, Tensors& inputs,
                                                  const c10d::AllToAllOptions& opts) {
  // as one alltoall_base over the flattened, concatenated tensors with per-rank splits
  Tensors flat_in, flat_out;
  std::vector<int64_t> in_splits, out_splits;
  for (auto& t : inputs) {
    flat_in.push_back(to_host(t).reshape(-1));
    in_splits.push_back(t.numel());
  }
  for (auto& t : outputs) out_splits.push_back(t.numel());
  at::Tensor hi = at::cat(flat_in);
  at::Tensor ho = at::empty({std::accumulate(out_splits.begin(), out_splits.end(), int64_t(0))}, hi.options());
  run(host_->alltoall_base(ho, hi, out_splits, in_splits, opts));
  int64_t at_ = 0;
  for (size_t i = 0; i < outputs.size(); ++i) {
    outputs[i].copy_(ho.narrow(0, at_, out_splits[i]).view(outputs[i].sizes()));
    at_ += out_splits[i];
  }
  return done(c10d::OpType::ALLTOALL, outputs);
}

c10::intrusive_ptr<Work> StagingBackend::send(Tensors& tensors, int dst, int tag) {
  auto h = to_host(tensors);
  auto work = host_->send(h, dst, tag);
  return c10::make_intrusive<StagedWork>(c10d::OpType::SEND, std::move(work), std::move(h), Tensors{});
}

c10::intrusive_ptr<Work> StagingBackend::recv(Tensors& tensors, int src, int tag) {
  auto h = host_like(tensors);
  auto work = host_->recv(h, src, tag);
  return c10::make_intrusive<StagedWork>(c10d::OpType::RECV, std::move(work), std::move(h), tensors);
}

c10::intrusive_ptr<Work> StagingBackend::recvAnysource(Tensors& tensors, int tag) {
  auto h = host_like(tensors);
  auto work = host_->recvAnysource(h, tag);
  return c10::make_intrusive<StagedWork>(c10d::OpType::RECVANYSOURCE, std::move(work), std::move(h), tensors);
}

c10::intrusive_ptr<Work> StagingBackend::barrier(const c10d::BarrierOptions& opts) {
  run(host_->barrier(opts));
  return done(c10d::OpType::BARRIER);
}

}  // namespace simdev
