// MPI behind dist::init and Communicator. Built only with MPI (MIXTAPE_WITH_MPI); without it every entry
// point says "not supported".
#include "dist/communicator.h"

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "dist/world.h"
#include "tensor/backend.h"
#include "tensor/error.h"

#ifdef MIXTAPE_WITH_MPI
#include <mpi.h>
#endif

namespace mixtape::dist {

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

void abort(const std::string& message, int code) {
  std::fprintf(stderr, "rank %d of %d: %s\n", the_world.rank, the_world.size, message.c_str());
  std::fflush(stderr);
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
  ~Impl() {
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
  }
  fail("dist: unknown dtype");
}

MPI_Op mpi_op(Reduction op) { return op == Reduction::Sum ? MPI_SUM : MPI_MAX; }

}  // namespace

Communicator Communicator::world() {
  check(world_known, "dist::Communicator::world: call dist::init() first");
  auto impl = std::make_shared<Impl>();
  impl->comm = MPI_COMM_WORLD;
  impl->rank = the_world.rank;
  impl->size = the_world.size;
  impl->name = "world";
  return Communicator(impl);
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
// smallest value of each field at once.
void check_same_everywhere(const Communicator::Impl& c, const Tensor& tensor, const char* op) {
  if (c.size == 1) return;
  const int64_t mine[2] = {static_cast<int64_t>(tensor.dtype()), tensor.numel()};
  int64_t extremes[4] = {mine[0], mine[1], -mine[0], -mine[1]};
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, extremes, 4, MPI_INT64_T, MPI_MAX, c.comm), "MPI_Allreduce");
  if (extremes[0] != -extremes[2] || extremes[1] != -extremes[3])
    fail("dist::", op, " on the ", c.name, " (rank ", c.rank, " of ", c.size, "): this rank passed ",
         tensor.description(), " but the ranks disagree (dtype codes ", -extremes[2], "..", extremes[0],
         ", element counts ", -extremes[3], "..", extremes[1], "); every rank must pass the same shape and dtype");
}

void check_contiguous(const Communicator::Impl& c, const Tensor& tensor, const char* op) {
  check(tensor.defined(), "dist::", op, " on the ", c.name, ": tensor is undefined");
  check(tensor.is_contiguous(), "dist::", op, " on the ", c.name, ": tensor ", tensor.description(),
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
  check(t.numel() <= INT32_MAX, "dist: tensor ", t.description(), " has more than 2^31-1 elements");
  return static_cast<int>(t.numel());
}

}  // namespace

void Communicator::all_reduce(const Tensor& tensor, Reduction op) const {
  check_contiguous(*impl_, tensor, "all_reduce");
  check_same_everywhere(*impl_, tensor, "all_reduce");
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

void Communicator::all_reduce(std::span<double> values, Reduction op) const {
  if (impl_->size == 1 || values.empty()) return;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE, mpi_op(op),
                          impl_->comm),
            "MPI_Allreduce");
}

Tensor Communicator::all_gather(const Tensor& tensor) const {
  check_contiguous(*impl_, tensor, "all_gather");
  check(tensor.dim() >= 1, "dist::all_gather on the ", impl_->name, ": tensor ", tensor.description(),
        " needs at least one dim (chunks are stacked along dim 0)");
  check_same_everywhere(*impl_, tensor, "all_gather");
  Shape shape = tensor.shape();
  shape[0] *= impl_->size;
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
        ": tensor ", tensor.description(), " must have dim 0 divisible by the group size ", impl_->size);
  check_same_everywhere(*impl_, tensor, "reduce_scatter");
  Shape shape = tensor.shape();
  shape[0] /= impl_->size;
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

void Communicator::broadcast(const Tensor& tensor, int root) const {
  check_contiguous(*impl_, tensor, "broadcast");
  check(root >= 0 && root < impl_->size, "dist::broadcast on the ", impl_->name, ": root ", root,
        " is not a rank of this group of ", impl_->size);
  check_same_everywhere(*impl_, tensor, "broadcast");
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
  const Tensor host = host_view(tensor);
  check_mpi(MPI_Send(host.data_ptr(), count_of(host), mpi_type(host.dtype()), dest, tag, impl_->comm), "MPI_Send");
}

void Communicator::recv(const Tensor& tensor, int source, int tag) const {
  check_contiguous(*impl_, tensor, "recv");
  check(source >= 0 && source < impl_->size && source != impl_->rank, "dist::recv on the ", impl_->name,
        ": source ", source, " is not another rank of this group of ", impl_->size);
  Tensor host = tensor.device().is_cpu() ? tensor.detach() : Tensor::empty(tensor.shape(), tensor.dtype());
  MPI_Status status;
  // A longer message fails inside MPI (truncation error); a shorter one is caught by the count below.
  check_mpi(MPI_Recv(host.data_ptr(), count_of(host), mpi_type(host.dtype()), source, tag, impl_->comm, &status),
            "MPI_Recv");
  int received = 0;
  MPI_Get_count(&status, mpi_type(host.dtype()), &received);
  check(received == count_of(host), "dist::recv on the ", impl_->name, ": expected ", tensor.description(),
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
void abort(const std::string& message, int code) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::_Exit(code);
}
struct Communicator::Impl {};
Communicator Communicator::world() { not_supported("dist::Communicator: this build of mixtape has no MPI"); }
Communicator Communicator::split(int, int, std::string) const { not_supported("dist: no MPI"); }
int Communicator::rank() const { return 0; }
int Communicator::size() const { return 1; }
const std::string& Communicator::name() const { not_supported("dist: no MPI"); }
void Communicator::all_reduce(const Tensor&, Reduction) const { not_supported("dist: no MPI"); }
void Communicator::all_reduce(std::span<double>, Reduction) const { not_supported("dist: no MPI"); }
Tensor Communicator::all_gather(const Tensor&) const { not_supported("dist: no MPI"); }
Tensor Communicator::reduce_scatter(const Tensor&, Reduction) const { not_supported("dist: no MPI"); }
void Communicator::broadcast(const Tensor&, int) const { not_supported("dist: no MPI"); }
void Communicator::send(const Tensor&, int, int) const { not_supported("dist: no MPI"); }
void Communicator::recv(const Tensor&, int, int) const { not_supported("dist: no MPI"); }
void Communicator::barrier() const { not_supported("dist: no MPI"); }

#endif

int run_or_abort(int (*fn)(int, char**), int argc, char** argv) {
  try {
    return fn(argc, argv);
  } catch (const std::exception& e) {
    if (initialized() && world().size > 1) abort(std::string("error: ") + e.what(), 1);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace mixtape::dist
