// The bucket timer in C++: DDP's default gradient reduction, timed, with no Python per bucket.
//
// A comm hook written in Python costs a GIL trip per bucket and a Python callback when its
// all-reduce completes: 50-240 us a bucket (docs/overhead.md), the largest part of what the
// doctor costs a short step. This hook does what DDP's own reduction does (scale by 1/world
// size, all-reduce SUM, bit for bit the same) and notes, per bucket, when its gradients were
// ready and when its all-reduce completed, with the bucket's index, bytes and the group's
// sequence number. The notes wait here, under a mutex, until Python takes them (``drain``:
// after each backward on the training thread, and from the writer thread four times a second)
// and packs them into the trace as the Python hook would have.
//
// A hook the user registers later is run through torch's own PythonCommHook from inside this
// one (``set_python_hook``): DDP's slot holds one hook, and it is ours.
//
// Built on demand against the torch in use (probes/native.py: ``ddpdoctor native --build``),
// never at a rank's start; where it is not built, buckets are timed by the Python hook.

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <atomic>
#include <ctime>
#include <memory>
#include <mutex>
#include <vector>

namespace {

constexpr size_t kMaxWaiting = 65536;  // notes not yet drained: beyond, counted as dropped

int64_t now_ns() {  // time.monotonic_ns()'s clock
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

std::atomic<int64_t> g_step{-1};  // the training step the probes count (set_step)

struct Note {  // drained as these six int64, in this order (commhook.py's _NOTE)
  int64_t step, t0, t1, index, nbytes, seq;
};
static_assert(sizeof(Note) == 6 * sizeof(int64_t), "a note is six int64 with no padding");

struct Layout {  // a bucket seen with a new size: which parameters it holds
  int64_t index, nbytes;
  std::vector<int64_t> params;  // data_ptr of each, mapped to names in Python
};

// What the hook in DDP's slot and the Python handle share; outlives either.
struct Shared {
  std::mutex mu;
  std::vector<Note> done;
  std::vector<Layout> layouts;
  std::vector<int64_t> sizes;  // bucket index -> bytes last seen
  int64_t dropped = 0;
  std::shared_ptr<c10d::PythonCommHook> python;  // a user's hook, timed in Python

  void note(const Note& n) {
    std::lock_guard<std::mutex> lock(mu);
    if (done.size() < kMaxWaiting) {
      done.push_back(n);
    } else {
      ++dropped;
    }
  }
};

class TimedReduction : public c10d::CommHookInterface {
 public:
  TimedReduction(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<Shared> shared)
      : pg_(std::move(pg)), shared_(std::move(shared)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::shared_ptr<c10d::PythonCommHook> python;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      python = shared_->python;
    }
    if (python) {
      return python->runHook(bucket);
    }
    const int64_t t0 = now_ns();
    const int64_t step = g_step.load(std::memory_order_relaxed);
    at::Tensor& tensor = bucket.getBufferRef();
    const int64_t index = static_cast<int64_t>(bucket.getIndex());
    const int64_t nbytes = static_cast<int64_t>(tensor.nbytes());
    int64_t seq = -1;
    try {
      seq = static_cast<int64_t>(pg_->getSequenceNumberForGroup());
    } catch (const std::exception&) {
    }
    noteLayout(bucket, index, nbytes);
    tensor.mul_(1.0 / pg_->getSize());  // what DDP's reduction does: mul by 1/world, then SUM
    std::vector<at::Tensor> tensors = {tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    auto fut = pg_->allreduce(tensors, opts)->getFuture();
    std::shared_ptr<Shared> shared = shared_;
    return fut->then(
        [shared, step, t0, index, nbytes, seq](c10::ivalue::Future& done) {
          // value() throws for an all-reduce that failed (a peer died): that error is the
          // result, and nothing was reduced to note. (then() calls this either way.)
          c10::IValue result(done.value().toTensorVector()[0]);
          shared->note(Note{step, t0, now_ns(), index, nbytes, seq});
          return result;
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {  // the user's hook ran (set_python_hook)
      std::shared_ptr<c10d::PythonCommHook> python;
      {
        std::lock_guard<std::mutex> lock(shared_->mu);
        python = shared_->python;
      }
      TORCH_CHECK(python, "ddpdoctor: a Python hook's result with no Python hook");
      return python->parseHookResult(result);
    }
    return result.toTensor();
  }

 private:
  void noteLayout(c10d::GradBucket& bucket, int64_t index, int64_t nbytes) {
    std::lock_guard<std::mutex> lock(shared_->mu);
    auto& sizes = shared_->sizes;
    if (static_cast<size_t>(index) < sizes.size() && sizes[index] == nbytes) {
      return;
    }
    if (static_cast<size_t>(index) >= sizes.size()) {
      sizes.resize(index + 1, -1);
    }
    sizes[index] = nbytes;
    Layout layout{index, nbytes, {}};
    for (const auto& p : bucket.getParameters()) {
      layout.params.push_back(reinterpret_cast<int64_t>(p.data_ptr()));
    }
    shared_->layouts.push_back(std::move(layout));
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<Shared> shared_;
};

// The Python side's handle on one model's timer.
class Handle {
 public:
  explicit Handle(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}

  // (notes, layouts, dropped): notes as bytes, six int64 a note (step, t0, t1, index, nbytes,
  // seq), packed into the ring by the C packer in one call; layouts as (index, nbytes,
  // [data_ptr]); None when there is nothing new.
  py::object drain() {
    std::vector<Note> done;
    std::vector<Layout> layouts;
    int64_t dropped = 0;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      if (shared_->done.empty() && shared_->layouts.empty() && shared_->dropped == 0) {
        return py::none();
      }
      done.swap(shared_->done);
      layouts.swap(shared_->layouts);
      std::swap(dropped, shared_->dropped);
    }
    py::bytes notes(reinterpret_cast<const char*>(done.data()), done.size() * sizeof(Note));
    py::list shapes(layouts.size());
    for (size_t i = 0; i < layouts.size(); ++i) {
      shapes[i] = py::make_tuple(layouts[i].index, layouts[i].nbytes, py::cast(layouts[i].params));
    }
    return py::make_tuple(notes, shapes, dropped);
  }

  void set_python_hook(py::object state, py::object hook) {
    auto python = std::make_shared<c10d::PythonCommHook>(std::move(state), std::move(hook));
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->python = std::move(python);
  }

 private:
  std::shared_ptr<Shared> shared_;
};

Handle register_timer(const py::object& reducer, const py::object& process_group) {
  auto r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
  auto pg = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  auto shared = std::make_shared<Shared>();
  r->register_comm_hook(std::make_unique<TimedReduction>(pg, shared));
  return Handle(shared);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddpdoctor's bucket timer in C++ (probes/native.py)";
  py::class_<Handle>(m, "Handle")
      .def("drain", &Handle::drain)
      .def("set_python_hook", &Handle::set_python_hook);
  m.def("register_timer", &register_timer, "put the timer in a Reducer's comm hook slot");
  m.def("set_step", [](int64_t step) { g_step.store(step, std::memory_order_relaxed); });
}
