// The staging c10d backend of simdev (see collective.cpp).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <numeric>
#include <string>
#include <vector>

namespace simdev {

class StagingBackend final : public c10d::Backend {
 public:
  // `host` is the gloo backend that carries the bytes between processes.
  StagingBackend(c10::intrusive_ptr<c10d::Backend> host, int rank, int size);
  const std::string getBackendName() const override { return "simgloo"; }

  using Tensors = std::vector<at::Tensor>;
  c10::intrusive_ptr<c10d::Work> broadcast(Tensors&, const c10d::BroadcastOptions&) override;
  c10::intrusive_ptr<c10d::Work> allreduce(Tensors&, const c10d::AllreduceOptions&) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(Tensors&, const c10d::AllreduceCoalescedOptions&) override;
  c10::intrusive_ptr<c10d::Work> reduce(Tensors&, const c10d::ReduceOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<Tensors>&, Tensors&, const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor&, at::Tensor&, const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<Tensors>&, Tensors&,
                                                     const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(Tensors&, Tensors&,
                                                                 const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<Tensors>&, Tensors&, const c10d::GatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> scatter(Tensors&, std::vector<Tensors>&, const c10d::ScatterOptions&) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(Tensors&, std::vector<Tensors>&,
                                                const c10d::ReduceScatterOptions&) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor&, at::Tensor&,
                                                      const c10d::ReduceScatterOptions&) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(Tensors&, Tensors&,
                                                                 const c10d::ReduceScatterOptions&) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override;
  c10::intrusive_ptr<c10d::Work> alltoall(Tensors&, Tensors&, const c10d::AllToAllOptions&) override;
  c10::intrusive_ptr<c10d::Work> send(Tensors&, int, int) override;
  c10::intrusive_ptr<c10d::Work> recv(Tensors&, int, int) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(Tensors&, int) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override;

 private:
  c10::intrusive_ptr<c10d::Backend> host_;
};

}  // namespace simdev
