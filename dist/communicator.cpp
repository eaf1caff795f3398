// MPI behind dist::init and Communicator, with NCCL for CUDA tensors where the group can use it
// (dist/nccl.h). Built only with MPI (MIXTAPE_WITH_MPI); without it every entry point says "not supported".
#include "dist/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "dist/nccl.h"
#include "dist/world.h"
#include "tensor/backend.h"
#include "tensor/error.h"

#ifdef MIXTAPE_WITH_MPI
#include <mpi.h>
#endif

namespace mixtape::dist {

namespace {

// The first of these environment variables that is set, as an integer, or `otherwise`.
int integer_from_environment(std::initializer_list<const char*> names, int otherwise) {
  for (const char* name : names)
    if (const char* value = std::getenv(name)) return std::atoi(value);
  return otherwise;
}

// This process's place in its job as the launcher (mpirun, or a PMI-based one) states it, for where MPI does
// not say (not initialised, or finalised): rank 0 of 1 without a launcher.
World launcher_world() {
  World world;
  world.rank = integer_from_environment({"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}, 0);
  world.size = integer_from_environment({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 1);
  return world;
}

}  // namespace

#ifdef MIXTAPE_WITH_MPI

namespace {

World the_world;
bool initialized_here = false;  // this process called MPI_Init (so it finalizes at exit)
bool world_known = false;

void check_mpi(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  fail("MPI call ", call, " failed: ", std::string(text, static_cast<size_t>(length)));
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

const World& init(int* argc, char*** argv) {
  if (world_known) return the_world;
  int already = 0;
  check_mpi(MPI_Initialized(&already), "MPI_Initialized");
  if (!already) {
    int provided = 0;
    check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    initialized_here = true;
    std::atexit(finalize_at_exit);
  }
  // An error inside MPI returns a code (raised as mixtape::Error) instead of killing the process silently.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &the_world.rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &the_world.size), "MPI_Comm_size");
  MPI_Comm local;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, the_world.rank, MPI_INFO_NULL, &local),
            "MPI_Comm_split_type");
  MPI_Comm_rank(local, &the_world.local_rank);
  MPI_Comm_size(local, &the_world.local_size);
  MPI_Comm_free(&local);
  world_known = true;
  return the_world;
}

bool initialized() { return world_known; }

Device device() {
  const int gpus = cuda_device_count();
  return gpus > 0 ? Device::cuda(world().local_rank % gpus) : Device::cpu();
}

const World& world() {
  check(world_known, "dist::world: call dist::init() first");
  return the_world;
}

namespace {

// The job this process belongs to, with MPI initialised first where it is not yet (MPI_Abort needs it),
// unless it was finalised already: then, or if MPI cannot start, the launcher's word.
World world_for_abort() {
  if (world_known) return the_world;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    // This process reports its error itself. Open MPI (4.1) would add a banner about MPI_Abort, sent to
    // mpirun while the process exits, which often arrives cut short: mpirun then prints ORTE_ERROR_LOG lines
    // instead. Its messages are read once, at MPI_Init, so they can be silenced here only (a setting of the
    // user's own stays).
    ::setenv("OMPI_MCA_orte_execute_quiet", "1", /*overwrite=*/0);
    try {
      return init();
    } catch (const std::exception&) {
    }
  }
  return launcher_world();
}

}  // namespace

void abort(const std::string& message, int code) {
  const World world = world_for_abort();
  std::fprintf(stderr, "rank %d of %d: %s\n", world.rank, world.size, message.c_str());
  std::fflush(nullptr);  // MPI_Abort and _Exit drop what stdio still buffers (stdout through mpirun is a pipe)
  int initialized_mpi = 0, finalized = 0;
  MPI_Initialized(&initialized_mpi);
  MPI_Finalized(&finalized);
  if (initialized_mpi && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// ---- Communicator ------------------------------------------------------------------------------------------

struct Communicator::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owned = false;
  int rank = 0, size = 1;
  std::string name;
  // How CUDA tensors travel (dist/nccl.h), decided by all ranks together at the group's first collective on
  // CUDA tensors: the group's NCCL communicator, or the host path with its reason.
  enum class Cuda { Undecided, Nccl, Host } cuda = Cuda::Undecided;
  std::string cuda_reason;
  std::unique_ptr<nccl::Comm> nccl;
  // send/recv in groups of more than two ranks: a two-rank NCCL communicator per peer (as PyTorch does), made
  // by the two ends at their first CUDA transfer; null where the pair keeps the host path.
  std::map<int, std::unique_ptr<nccl::Comm>> pairs;
  ~Impl() {
    // NCCL first (it does not use MPI, but is released while the device still exists).
    pairs.clear();
    nccl.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned && !finalized) MPI_Comm_free(&comm);
  }
};

namespace {

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::F16:
    case DType::BF16: return MPI_UINT16_T;  // moved as bits; reductions widen first
    case DType::F8E4M3:
    case DType::F8E5M2:
    case DType::F8E8M0: return MPI_UINT8_T;  // moved as bits, never reduced
    case DType::F4E2M1: fail("dist: not supported: f4e2m1 tensors (two per byte) between ranks");
  }
  fail("dist: unknown dtype");
}

MPI_Op mpi_op(Reduction op) { return op == Reduction::Sum ? MPI_SUM : MPI_MAX; }

}  // namespace

Communicator Communicator::world() {
  check(world_known, "dist::Communicator::world: call dist::init() first");
  // One Impl for every call, so the world's NCCL communicator is made once, not per Communicator::world().
  // Never destroyed (its NCCL communicators are released at exit, dist/nccl.cpp).
  static std::shared_ptr<Impl>* const shared = [] {
    auto impl = std::make_shared<Impl>();
    impl->comm = MPI_COMM_WORLD;
    impl->rank = the_world.rank;
    impl->size = the_world.size;
    impl->name = "world";
    return new std::shared_ptr<Impl>(std::move(impl));
  }();
  return Communicator(*shared);
}

Communicator Communicator::split(int color, int key, std::string name) const {
  auto impl = std::make_shared<Impl>();
  check_mpi(MPI_Comm_split(impl_->comm, color, key, &impl->comm), "MPI_Comm_split");
  impl->owned = true;
  MPI_Comm_set_errhandler(impl->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(impl->comm, &impl->rank);
  MPI_Comm_size(impl->comm, &impl->size);
  impl->name = std::move(name);
  return Communicator(impl);
}

int Communicator::rank() const { return impl_->rank; }
int Communicator::size() const { return impl_->size; }
const std::string& Communicator::name() const { return impl_->name; }

namespace {

// Every rank's (dtype, numel) must agree: one all-reduce of (x, -x) with MAX gives the largest and the
// smallest value of each field at once. The same all-reduce tells whether every rank's tensor is on a GPU
// (the returned value): only then can the group use NCCL; a mix of CPU and CUDA tensors takes the host path.
bool check_same_everywhere(const Communicator::Impl& c, const Tensor& tensor, const char* op) {
  const int64_t on_gpu = tensor.device().is_cuda() ? 1 : 0;
  if (c.size == 1) return on_gpu == 1;
  const int64_t mine[3] = {static_cast<int64_t>(tensor.dtype()), tensor.numel(), on_gpu};
  int64_t extremes[6] = {mine[0], mine[1], mine[2], -mine[0], -mine[1], -mine[2]};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, extremes, 6, MPI_INT64_T, MPI_MAX, c.comm), "MPI_Allreduce");
  if (extremes[0] != -extremes[3] || extremes[1] != -extremes[4])
    fail("dist::", op, " on the ", c.name, " (rank ", c.rank, " of ", c.size, "): this rank passed ",
         tensor.description(), " but the ranks disagree (dtype codes ", -extremes[3], "..", extremes[0],
         ", element counts ", -extremes[4], "..", extremes[1], "); every rank must pass the same shape and dtype");
  return -extremes[5] == 1;  // the smallest flag: every rank on a GPU
}

void check_contiguous(const Communicator::Impl& c, const Tensor& tensor, const char* op) {
  check(tensor.defined(), "dist::", op, " on the ", c.name, ": tensor is undefined");
  check(tensor.is_contiguous(), "dist::", op, " on the ", c.name, ": tensor ", tensor.described(),
        " is not contiguous (pass .contiguous())");
}

// The tensor MPI works on: itself for CPU tensors, a host copy for device tensors (written back by
// `finish`).
Tensor host_view(const Tensor& tensor) {
  return tensor.device().is_cpu() ? tensor.detach() : tensor.detach().to(Device::cpu());
}
void finish(const Tensor& host, const Tensor& tensor) {
  if (!tensor.device().is_cpu()) copy_between_devices(host, tensor.detach());
}

int count_of(const Tensor& t) {
  check(t.numel() <= INT32_MAX, "dist: tensor ", t.described(), " has more than 2^31-1 elements");
  return static_cast<int>(t.numel());
}

// ---- NCCL for CUDA tensors (dist/nccl.h) ----

// Tags above the user's range: the headers of CUDA transfers and the setup of per-pair NCCL communicators.
constexpr int kHeaderTag = 32767;  // MPI guarantees tags up to 32767
constexpr int kPairTag = 32766;

// What a rank tells its peers before creating an NCCL communicator: whether it may use NCCL at all
// (MIXTAPE_NCCL=0 turns it off) and which GPU it holds.
struct GpuCard {
  char nccl_off = 0;
  char identity[191] = {};
};
GpuCard my_card(int device) {
  GpuCard card;
  const char* env = std::getenv("MIXTAPE_NCCL");
  card.nccl_off = env && std::strcmp(env, "0") == 0 ? 1 : 0;
  const std::string id = nccl::gpu_identity(device);
  std::strncpy(card.identity, id.c_str(), sizeof(card.identity) - 1);
  return card;
}

// Said once per process (on world rank 0) when a group falls back to the host path.
void note_host_path(const Communicator::Impl& c) {
  static bool said = false;
  if (said || the_world.rank != 0) return;
  said = true;
  std::fprintf(stderr, "mixtape dist: the %s sends CUDA tensors through the host over MPI, not NCCL: %s\n",
               c.name.c_str(), c.cuda_reason.c_str());
}

std::string label_of(const Communicator::Impl& c, int device) {
  return c.name + " (rank " + std::to_string(c.rank) + " of " + std::to_string(c.size) + ", cuda:" +
         std::to_string(device) + ")";
}

// A unique id made by one rank (`maker`) for the others, with a flag byte in front so that a failure to make
// it is an Error on every rank, not a hang of those waiting for it.
struct IdMessage {
  char ok = 0;
  nccl::UniqueId id{};
};
IdMessage make_id(std::string* error) {
  IdMessage message;
  try {
    message.id = nccl::unique_id();
    message.ok = 1;
  } catch (const std::exception& e) {
    *error = e.what();
  }
  return message;
}

// The group's NCCL communicator for a collective (or a send/recv in a group of two) on `tensor`, or null for
// the host path. Every rank of the group calls it at the same point with its tensor on a GPU (the agreement
// check said so), so the first call decides for all of them together.
nccl::Comm* group_nccl(Communicator::Impl& c, const Tensor& tensor) {
  using Cuda = Communicator::Impl::Cuda;
  if (!nccl::built()) {
    if (c.cuda == Cuda::Undecided) {
      c.cuda = Cuda::Host;
      c.cuda_reason = "this build of mixtape has no NCCL";
    }
    return nullptr;
  }
  if (c.size == 1 && !nccl::single_rank_groups()) return nullptr;  // nothing to communicate
  const int device = tensor.device().index;
  if (c.cuda == Cuda::Undecided) {
    // Who holds which GPU: NCCL refuses two ranks on one GPU.
    const GpuCard mine = my_card(device);
    std::vector<GpuCard> cards(static_cast<size_t>(c.size));
    check_mpi(MPI_Allgather(&mine, sizeof(GpuCard), MPI_BYTE, cards.data(), sizeof(GpuCard), MPI_BYTE, c.comm),
              "MPI_Allgather");
    std::string reason;
    for (int i = 0; i < c.size && reason.empty(); ++i) {
      if (cards[static_cast<size_t>(i)].nccl_off) reason = "MIXTAPE_NCCL=0 on rank " + std::to_string(i);
      for (int j = i + 1; j < c.size && reason.empty(); ++j)
        if (std::strcmp(cards[static_cast<size_t>(i)].identity, cards[static_cast<size_t>(j)].identity) == 0)
          reason = "ranks " + std::to_string(i) + " and " + std::to_string(j) + " share the GPU " +
                   cards[static_cast<size_t>(i)].identity + " (NCCL needs one GPU per rank)";
    }
    if (!reason.empty()) {
      c.cuda = Cuda::Host;
      c.cuda_reason = reason;
      note_host_path(c);
      return nullptr;
    }
    std::string error;
    IdMessage message;
    if (c.rank == 0) message = make_id(&error);
    check_mpi(MPI_Bcast(&message, sizeof(IdMessage), MPI_BYTE, 0, c.comm), "MPI_Bcast");
    check(message.ok == 1, "dist: creating the NCCL communicator of the ", c.name, ": rank 0 could not make the "
          "NCCL unique id", error.empty() ? "" : ": ", error);
    c.nccl = std::make_unique<nccl::Comm>(message.id, c.size, c.rank, device, label_of(c, device));
    c.cuda = Cuda::Nccl;
  }
  if (c.cuda == Cuda::Host) return nullptr;
  check(c.nccl->device() == device, "dist: the ", c.name, " (rank ", c.rank, " of ", c.size,
        ") runs NCCL on cuda:", c.nccl->device(), " but this tensor is on cuda:", device,
        "; a rank uses one GPU (dist::device())");
  return c.nccl.get();
}

// The NCCL communicator between this rank and `peer` for a send/recv of `tensor` (both ends call it at their
// matching transfer), with the peer's index in it; null for the host path.
std::pair<nccl::Comm*, int> pair_nccl(Communicator::Impl& c, const Tensor& tensor, int peer) {
  if (!nccl::built()) return {nullptr, 0};
  if (c.size == 2) return {group_nccl(c, tensor), peer};
  const int device = tensor.device().index;
  auto found = c.pairs.find(peer);
  if (found == c.pairs.end()) {
    const GpuCard mine = my_card(device);
    GpuCard theirs;
    check_mpi(MPI_Sendrecv(&mine, sizeof(GpuCard), MPI_BYTE, peer, kPairTag, &theirs, sizeof(GpuCard), MPI_BYTE,
                           peer, kPairTag, c.comm, MPI_STATUS_IGNORE),
              "MPI_Sendrecv");
    if (mine.nccl_off || theirs.nccl_off || std::strcmp(mine.identity, theirs.identity) == 0) {
      found = c.pairs.emplace(peer, nullptr).first;
    } else {
      // The lower rank makes the id; it is rank 0 of the pair's communicator.
      std::string error;
      IdMessage message;
      if (c.rank < peer) {
        message = make_id(&error);
        check_mpi(MPI_Send(&message, sizeof(IdMessage), MPI_BYTE, peer, kPairTag, c.comm), "MPI_Send");
      } else {
        check_mpi(MPI_Recv(&message, sizeof(IdMessage), MPI_BYTE, peer, kPairTag, c.comm, MPI_STATUS_IGNORE),
                  "MPI_Recv");
      }
      check(message.ok == 1, "dist: creating the NCCL communicator between ranks ", c.rank, " and ", peer, " of the ",
            c.name, ": rank ", std::min(c.rank, peer), " could not make the NCCL unique id",
            error.empty() ? "" : ": ", error);
      auto comm = std::make_unique<nccl::Comm>(message.id, 2, c.rank < peer ? 0 : 1, device,
                                               label_of(c, device) + " pair with rank " + std::to_string(peer));
      found = c.pairs.emplace(peer, std::move(comm)).first;
    }
  }
  nccl::Comm* comm = found->second.get();
  if (!comm) return {nullptr, 0};
  check(comm->device() == device, "dist: the ", c.name, " (rank ", c.rank, ") runs NCCL with rank ", peer,
        " on cuda:", comm->device(), " but this tensor is on cuda:", device, "; a rank uses one GPU (dist::device())");
  return {comm, c.rank < peer ? 1 : 0};
}

// Before a CUDA send/recv, the two ends exchange what each is doing (a small MPI message), so that a mismatch
// of dtype, size, tag or direction is an Error on both ends instead of an NCCL transfer that never completes.
struct Header {
  int64_t receiving, dtype, numel, tag;
};
void exchange_header(const Communicator::Impl& c, const Tensor& tensor, int peer, int tag, bool receiving) {
  const Header mine{receiving ? 1 : 0, static_cast<int64_t>(tensor.dtype()), tensor.numel(), tag};
  Header theirs{};
  check_mpi(MPI_Sendrecv(&mine, sizeof(Header), MPI_BYTE, peer, kHeaderTag, &theirs, sizeof(Header), MPI_BYTE, peer,
                         kHeaderTag, c.comm, MPI_STATUS_IGNORE),
            "MPI_Sendrecv");
  const char* op = receiving ? "recv" : "send";
  check(theirs.receiving != mine.receiving, "dist::", op, " on the ", c.name, ": rank ", c.rank, " and rank ", peer,
        " are both ", receiving ? "receiving from" : "sending to", " each other (a send must meet a recv)");
  check(theirs.dtype == mine.dtype && theirs.numel == mine.numel && theirs.tag == mine.tag, "dist::", op, " on the ",
        c.name, ": rank ", c.rank, " ", receiving ? "expects" : "sends", " ", tensor.described(), " (tag ", tag,
        ") but rank ", peer, receiving ? " sends " : " expects ", theirs.numel, " elements of ",
        dtype_name(static_cast<DType>(theirs.dtype)), " (tag ", theirs.tag,
        "); both ends of a CUDA transfer must agree on dtype, size and tag, in the same order");
}

void check_tag(const Communicator::Impl& c, int tag, const char* op) {
  check(tag >= 0 && tag < kPairTag, "dist::", op, " on the ", c.name, ": tag ", tag, " is outside 0..", kPairTag - 1,
        " (the tags above are reserved)");
}

}  // namespace

std::string Communicator::cuda_transport() const {
  switch (impl_->cuda) {
    case Impl::Cuda::Nccl: return "nccl";
    case Impl::Cuda::Host: return "host: " + impl_->cuda_reason;
    case Impl::Cuda::Undecided: break;
  }
  // A group of one rank communicates nothing (unless nccl::set_single_rank_groups asks for NCCL anyway).
  if (impl_->size == 1 && !nccl::single_rank_groups()) return "none: a group of one rank moves nothing";
  return "undecided";
}

void Communicator::all_reduce(const Tensor& tensor, Reduction op) const {
  check_contiguous(*impl_, tensor, "all_reduce");
  const bool all_gpu = check_same_everywhere(*impl_, tensor, "all_reduce");
  if (nccl::Comm* comm = all_gpu ? group_nccl(*impl_, tensor) : nullptr) {
    comm->all_reduce(tensor.detach(), op);  // 16-bit reduced in its own type (dist/nccl.h)
    tensor.bump_version();
    return;
  }
  if (impl_->size == 1) return;
  Tensor host = host_view(tensor);
  if (is_low_precision(tensor.dtype())) {
    // Widened to fp32, reduced, rounded once back into the tensor.
    Tensor wide = host.to(DType::F32);
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, wide.data_ptr(), count_of(wide), MPI_FLOAT, mpi_op(op), impl_->comm),
              "MPI_Allreduce");
    host.copy_(wide);
  } else {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, host.data_ptr(), count_of(host), mpi_type(host.dtype()), mpi_op(op),
                            impl_->comm),
              "MPI_Allreduce");
  }
  finish(host, tensor);
  tensor.bump_version();
}

// ---- non-blocking all_reduce ----

struct PendingCollective::State {
  Tensor tensor;  // the caller's (detached): where the result goes
  // MPI: the buffer MPI reduces in place (the tensor itself, or its fp32 widening, or a host copy).
  MPI_Request request = MPI_REQUEST_NULL;
  Tensor buffer;
  // NCCL: the end of the all-reduce on the communicator's stream.
  void* event = nullptr;
  int device = -1;
  std::string group;
};

PendingCollective Communicator::all_reduce_start(const Tensor& tensor, Reduction op) const {
  check_contiguous(*impl_, tensor, "all_reduce_start");
  const bool all_gpu = check_same_everywhere(*impl_, tensor, "all_reduce_start");
  auto state = std::make_unique<PendingCollective::State>();
  state->tensor = tensor.detach();
  state->group = impl_->name;
  if (nccl::Comm* comm = all_gpu ? group_nccl(*impl_, tensor) : nullptr) {
    state->device = tensor.device().index;
    state->event = comm->all_reduce_async(state->tensor, op);  // 16-bit reduced in its own type (dist/nccl.h)
    tensor.bump_version();
    return PendingCollective(std::move(state));
  }
  if (impl_->size == 1) return PendingCollective();
  const Tensor host = host_view(tensor);
  // 16-bit values widened to fp32 and rounded once back when complete, as all_reduce does.
  state->buffer = is_low_precision(tensor.dtype()) ? host.to(DType::F32) : host;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, state->buffer.data_ptr(), count_of(state->buffer),
                           mpi_type(state->buffer.dtype()), mpi_op(op), impl_->comm, &state->request),
            "MPI_Iallreduce");
  tensor.bump_version();
  return PendingCollective(std::move(state));
}

PendingCollective::PendingCollective() = default;
PendingCollective::PendingCollective(std::unique_ptr<State> state) : state_(std::move(state)) {}
PendingCollective::PendingCollective(PendingCollective&&) noexcept = default;
PendingCollective& PendingCollective::operator=(PendingCollective&& other) noexcept {
  if (this != &other) {
    try {
      if (state_) wait();
    } catch (...) {
    }
    state_ = std::move(other.state_);
  }
  return *this;
}
PendingCollective::~PendingCollective() {
  try {
    if (state_) wait();
  } catch (...) {
  }
}

void PendingCollective::complete() {
  const std::unique_ptr<State> s = std::move(state_);
  if (s->event) {
    nccl::Comm::wait_event(s->event, s->device);
    return;
  }
  if (s->buffer.data_ptr() == s->tensor.data_ptr()) return;  // reduced in place
  if (s->tensor.device().is_cpu()) {
    s->tensor.copy_(s->buffer);  // rounded once from fp32
  } else {
    copy_between_devices(s->buffer.to(s->tensor.dtype()), s->tensor);
  }
}

bool PendingCollective::test() {
  if (!state_) return true;
  if (state_->event) {
    if (!nccl::Comm::event_done(state_->event, state_->device)) return false;
  } else {
    int flag = 0;
    check_mpi(MPI_Test(&state_->request, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    if (!flag) return false;
  }
  complete();
  return true;
}

void PendingCollective::wait() {
  if (!state_) return;
  if (!state_->event) check_mpi(MPI_Wait(&state_->request, MPI_STATUS_IGNORE), "MPI_Wait");
  complete();
}

void Communicator::all_reduce(std::span<double> values, Reduction op) const {
  if (impl_->size == 1 || values.empty()) return;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, mpi_op(op),
                          impl_->comm),
            "MPI_Allreduce");
}

Tensor Communicator::all_gather(const Tensor& tensor) const {
  check_contiguous(*impl_, tensor, "all_gather");
  check(tensor.dim() >= 1, "dist::all_gather on the ", impl_->name, ": tensor ", tensor.described(),
        " needs at least one dim (chunks are stacked along dim 0)");
  const bool all_gpu = check_same_everywhere(*impl_, tensor, "all_gather");
  Shape shape = tensor.shape();
  shape[0] *= impl_->size;
  if (nccl::Comm* comm = all_gpu ? group_nccl(*impl_, tensor) : nullptr) {
    Tensor out = Tensor::empty(shape, tensor.dtype(), tensor.device());
    comm->all_gather(tensor.detach(), out);
    return out;
  }
  const Tensor host = host_view(tensor);
  Tensor out = Tensor::empty(shape, tensor.dtype());
  check_mpi(MPI_Allgather(host.data_ptr(), count_of(host), mpi_type(host.dtype()), out.data_ptr(), count_of(host),
                          mpi_type(host.dtype()), impl_->comm),
            "MPI_Allgather");
  return tensor.device().is_cpu() ? out : out.to(tensor.device());
}

Tensor Communicator::reduce_scatter(const Tensor& tensor, Reduction op) const {
  check_contiguous(*impl_, tensor, "reduce_scatter");
  check(tensor.dim() >= 1 && tensor.size(0) % impl_->size == 0, "dist::reduce_scatter on the ", impl_->name,
        ": tensor ", tensor.described(), " must have dim 0 divisible by the group size ", impl_->size);
  const bool all_gpu = check_same_everywhere(*impl_, tensor, "reduce_scatter");
  Shape shape = tensor.shape();
  shape[0] /= impl_->size;
  if (nccl::Comm* comm = all_gpu ? group_nccl(*impl_, tensor) : nullptr) {
    Tensor chunk = Tensor::empty(shape, tensor.dtype(), tensor.device());
    comm->reduce_scatter(tensor.detach(), chunk, op);  // 16-bit reduced in its own type (dist/nccl.h)
    return chunk;
  }
  const bool low = is_low_precision(tensor.dtype());
  const Tensor host = host_view(tensor);
  const Tensor send = low ? host.to(DType::F32) : host;
  Tensor chunk = Tensor::empty(shape, send.dtype());
  check_mpi(MPI_Reduce_scatter_block(send.data_ptr(), chunk.data_ptr(), count_of(chunk), mpi_type(send.dtype()),
                                     mpi_op(op), impl_->comm),
            "MPI_Reduce_scatter_block");
  if (low) chunk = chunk.to(tensor.dtype());
  return tensor.device().is_cpu() ? chunk : chunk.to(tensor.device());
}

Tensor Communicator::all_to_all(const Tensor& tensor) const {
  check_contiguous(*impl_, tensor, "all_to_all");
  check(tensor.dim() >= 1 && tensor.size(0) % impl_->size == 0, "dist::all_to_all on the ", impl_->name,
        ": tensor ", tensor.described(), " must have dim 0 divisible by the group size ", impl_->size);
  check_same_everywhere(*impl_, tensor, "all_to_all");
  const Tensor host = host_view(tensor);
  Tensor out = Tensor::empty(tensor.shape(), tensor.dtype());
  const int chunk = count_of(host) / impl_->size;
  check_mpi(MPI_Alltoall(host.data_ptr(), chunk, mpi_type(host.dtype()), out.data_ptr(), chunk,
                         mpi_type(host.dtype()), impl_->comm),
            "MPI_Alltoall");
  return tensor.device().is_cpu() ? out : out.to(tensor.device());
}

void Communicator::broadcast(const Tensor& tensor, int root) const {
  check_contiguous(*impl_, tensor, "broadcast");
  check(root >= 0 && root < impl_->size, "dist::broadcast on the ", impl_->name, ": root ", root,
        " is not a rank of this group of ", impl_->size);
  const bool all_gpu = check_same_everywhere(*impl_, tensor, "broadcast");
  if (nccl::Comm* comm = all_gpu ? group_nccl(*impl_, tensor) : nullptr) {
    comm->broadcast(tensor.detach(), root);
    tensor.bump_version();
    return;
  }
  if (impl_->size == 1) return;
  Tensor host = host_view(tensor);
  check_mpi(MPI_Bcast(host.data_ptr(), count_of(host), mpi_type(host.dtype()), root, impl_->comm), "MPI_Bcast");
  finish(host, tensor);
  tensor.bump_version();
}

void Communicator::send(const Tensor& tensor, int dest, int tag) const {
  check_contiguous(*impl_, tensor, "send");
  check(dest >= 0 && dest < impl_->size && dest != impl_->rank, "dist::send on the ", impl_->name, ": destination ",
        dest, " is not another rank of this group of ", impl_->size);
  check_tag(*impl_, tag, "send");
  if (tensor.device().is_cuda()) {
    exchange_header(*impl_, tensor, dest, tag, /*receiving=*/false);
    if (auto [comm, peer] = pair_nccl(*impl_, tensor, dest); comm) {
      comm->send(tensor.detach(), peer);
      return;
    }
  }
  const Tensor host = host_view(tensor);
  check_mpi(MPI_Send(host.data_ptr(), count_of(host), mpi_type(host.dtype()), dest, tag, impl_->comm), "MPI_Send");
}

void Communicator::recv(const Tensor& tensor, int source, int tag) const {
  check_contiguous(*impl_, tensor, "recv");
  check(source >= 0 && source < impl_->size && source != impl_->rank, "dist::recv on the ", impl_->name,
        ": source ", source, " is not another rank of this group of ", impl_->size);
  check_tag(*impl_, tag, "recv");
  if (tensor.device().is_cuda()) {
    exchange_header(*impl_, tensor, source, tag, /*receiving=*/true);
    if (auto [comm, peer] = pair_nccl(*impl_, tensor, source); comm) {
      comm->recv(tensor.detach(), peer);
      tensor.bump_version();
      return;
    }
  }
  Tensor host = tensor.device().is_cpu() ? tensor.detach() : Tensor::empty(tensor.shape(), tensor.dtype());
  MPI_Status status;
  // A longer message fails inside MPI (truncation error); a shorter one is caught by the count below.
  check_mpi(MPI_Recv(host.data_ptr(), count_of(host), mpi_type(host.dtype()), source, tag, impl_->comm, &status),
            "MPI_Recv");
  int received = 0;
  MPI_Get_count(&status, mpi_type(host.dtype()), &received);
  check(received == count_of(host), "dist::recv on the ", impl_->name, ": expected ", tensor.described(),
        " from rank ", source, " but ", received, " elements arrived");
  finish(host, tensor);
  tensor.bump_version();
}

void Communicator::barrier() const { check_mpi(MPI_Barrier(impl_->comm), "MPI_Barrier"); }

#else  // no MPI

const World& init(int*, char***) {
  not_supported("dist::init: this build of mixtape has no MPI (configure with -DMIXTAPE_MPI=ON and OpenMPI installed)");
}
bool initialized() { return false; }
Device device() { return cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu(); }
const World& world() { not_supported("dist::world: this build of mixtape has no MPI"); }
namespace {
World world_for_abort() { return launcher_world(); }
}  // namespace
void abort(const std::string& message, int code) {
  const World world = launcher_world();
  if (world.size > 1) std::fprintf(stderr, "rank %d of %d: %s\n", world.rank, world.size, message.c_str());
  else std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(nullptr);  // _Exit drops what stdio still buffers
  std::_Exit(code);
}
struct Communicator::Impl {};
Communicator Communicator::world() { not_supported("dist::Communicator: this build of mixtape has no MPI"); }
Communicator Communicator::split(int, int, std::string) const { not_supported("dist: no MPI"); }
int Communicator::rank() const { return 0; }
int Communicator::size() const { return 1; }
const std::string& Communicator::name() const { not_supported("dist: no MPI"); }
std::string Communicator::cuda_transport() const { return "host: this build of mixtape has no MPI"; }
void Communicator::all_reduce(const Tensor&, Reduction) const { not_supported("dist: no MPI"); }
void Communicator::all_reduce(std::span<double>, Reduction) const { not_supported("dist: no MPI"); }
Tensor Communicator::all_gather(const Tensor&) const { not_supported("dist: no MPI"); }
Tensor Communicator::reduce_scatter(const Tensor&, Reduction) const { not_supported("dist: no MPI"); }
Tensor Communicator::all_to_all(const Tensor&) const { not_supported("dist: no MPI"); }
void Communicator::broadcast(const Tensor&, int) const { not_supported("dist: no MPI"); }
void Communicator::send(const Tensor&, int, int) const { not_supported("dist: no MPI"); }
void Communicator::recv(const Tensor&, int, int) const { not_supported("dist: no MPI"); }
void Communicator::barrier() const { not_supported("dist: no MPI"); }
PendingCollective Communicator::all_reduce_start(const Tensor&, Reduction) const { not_supported("dist: no MPI"); }
struct PendingCollective::State {};
PendingCollective::PendingCollective() = default;
PendingCollective::PendingCollective(std::unique_ptr<State> state) : state_(std::move(state)) {}
PendingCollective::PendingCollective(PendingCollective&&) noexcept = default;
PendingCollective& PendingCollective::operator=(PendingCollective&&) noexcept = default;
PendingCollective::~PendingCollective() = default;
void PendingCollective::complete() { state_.reset(); }
bool PendingCollective::test() { return true; }
void PendingCollective::wait() {}

#endif

int run_or_abort(int (*fn)(int, char**), int argc, char** argv) {
  try {
    return fn(argc, argv);
  } catch (const std::exception& e) {
    // MPI is initialised (where it is not yet) before anything else: MPI_Abort needs it, and MPI_Init returns
    // only once every rank has called it, so no rank may wait before it.
    const World world = world_for_abort();
    // Most errors meet every rank alike (a bad option, a layout the job does not fit): rank 0 reports and
    // ends the job at once, and the others wait a moment first, so that the job ends before they repeat
    // the message. An error on another rank alone is still reported, after that moment.
    if (world.rank > 0) std::this_thread::sleep_for(std::chrono::seconds(2));
    abort(std::string("error: ") + e.what(), 1);
  }
}

}  // namespace mixtape::dist
