// The bucket timer in C++: DDP's default gradient reduction, timed, with no Python per bucket.
//
// A comm hook written in Python costs a GIL trip per bucket and a Python callback when its
// all-reduce completes: 50-240 us a bucket (docs/overhead.md), the largest part of what the
// doctor costs a short step. This hook does what DDP's own reduction does (scale by 1/world
// size, all-reduce SUM, bit for bit the same) and notes, per bucket, when its gradients were
// ready and when its all-reduce completed, with the bucket's index, bytes and the group's
// sequence number.
//
// The notes go into a memory-mapped file of their own (``trace-rank{R}.notes``, beside the
// recording ring; layout in ``trace/notes.py``), written lock-free by the thread whose
// all-reduce completed: a slot claimed with an atomic counter, its sequence number stored last.
// The kernel keeps the file when the rank dies however it dies, so the notes need not reach the
// ring before the next event: Python packs them into the trace (``drain_notes``, then
// ``commit_notes`` once packed) from the writer thread four times a second, and after a death
// ``trace/ring.py`` recovers those not committed. The training thread pays nothing per step.
// A bucket seen with a new size (its parameters: rare, in the first steps) waits under a mutex
// for ``Handle.drain``.
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
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

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

// The notes file (trace/notes.py declares the same): a 64-byte header, magic "DDPNOTE1", u32
// slot bytes, u32 slot count, u64 notes claimed (at 16), u64 notes committed to the trace (at
// 24), u32 pid (at 32); then slots of 64 bytes: a Note, then at byte 48 its u64 number (from 1).
constexpr size_t kHeader = 64, kSlot = 64, kSeqAt = 48, kClaimedAt = 16, kCommittedAt = 24;
constexpr uint64_t kSlots = 16384;  // 1 MiB: four times a second, 16,384 buckets ahead
static_assert(sizeof(Note) <= kSeqAt, "a note fits before its number");

char* g_notes = nullptr;  // the mapping; set once, under the GIL, before any hook runs
uint64_t g_taken = 0;  // the last note drain_notes took (under the GIL)

uint64_t* word(char* at) { return reinterpret_cast<uint64_t*>(at); }

void open_notes(const std::string& path) {
  if (g_notes != nullptr) {
    return;  // one file a process: a second model's timer writes into the first's
  }
  const size_t size = kHeader + kSlots * kSlot;
  void* mem = MAP_FAILED;
  if (path.empty()) {  // no crash-safe ring either (trace/writer.py): memory alone
    mem = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  } else {
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(fd >= 0, "ddpdoctor: cannot create ", path, ": ", std::strerror(errno));
    int err = posix_fallocate(fd, 0, size);  // ENOSPC now, not SIGBUS in a gloo thread later
    if (err == 0) {
      mem = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      err = mem == MAP_FAILED ? errno : 0;
    }
    close(fd);
    if (err != 0) {
      unlink(path.c_str());
      TORCH_CHECK(false, "ddpdoctor: cannot map ", path, ": ", std::strerror(err));
    }
  }
  TORCH_CHECK(mem != MAP_FAILED, "ddpdoctor: cannot map the notes: ", std::strerror(errno));
  char* base = static_cast<char*>(mem);
  std::memcpy(base, "DDPNOTE1", 8);
  const uint32_t head[2] = {static_cast<uint32_t>(kSlot), static_cast<uint32_t>(kSlots)};
  std::memcpy(base + 8, head, sizeof(head));
  const uint32_t pid = static_cast<uint32_t>(getpid());
  std::memcpy(base + 32, &pid, sizeof(pid));
  g_notes = base;
}

// From any thread, with no lock: claim a number, fill its slot, store the number last.
void write_note(const Note& n) {
  char* base = g_notes;
  const uint64_t seq = __atomic_add_fetch(word(base + kClaimedAt), 1, __ATOMIC_ACQ_REL);
  char* slot = base + kHeader + ((seq - 1) & (kSlots - 1)) * kSlot;
  std::memcpy(slot, &n, sizeof(Note));
  __atomic_store_n(word(slot + kSeqAt), seq, __ATOMIC_RELEASE);
}

// (notes as bytes, the last number taken, notes lost): the notes since the last call, in
// order; a slot still being written waits for the next call. Under the GIL.
py::tuple drain_notes() {
  if (g_notes == nullptr) {
    return py::make_tuple(py::bytes(), 0, 0);
  }
  const uint64_t hi = __atomic_load_n(word(g_notes + kClaimedAt), __ATOMIC_ACQUIRE);
  uint64_t lo = g_taken + 1, lost = 0;
  if (hi >= lo + kSlots) {  // overwritten before this call
    lost = hi + 1 - kSlots - lo;
    lo = hi + 1 - kSlots;
  }
  std::vector<Note> out;
  out.reserve(hi >= lo ? hi + 1 - lo : 0);
  uint64_t seq = lo;
  for (; seq <= hi; ++seq) {
    char* slot = g_notes + kHeader + ((seq - 1) & (kSlots - 1)) * kSlot;
    const uint64_t before = __atomic_load_n(word(slot + kSeqAt), __ATOMIC_ACQUIRE);
    if (before < seq) {
      break;  // claimed, not yet written
    }
    Note n;
    std::memcpy(&n, slot, sizeof(Note));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (before != seq || __atomic_load_n(word(slot + kSeqAt), __ATOMIC_RELAXED) != seq) {
      ++lost;  // a writer a whole file ahead took the slot
      continue;
    }
    out.push_back(n);
  }
  g_taken = seq - 1;
  py::bytes notes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(Note));
  return py::make_tuple(notes, g_taken, lost);
}

// The notes up to ``taken`` are in the trace's ring: a death after this leaves them to it.
void commit_notes(uint64_t taken) {
  if (g_notes != nullptr) {
    __atomic_store_n(word(g_notes + kCommittedAt), taken, __ATOMIC_RELEASE);
  }
}

struct Layout {  // a bucket seen with a new size: which parameters it holds
  int64_t index, nbytes;
  std::vector<int64_t> params;  // data_ptr of each, mapped to names in Python
};

// What the hook in DDP's slot and the Python handle share; outlives either.
struct Shared {
  std::mutex mu;
  std::vector<Layout> layouts;
  std::vector<int64_t> sizes;  // bucket index -> bytes last seen
  std::shared_ptr<c10d::PythonCommHook> python;  // a user's hook, timed in Python
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
    return fut->then(
        [step, t0, index, nbytes, seq](c10::ivalue::Future& done) {
          // value() throws for an all-reduce that failed (a peer died): that error is the
          // result, and nothing was reduced to note. (then() calls this either way.)
          c10::IValue result(done.value().toTensorVector()[0]);
          write_note(Note{step, t0, now_ns(), index, nbytes, seq});
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

  // The buckets seen with a new size since the last call, as (index, nbytes, [data_ptr]);
  // None when there are none.
  py::object drain() {
    std::vector<Layout> layouts;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      if (shared_->layouts.empty()) {
        return py::none();
      }
      layouts.swap(shared_->layouts);
    }
    py::list shapes(layouts.size());
    for (size_t i = 0; i < layouts.size(); ++i) {
      shapes[i] = py::make_tuple(layouts[i].index, layouts[i].nbytes, py::cast(layouts[i].params));
    }
    return shapes;
  }

  void set_python_hook(py::object state, py::object hook) {
    auto python = std::make_shared<c10d::PythonCommHook>(std::move(state), std::move(hook));
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->python = std::move(python);
  }

 private:
  std::shared_ptr<Shared> shared_;
};

Handle register_timer(const py::object& reducer, const py::object& process_group, const std::string& notes) {
  open_notes(notes);
  auto r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
  auto pg = process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  auto shared = std::make_shared<Shared>();
  r->register_comm_hook(std::make_unique<TimedReduction>(pg, shared));
  return Handle(shared);
}

// A group's collective sequence number for the C probes (_fast.c's set_native), read with
// no pybind call: torch's binding releases the GIL and takes it back, about 1,800 instructions
// where this takes about 100 (the cast is made once per group). Called with the GIL held. -2
// where it cannot say (not a torch process group, or a backend with no numbers): the probe then
// asks Python, as before.
int64_t seq_of(PyObject* group) {
  static PyObject* last = nullptr;  // held: its address is not reused while we compare it
  static c10d::ProcessGroup* last_pg = nullptr;
  try {
    if (group != last) {
      auto* pg = py::handle(group).cast<c10d::ProcessGroup*>();
      Py_INCREF(group);
      Py_XDECREF(last);
      last = group;
      last_pg = pg;
    }
    return static_cast<int64_t>(last_pg->getSequenceNumberForGroup());
  } catch (const std::exception&) {
    return -2;
  }
}

// A tensor's dtype (borrowed) and bytes for the C probes (_fast.c's set_native), read from
// the tensor itself: the generic attribute lookup of .dtype and .nbytes costs about 860
// instructions a collective, this a few dozen. Only for a plain torch.Tensor: a subclass, which
// may define its own, gets -1 and the probe asks Python. Read as the tensor holds them, so a
// __torch_function__ mode the program has entered is not run by the probe. Called with the GIL
// held.
int tensor_meta(PyObject* obj, PyObject** dtype, int64_t* nbytes) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return -1;
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    *nbytes = static_cast<int64_t>(t.nbytes());
    *dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    return 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// Whether a parameter has no gradient (1) or has one (0), for the C backward probe's unused
// check: ``p.grad is None`` without the property's generic lookup (about 400 instructions a
// parameter, this a few). Only for a plain torch.Tensor or nn.Parameter: anything else gets -1
// and the probe asks Python. Called with the GIL held.
int grad_missing(PyObject* obj) {
  static PyObject* parameter = nullptr;
  if (parameter == nullptr) {
    PyObject* nn = PyImport_ImportModule("torch.nn.parameter");
    parameter = nn ? PyObject_GetAttrString(nn, "Parameter") : nullptr;  // held for the process
    Py_XDECREF(nn);
    if (parameter == nullptr) {
      PyErr_Clear();
      return -1;
    }
  }
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != THPVariableClass && type != parameter) return -1;
  try {
    return THPVariable_Unpack(obj).grad().defined() ? 0 : 1;
  } catch (const std::exception&) {
    return -1;
  }
}

// The step the notes carry, set by the C forward probe at each new step (no pybind call).
void step_now(int64_t step) { g_step.store(step, std::memory_order_relaxed); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddpdoctor's bucket timer in C++ (probes/native.py)";
  py::class_<Handle>(m, "Handle")
      .def("drain", &Handle::drain)
      .def("set_python_hook", &Handle::set_python_hook);
  m.def("register_timer", &register_timer, "put the timer in a Reducer's comm hook slot, its notes in a file");
  m.def("drain_notes", &drain_notes, "(the notes since the last call as bytes, the last one's number, lost)");
  m.def("commit_notes", &commit_notes, "the notes up to this number are in the trace's ring");
  m.def("set_step", &step_now);
  m.def(
      "capsules",
      [] {
        return py::make_tuple(py::capsule(reinterpret_cast<void*>(&seq_of), "ddpdoctor.seq_of"),
                              py::capsule(reinterpret_cast<void*>(&tensor_meta), "ddpdoctor.tensor_meta"),
                              py::capsule(reinterpret_cast<void*>(&grad_missing), "ddpdoctor.grad_missing"),
                              py::capsule(reinterpret_cast<void*>(&step_now), "ddpdoctor.step_now"));
      },
      "the C probes' readers and the step's writer, as capsules (_fast.c's set_native)");
}
