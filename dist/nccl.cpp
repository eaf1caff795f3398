// NCCL behind dist/nccl.h (see there). Built with NCCL only when MIXTAPE_WITH_NCCL; otherwise the entry
// points other than built()/version()/the testing switch say "not supported" (the Communicator never calls
// them then).
#include "dist/nccl.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>

#include "tensor/error.h"

#ifdef MIXTAPE_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include "tensor/cuda/stream.h"
#endif

namespace mixtape::dist::nccl {

namespace {
std::atomic<bool> single_rank = false;
}  // namespace

void set_single_rank_groups(bool enabled) { single_rank = enabled; }
bool single_rank_groups() { return single_rank; }

#ifdef MIXTAPE_WITH_NCCL

static_assert(kUniqueIdBytes == NCCL_UNIQUE_ID_BYTES && sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES);

namespace {

// "NCCL call 'ncclAllReduce(...)' failed at dist/nccl.cpp:123 on the tensor-parallel group (rank 0 of 2,
// cuda:0): unhandled cuda error (error 1); NCCL's last error: ..."
void check_nccl(ncclResult_t result, const char* call, const char* file, int line, const std::string& label) {
  if (result == ncclSuccess) return;
  const char* last = ncclGetLastError(nullptr);
  fail("NCCL call '", call, "' failed at ", file, ":", line, label.empty() ? "" : " on the ", label, ": ",
       ncclGetErrorString(result), " (error ", static_cast<int>(result), ")",
       last && *last ? "; NCCL's last error: " : "", last ? last : "");
}
void check_cuda_here(cudaError_t result, const char* call, const char* file, int line) {
  if (result == cudaSuccess) return;
  fail("CUDA call '", call, "' failed at ", file, ":", line, ": ", cudaGetErrorString(result), " (error ",
       static_cast<int>(result), ")");
}

#define MIXTAPE_NCCL_CHECK(call, label) check_nccl((call), #call, __FILE__, __LINE__, (label))
#define MIXTAPE_NCCL_CUDA_CHECK(call) check_cuda_here((call), #call, __FILE__, __LINE__)

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::F16: return ncclFloat16;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::F8E4M3:
    case DType::F8E5M2:
    case DType::F8E8M0: return ncclUint8;  // moved as bits, never reduced
    case DType::F4E2M1: fail("dist::nccl: not supported: f4e2m1 tensors (two per byte) between ranks");
  }
  fail("dist::nccl: unknown dtype");
}

ncclRedOp_t nccl_op(Reduction op) { return op == Reduction::Sum ? ncclSum : ncclMax; }

// Communicators still alive, released at exit before the CUDA backends and the runtime go away (the atexit
// handler is registered after the first backend exists, so it runs before the backends' destructors).
// Leaked on purpose: a Comm destroyed during static destruction must still find it.
std::mutex& live_mutex() {
  static std::mutex* mutex = new std::mutex;
  return *mutex;
}
std::set<Comm*>& live() {
  static std::set<Comm*>* comms = new std::set<Comm*>;
  return *comms;
}
void release_all_at_exit() {
  std::set<Comm*> comms;
  {
    std::lock_guard lock(live_mutex());
    comms = live();
  }
  for (Comm* comm : comms) comm->release();
}

}  // namespace

bool built() { return true; }

std::string version() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X,Y,Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

UniqueId unique_id() {
  ncclUniqueId id;
  MIXTAPE_NCCL_CHECK(ncclGetUniqueId(&id), std::string());
  UniqueId out;
  std::memcpy(out.data(), id.internal, kUniqueIdBytes);
  return out;
}

std::string gpu_identity(int device) {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "?");
  char bus[64] = {};
  MIXTAPE_NCCL_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, device));
  return std::string(host) + "/" + bus;
}

Comm::Comm(const UniqueId& id, int nranks, int rank, int device, std::string label)
    : device_(device), label_(std::move(label)) {
  ncclUniqueId nid;
  std::memcpy(nid.internal, id.data(), kUniqueIdBytes);
  // The device must be current for ncclCommInitRank; device_stream() makes it so (and keeps the backend's
  // record of the current device right, which a bare cudaSetDevice would not).
  cuda::device_stream(device_);
  ncclComm_t comm = nullptr;
  MIXTAPE_NCCL_CHECK(ncclCommInitRank(&comm, nranks, nid, rank), label_);
  comm_ = comm;
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(release_all_at_exit); });
  std::lock_guard lock(live_mutex());
  live().insert(this);
}

Comm::~Comm() {
  release();
  std::lock_guard lock(live_mutex());
  live().erase(this);
}

void Comm::release() {
  if (!comm_) return;
  // Exit or teardown: failures are ignored (the driver may be shutting down); our queued work is waited for
  // first, so the abort cancels nothing of a well-formed program.
  try {
    (void)cudaStreamSynchronize(cuda::device_stream(device_));  // device_stream() makes the device current
    if (side_) (void)cudaStreamSynchronize(static_cast<cudaStream_t>(side_));
  } catch (...) {
  }
  (void)ncclCommAbort(static_cast<ncclComm_t>(comm_));
  comm_ = nullptr;
  if (side_) (void)cudaStreamDestroy(static_cast<cudaStream_t>(side_));
  side_ = nullptr;
}

void Comm::after_async() {
  if (!side_busy_) return;
  cudaEvent_t mark = nullptr;
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&mark, cudaEventDisableTiming));
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventRecord(mark, static_cast<cudaStream_t>(side_)));
  MIXTAPE_NCCL_CUDA_CHECK(cudaStreamWaitEvent(cuda::device_stream(device_), mark, 0));
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventDestroy(mark));  // released once recorded work completes
  side_busy_ = false;
}

void* Comm::all_reduce_async(const Tensor& tensor, Reduction op) {
  check_tensor(tensor, "all_reduce_async");
  const cudaStream_t stream = cuda::device_stream(device_);
  if (!side_) {
    cudaStream_t side = nullptr;
    MIXTAPE_NCCL_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    side_ = side;
  }
  const auto side = static_cast<cudaStream_t>(side_);
  // The side stream starts after everything queued so far on the backend stream (the kernels that wrote the
  // tensor).
  cudaEvent_t ready = nullptr, done = nullptr;
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventRecord(ready, stream));
  MIXTAPE_NCCL_CUDA_CHECK(cudaStreamWaitEvent(side, ready, 0));
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventDestroy(ready));
  if (tensor.numel() > 0)
    MIXTAPE_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                                     nccl_type(tensor.dtype()), nccl_op(op), static_cast<ncclComm_t>(comm_), side),
                       label_);
  side_busy_ = true;
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  MIXTAPE_NCCL_CUDA_CHECK(cudaEventRecord(done, side));
  return done;
}

bool Comm::event_done(void* event, int device) {
  cuda::device_stream(device);  // makes the device current
  const cudaError_t state = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (state == cudaErrorNotReady) return false;
  MIXTAPE_NCCL_CUDA_CHECK(state);
  return true;
}

void Comm::wait_event(void* event, int device) {
  const auto e = static_cast<cudaEvent_t>(event);
  const cudaError_t waited = cudaStreamWaitEvent(cuda::device_stream(device), e, 0);
  (void)cudaEventDestroy(e);
  MIXTAPE_NCCL_CUDA_CHECK(waited);
}

void Comm::check_tensor(const Tensor& t, const char* op) const {
  check(comm_ != nullptr, "dist::nccl::", op, " on the ", label_, ": the NCCL communicator was already released");
  check(t.defined() && t.is_contiguous() && t.device().is_cuda() && t.device().index == device_, "dist::nccl::", op,
        " on the ", label_, ": expected a contiguous tensor on cuda:", device_, " (the device this group's NCCL "
        "communicator was created on), got ", t.defined() ? t.description() : std::string("an undefined tensor"));
}

void Comm::all_reduce(const Tensor& tensor, Reduction op) {
  check_tensor(tensor, "all_reduce");
  if (tensor.numel() == 0) return;
  after_async();
  const cudaStream_t stream = cuda::device_stream(device_);
  MIXTAPE_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                                   nccl_type(tensor.dtype()), nccl_op(op), static_cast<ncclComm_t>(comm_), stream),
                     label_);
}

void Comm::all_gather(const Tensor& input, const Tensor& output) {
  check_tensor(input, "all_gather");
  check_tensor(output, "all_gather");
  if (input.numel() == 0) return;
  after_async();
  const cudaStream_t stream = cuda::device_stream(device_);
  MIXTAPE_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                                   nccl_type(input.dtype()), static_cast<ncclComm_t>(comm_), stream),
                     label_);
}

void Comm::reduce_scatter(const Tensor& input, const Tensor& output, Reduction op) {
  check_tensor(input, "reduce_scatter");
  check_tensor(output, "reduce_scatter");
  if (output.numel() == 0) return;
  after_async();
  const cudaStream_t stream = cuda::device_stream(device_);
  // recvcount: the elements each rank receives (input holds nranks * recvcount).
  MIXTAPE_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(), static_cast<size_t>(output.numel()),
                                       nccl_type(input.dtype()), nccl_op(op), static_cast<ncclComm_t>(comm_),
                                       stream),
                     label_);
}

void Comm::broadcast(const Tensor& tensor, int root) {
  check_tensor(tensor, "broadcast");
  if (tensor.numel() == 0) return;
  after_async();
  const cudaStream_t stream = cuda::device_stream(device_);
  MIXTAPE_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), static_cast<size_t>(tensor.numel()),
                                   nccl_type(tensor.dtype()), root, static_cast<ncclComm_t>(comm_), stream),
                     label_);
}

void Comm::send(const Tensor& tensor, int peer) {
  check_tensor(tensor, "send");
  if (tensor.numel() == 0) return;
  after_async();
  const cudaStream_t stream = cuda::device_stream(device_);
  MIXTAPE_NCCL_CHECK(ncclSend(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), nccl_type(tensor.dtype()),
                              peer, static_cast<ncclComm_t>(comm_), stream),
                     label_);
}

void Comm::recv(const Tensor& tensor, int peer) {
  check_tensor(tensor, "recv");
  if (tensor.numel() == 0) return;
  after_async();
  const cudaStream_t stream = cuda::device_stream(device_);
  MIXTAPE_NCCL_CHECK(ncclRecv(tensor.data_ptr(), static_cast<size_t>(tensor.numel()), nccl_type(tensor.dtype()),
                              peer, static_cast<ncclComm_t>(comm_), stream),
                     label_);
}

#else  // no NCCL

bool built() { return false; }
std::string version() { return "none"; }
UniqueId unique_id() { not_supported("dist::nccl: this build of mixtape has no NCCL"); }
std::string gpu_identity(int) { not_supported("dist::nccl: this build of mixtape has no NCCL"); }
Comm::Comm(const UniqueId&, int, int, int, std::string) {
  not_supported("dist::nccl: this build of mixtape has no NCCL");
}
Comm::~Comm() = default;
void Comm::release() {}
void Comm::check_tensor(const Tensor&, const char*) const {}
void Comm::all_reduce(const Tensor&, Reduction) { not_supported("dist::nccl: no NCCL"); }
void Comm::all_gather(const Tensor&, const Tensor&) { not_supported("dist::nccl: no NCCL"); }
void Comm::reduce_scatter(const Tensor&, const Tensor&, Reduction) { not_supported("dist::nccl: no NCCL"); }
void Comm::broadcast(const Tensor&, int) { not_supported("dist::nccl: no NCCL"); }
void Comm::send(const Tensor&, int) { not_supported("dist::nccl: no NCCL"); }
void Comm::recv(const Tensor&, int) { not_supported("dist::nccl: no NCCL"); }
void* Comm::all_reduce_async(const Tensor&, Reduction) { not_supported("dist::nccl: no NCCL"); }
bool Comm::event_done(void*, int) { not_supported("dist::nccl: no NCCL"); }
void Comm::wait_event(void*, int) { not_supported("dist::nccl: no NCCL"); }
void Comm::after_async() {}

#endif

}  // namespace mixtape::dist::nccl
