#include "engine/dist_communicator.h"

#include "dist/process_group.h"

namespace memrt {
namespace {

class DistCommunicator final : public Communicator {
 public:
  explicit DistCommunicator(std::shared_ptr<DistContext> dist) : dist_(std::move(dist)) {}

  int rank() const override { return dist_ ? dist_->rank() : 0; }
  int world_size() const override { return dist_ ? dist_->world_size() : 1; }

  void all_reduce_sum(at::Tensor& t) override {
    if (multi()) dist_->all_reduce_sum(t);
  }
  void all_reduce_max(at::Tensor& t) override {
    if (multi()) dist_->all_reduce_max(t);
  }
  void broadcast(at::Tensor& t, int root) override {
    if (multi()) dist_->broadcast(t, root);
  }
  void barrier() override {
    if (multi()) dist_->barrier();
  }

  void all_gather(at::Tensor& out, const at::Tensor& in) override {
    if (multi()) {
      dist_->all_gather(out, in);
    } else {
      out.view({-1}).copy_(in.reshape({-1}));
    }
  }
  void reduce_scatter_sum(at::Tensor& out, const at::Tensor& in) override {
    if (multi()) {
      dist_->reduce_scatter_sum(out, in);
    } else {
      out.view({-1}).copy_(in.reshape({-1}));
    }
  }

 private:
  bool multi() const { return dist_ && dist_->world_size() > 1; }
  std::shared_ptr<DistContext> dist_;
};

}  // namespace

std::unique_ptr<Communicator> make_communicator(std::shared_ptr<DistContext> dist) {
  return std::make_unique<DistCommunicator>(std::move(dist));
}

}  // namespace memrt
