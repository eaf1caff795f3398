// safetensors reading and writing. The reader trusts nothing in the file: the header is parsed strictly and
// every entry is checked (dtype, shape, byte range, layout) before any tensor is allocated, so the memory
// allocated is bounded by the file's own size and a bad file is an Error, never a crash or partial load.
#include "io/safetensors.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <sstream>
#include <unordered_set>
#include <bit>
#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include "io/json.h"
#include "tensor/error.h"

namespace mixtape {

namespace {

// Tensor bytes are copied as they are in memory; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

// The reference reader refuses headers above 100 MB; a larger length is corruption, not a real header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::F8E4M3: case DType::F8E5M2: case DType::F8E8M0: case DType::F4E2M1: break;  // refused on save
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  for (DType dtype : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I32, DType::I64})
    if (name == safetensors_dtype_name(dtype)) return dtype;
  return std::nullopt;
}

// The reference writer lays tensors out by descending position in its Dtype enum (... F16, BF16, I32, F32,
// F64, I64), then by name. Following it makes our files byte-identical to Python's for the same tensors, and
// (the header being padded to 8 bytes) starts every tensor at a multiple of its element size.
int layout_rank(DType dtype) {
  switch (dtype) {
    case DType::I64: return 0;
    case DType::F64: return 1;
    case DType::F32: return 2;
    case DType::I32: return 3;
    case DType::BF16: return 4;
    case DType::F16: return 5;
    case DType::F8E4M3: case DType::F8E5M2: case DType::F8E8M0: case DType::F4E2M1: break;  // refused on save
  }
  return 6;
}

std::string system_error_text(int error_number) { return std::strerror(error_number); }

// Writes all of [data, data + size) or returns the errno of the failure (0 on success).
int write_all(int fd, const void* data, size_t size) {
  const char* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t written = ::write(fd, bytes, size);
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    bytes += written;
    size -= static_cast<size_t>(written);
  }
  return 0;
}

// Reads exactly size bytes. Returns 0 on success, the errno of a failed read, or -1 at a premature end.
int read_all(int fd, void* data, size_t size) {
  char* bytes = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t got = ::read(fd, bytes, size);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return -1;
    bytes += got;
    size -= static_cast<size_t>(got);
  }
  return 0;
}

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string file_name_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A path from outside inside an error message, quoted: printable, and bounded by the longest path Linux takes.
std::string shown_path(const std::string& path) {
  std::string text = "'";
  text += echo(path, 4096);
  text += '\'';
  return text;
}

// The name a save's temp file has (or takes just before its rename): "<target>.tmp.<pid>", the pattern
// remove_stale_temp_files recognises.
std::string temp_path_of(const std::string& target) { return target + ".tmp." + std::to_string(::getpid()); }

// The pid of a name "<target's file name>.tmp.<pid>" (pid written as std::to_string writes it: decimal, no
// sign, no leading zero, at most 10 digits, > 0), or 0 for any other name.
pid_t temp_file_pid(const std::string& name, const std::string& target_name) {
  const std::string prefix = target_name + ".tmp.";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return 0;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 10 || digits[0] == '0') return 0;
  uint64_t pid = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return 0;
    pid = pid * 10 + static_cast<uint64_t>(c - '0');
  }
  return pid <= static_cast<uint64_t>(INT32_MAX) ? static_cast<pid_t>(pid) : 0;
}

// Removes the temp files that saves to `target` killed between their write and their rename left behind:
// regular files named exactly "<target>.tmp.<pid>" whose process no longer exists (kill(pid, 0) says ESRCH).
// A live process's file is its save in progress and stays, and so does every other name. Pids are this
// machine's: a directory shared with other machines (NFS) must not take saves to one target from two of
// them. Best effort: a file that cannot be removed stays, and the save goes on.
void remove_stale_temp_files(const std::string& target) {
  const std::string target_name = file_name_of(target);
  DIR* directory = ::opendir(directory_of(target).c_str());
  if (directory == nullptr) return;
  const int directory_fd = ::dirfd(directory);
  while (const dirent* entry = ::readdir(directory)) {
    const pid_t pid = temp_file_pid(entry->d_name, target_name);
    if (pid == 0 || pid == ::getpid()) continue;
    struct stat info;
    if (::fstatat(directory_fd, entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(info.st_mode))
      continue;
    if (::kill(pid, 0) == -1 && errno == ESRCH) ::unlinkat(directory_fd, entry->d_name, 0);
  }
  ::closedir(directory);
}

// The file a save writes before it takes the target's name. Unnamed (O_TMPFILE) where the file system makes
// such files: nothing of it is visible until the written, synced file is linked in as "<target>.tmp.<pid>"
// and at once renamed over the target, so a process killed during the write leaves nothing behind, and one
// killed in the microseconds between the link and the rename leaves a file the next save removes. Where the
// file system refuses O_TMPFILE (some FUSE, NFS and older tmpfs), it is that named file from the start.
// Closed, and its name removed, unless commit() renamed it over the target.
class TempFile {
 public:
  // Opens the temp file of a save to `target`; error() is the errno of a failure to create it, 0 on success.
  explicit TempFile(std::string target) : target_(std::move(target)), path_(temp_path_of(target_)) {
    // The unnamed file is linked through /proc/self/fd: without /proc it could be written but never named.
    if (::access("/proc/self/fd", X_OK) == 0) {
      fd_ = ::open(directory_of(target_).c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
      if (fd_ >= 0) return;
      if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
        error_ = errno;
        return;
      }
    }
    // The name is this process's own: a file there is a temp file of a dead process of the same pid.
    named_ = true;
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0) error_ = errno;
    else owns_name_ = true;
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (owns_name_ && !committed_) ::unlink(path_.c_str());
  }
  int error() const { return error_; }
  int fd() const { return fd_; }
  // For error messages: "the temp file '<path>'", or "an unnamed temp file in '<directory>'" before its link.
  std::string described() const {
    return named_ ? "the temp file " + shown_path(path_)
                  : "an unnamed temp file in " + shown_path(directory_of(target_));
  }
  // Returns the errno of close(), 0 on success. Close reports deferred write errors (NFS, quota).
  int close() {
    const int result = ::close(fd_);
    fd_ = -1;
    return result == 0 ? 0 : errno;
  }
  // Links the unnamed file in as "<target>.tmp.<pid>" (the fd still open); nothing for a named one. Returns
  // the errno of a failure, 0 on success.
  int name() {
    if (named_) return 0;
    const std::string self = "/proc/self/fd/" + std::to_string(fd_);
    auto link = [&] {
      return ::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, path_.c_str(), AT_SYMLINK_FOLLOW) == 0 ? 0 : errno;
    };
    int status = link();
    struct stat info;
    // As for the named file: a regular file there is a dead process's, and this save's name to take.
    if (status == EEXIST && ::lstat(path_.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
        ::unlink(path_.c_str()) == 0)
      status = link();
    if (status != 0) return status;
    named_ = owns_name_ = true;
    return 0;
  }
  // Renames the named, closed file over the target: the one step that replaces it. Returns the errno of a
  // failure, 0 on success.
  int commit() {
    if (::rename(path_.c_str(), target_.c_str()) != 0) return errno;
    committed_ = true;
    return 0;
  }

 private:
  std::string target_;
  std::string path_;
  int fd_ = -1;
  int error_ = 0;
  bool named_ = false;      // the file is, or was to be, path_ (not unnamed)
  bool owns_name_ = false;  // path_ is this save's file, to remove unless committed
  bool committed_ = false;
};

struct Entry {
  std::string name;
  Tensor tensor;  // contiguous, CPU
  uint64_t bytes;
};

}  // namespace

std::string write_destination(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p = path;
  for (int hops = 0; hops <= 40; ++hops) {  // Linux's limit (ELOOP) is 40 links
    std::error_code error;
    if (!fs::is_symlink(fs::symlink_status(p, error))) return p.string();
    const fs::path target = fs::read_symlink(p, error);
    check(!error, shown_path(path), " is a symbolic link that cannot be read: ", error.message());
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  fail(shown_path(path), " is a symbolic link that leads through more than 40 links (a loop?)");
}

SaveTarget save_target(const std::string& path, bool try_create) {
  SaveTarget where{path, ""};
  struct stat info;
  try {
    where.path = write_destination(path);
  } catch (const Error& error) {
    return {path, std::string("cannot be resolved: ") + error.what()};
  }
  if (::stat(where.path.c_str(), &info) == 0 && !S_ISREG(info.st_mode))
    where.problem = std::string("exists and is not a regular file (") +
                    (S_ISDIR(info.st_mode)                           ? "a directory"
                     : S_ISCHR(info.st_mode) || S_ISBLK(info.st_mode) ? "a device"
                     : S_ISFIFO(info.st_mode)                         ? "a FIFO"
                                                                      : "a special file") +
                    "); a checkpoint replaces only a regular file";
  if (where.problem.empty() && try_create) {
    // The temp file save_safetensors would write first, closed (and its name, if it has one, removed) at
    // once.
    const TempFile probe(where.path);
    if (probe.error() != 0)
      where.problem = "cannot be written: cannot create a file there (" + system_error_text(probe.error()) +
                      ", creating " + probe.described() + ")";
  }
  return where;
}

namespace {

// The checkpoint's bytes before the tensor data: the 8-byte length and the JSON header, padded with spaces
// so that the data starts at a multiple of 8 bytes; `entries` receives the tensors in their layout order.
std::string encode_header(const std::string& path, const StateDict& state, std::vector<Entry>& entries) {
  for (const auto& [name, tensor] : state.tensors) {
    check(name != "__metadata__", "save_safetensors: ", shown_path(path),
          ": a tensor may not be named '__metadata__' (the key is reserved for metadata)");
    check(json::is_valid_utf8(name), "save_safetensors: ", shown_path(path), ": tensor name '", echo(name),
          "' is not valid UTF-8");
    check(tensor.defined(), "save_safetensors: ", shown_path(path), ": tensor '", echo(name), "' is undefined");
    check(!is_minifloat(tensor.dtype()), "save_safetensors: ", shown_path(path), ": tensor '", echo(name), "' is ",
          tensor.description(), "; not supported: fp8 and fp4 tensors in a file (convert it to f32 or bf16)");
    // Device tensors are copied to the host here: a checkpoint is always plain bytes in a file.
    Tensor contiguous = tensor.detach().contiguous().to(Device::cpu());
    const uint64_t bytes = static_cast<uint64_t>(contiguous.numel()) * dtype_size(contiguous.dtype());
    entries.push_back({name, contiguous, bytes});
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return layout_rank(a.tensor.dtype()) < layout_rank(b.tensor.dtype());
  });

  // Members are appended without a search for the key (json::append_member): tensor names and metadata keys
  // are unique, and tensor names differ from "__metadata__".
  Json header = Json::object();
  if (!state.metadata.empty()) {
    Json metadata = Json::object();
    for (const auto& [key, value] : state.metadata) {
      check(json::is_valid_utf8(key) && json::is_valid_utf8(value), "save_safetensors: ", shown_path(path),
            ": metadata entry '", echo(key), "' is not valid UTF-8");
      json::append_member(metadata, key, value);
    }
    json::append_member(header, "__metadata__", std::move(metadata));
  }
  uint64_t offset = 0;
  for (const Entry& entry : entries) {
    Json shape = Json::array();
    for (int64_t size : entry.tensor.shape()) shape.push_back(size);
    const Json offsets = Json::array({static_cast<int64_t>(offset), static_cast<int64_t>(offset + entry.bytes)});
    json::append_member(header, entry.name,
                        Json::object({{"dtype", safetensors_dtype_name(entry.tensor.dtype())},
                                      {"shape", std::move(shape)},
                                      {"data_offsets", offsets}}));
    offset += entry.bytes;
  }
  std::string header_text = json::dump(header);
  // Spaces are JSON whitespace: padding the header to a multiple of 8 aligns the data region for mmap
  // readers.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(static_cast<uint64_t>(header_text.size()) >> (8 * i));
  return bytes + header_text;
}

}  // namespace

void save_safetensors(const std::string& path, const StateDict& state) {
  // ---- check everything and build the header before touching the file system ----
  std::vector<Entry> entries;
  const std::string header = encode_header(path, state, entries);

  // ---- write the temp file, sync it, name it, rename it over the target ----
  const SaveTarget where = save_target(path);
  check(where.problem.empty(), "save_safetensors: ", shown_path(path), " ", where.problem);
  const std::string& target = where.path;
  remove_stale_temp_files(target);
  TempFile temp(target);
  auto io_error = [&](int error_number, const char* step) {
    fail("save_safetensors: cannot write ", shown_path(path), ": ", system_error_text(error_number), " (", step,
         " ", temp.described(), ")");
  };
  if (temp.error() != 0) io_error(temp.error(), "creating");
  int status = write_all(temp.fd(), header.data(), header.size());
  for (const Entry& entry : entries) {
    if (status != 0) break;
    if (entry.bytes > 0) status = write_all(temp.fd(), entry.tensor.data_ptr(), entry.bytes);
  }
  if (status != 0) io_error(status, "writing");
  if (::fsync(temp.fd()) != 0) io_error(errno, "syncing");
  if ((status = temp.name()) != 0)
    fail("save_safetensors: cannot write ", shown_path(path), ": ", system_error_text(status),
         " (naming the temp file ", shown_path(temp_path_of(target)), ")");
  if ((status = temp.close()) != 0) io_error(status, "closing");
  if ((status = temp.commit()) != 0) io_error(status, "renaming");
  // Make the rename itself durable. Best effort: the data is already safely in place under its name.
  const int directory = ::open(directory_of(target).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory >= 0) {
    ::fsync(directory);
    ::close(directory);
  }
}

namespace {

// The reader's limits (io/safetensors.h lists them): generous for real checkpoints, and small enough that
// what a header describes, not how it is padded, decides the memory a load takes.
constexpr size_t kMaxTensors = 131'072;  // each costs about 500 bytes however small it is
constexpr size_t kMaxRank = 64;  // dimensions of one tensor (models use 1 to 4)
constexpr size_t kMaxMetadataKeys = 65'536;
constexpr size_t kMaxMetadataBytes = size_t{32} << 20;  // keys and values together, as read
constexpr size_t kMaxTokenBytes = size_t{16} << 20;     // one string or number as written
constexpr size_t kMaxOtherKeys = 65'536;     // keys besides dtype, shape and data_offsets inside tensor entries
constexpr size_t kMaxOtherKeyBytes = 256;    // each of those

// A problem found in the header's contents (not its JSON syntax): reported as it is.
class HeaderProblem : public Error {
 public:
  using Error::Error;
};

// What load_safetensors reads of one tensor, before its bytes.
struct Planned {
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

// Reads the header's values as the parser meets them, keeping only the tensors' plan and the metadata:
// memory grows with what the header describes, not with its length (padding, skipped members, refused
// values cost nothing). A value of the wrong kind is reported once it ends, as an excerpt of its text; a
// count that passes a limit is reported at once.
class HeaderReader final : public json::Handler {
 public:
  HeaderReader(std::string_view text, const std::string& path, std::map<std::string, std::string>& metadata)
      : text_(text), path_(path), metadata_(metadata) {}

  std::map<std::string, Planned>& tensors() { return tensors_; }

  void scalar(Json value, size_t begin, size_t end) override {
    value_done(next_role(), Item{json::kind_name(value), std::move(value), begin, end});
  }
  void begin_object(size_t begin) override { open(next_role(), "object", begin); }
  void begin_array(size_t begin) override { open(next_role(), "array", begin); }
  void end_object(size_t end) override { close(end); }
  void end_array(size_t end) override { close(end); }
  void key(std::string key, size_t begin) override;

 private:
  // What a value is to the reader, from where it stands.
  enum class Role { Header, Metadata, MetadataValue, Entry, Dtype, Shape, ShapeEntry, Offsets, OffsetsEntry, Skipped };

  // A value of the header as read: its kind, the value itself for a scalar, its text [begin, end).
  struct Item {
    const char* kind = nullptr;  // null: absent
    Json value;
    size_t begin = 0, end = 0;
  };

  // The tensor entry being read: its fields, checked when it ends.
  struct Entry {
    std::string name;
    Planned* planned = nullptr;
    Item dtype, shape, offsets;
    std::vector<Item> extents;  // of shape, up to kMaxRank of them
    size_t rank = 0;            // entries of shape (all of them, counted past kMaxRank)
    std::vector<Item> bounds;   // of data_offsets, up to 2 of them
    size_t bound_count = 0;
  };

  // An array or object being read.
  struct Level {
    Role role;
    const char* kind;
    size_t begin;
    bool structured;  // read member by member: the header, __metadata__, an entry, its shape and data_offsets
    bool refused;     // inside a value of the wrong kind
    std::unordered_set<std::string> keys;  // of an object read as Skipped, or an entry's other members
  };

  template <class... Parts>
  [[noreturn]] void problem(const Parts&... parts) const {
    std::ostringstream message;
    ((message << "load_safetensors: " << shown_path(path_) << ": ") << ... << parts);
    throw HeaderProblem(message.str());
  }

  std::string excerpt(const Item& item) const { return json::excerpt(text_.substr(item.begin, item.end - item.begin)); }
  std::string tensor() const { return "tensor '" + echo(entry_.name) + "'"; }

  Role next_role() const;
  void open(Role role, const char* kind, size_t begin);
  void close(size_t end);
  void value_done(Role role, Item item);
  void metadata_value(Item item);
  void finish_entry();
  uint64_t read_count(const Item& item, const char* field) const;

  std::string_view text_;
  const std::string& path_;
  std::map<std::string, std::string>& metadata_;
  std::map<std::string, Planned> tensors_;
  std::vector<Level> levels_;  // outermost first
  std::string key_;            // of the member whose value comes next
  bool metadata_seen_ = false;
  const std::string* metadata_key_ = nullptr;  // of the __metadata__ member whose value comes next
  std::string* metadata_value_ = nullptr;      // where that value goes
  size_t metadata_bytes_ = 0;
  size_t other_keys_ = 0;
  Entry entry_;
};

HeaderReader::Role HeaderReader::next_role() const {
  if (levels_.empty()) return Role::Header;
  const Level& parent = levels_.back();
  if (!parent.structured) return Role::Skipped;
  switch (parent.role) {
    case Role::Header: return key_ == "__metadata__" ? Role::Metadata : Role::Entry;
    case Role::Metadata: return Role::MetadataValue;
    case Role::Entry:
      if (key_ == "dtype") return Role::Dtype;
      if (key_ == "shape") return Role::Shape;
      if (key_ == "data_offsets") return Role::Offsets;
      return Role::Skipped;
    case Role::Shape: return Role::ShapeEntry;
    case Role::Offsets: return Role::OffsetsEntry;
    default: return Role::Skipped;
  }
}

void HeaderReader::key(std::string key, size_t begin) {
  Level& object = levels_.back();
  if (object.structured && object.role == Role::Header) {
    if (key == "__metadata__") {
      if (metadata_seen_) json::duplicate_key(key, begin);
      metadata_seen_ = true;
    } else {
      if (tensors_.size() >= kMaxTensors)
        problem("the header has more than ", kMaxTensors, " tensor entries (the reader's limit)");
      if (tensors_.count(key)) json::duplicate_key(key, begin);
    }
  } else if (object.structured && object.role == Role::Metadata) {
    if (metadata_.size() >= kMaxMetadataKeys)
      problem("__metadata__ has more than ", kMaxMetadataKeys, " keys (the reader's limit)");
    metadata_bytes_ += key.size();
    if (metadata_bytes_ > kMaxMetadataBytes)
      problem("__metadata__ holds more than ", kMaxMetadataBytes, " bytes of keys and values (the reader's limit)");
    const auto [member, added] = metadata_.try_emplace(key);
    if (!added) json::duplicate_key(key, begin);
    metadata_key_ = &member->first;
    metadata_value_ = &member->second;
  } else if (object.refused) {
    // Nothing inside a refused value is kept, its keys neither.
  } else if (!(object.structured && object.role == Role::Entry &&
               (key == "dtype" || key == "shape" || key == "data_offsets") && object.keys.insert(key).second)) {
    // A member the reader skips (or a repeated field, refused below as a duplicate): its key is kept to
    // refuse a duplicate, so such keys are bounded in number and length.
    if (object.keys.count(key)) json::duplicate_key(key, begin);
    if (++other_keys_ > kMaxOtherKeys)
      problem("the tensor entries hold more than ", kMaxOtherKeys,
              " keys besides dtype, shape and data_offsets (the reader's limit)");
    if (key.size() > kMaxOtherKeyBytes)
      problem("the key '", echo(key), "' in the entry of ", tensor(), " is longer than ", kMaxOtherKeyBytes,
              " bytes (the reader's limit for keys besides dtype, shape and data_offsets)");
    object.keys.insert(key);
  }
  key_ = std::move(key);
}

void HeaderReader::open(Role role, const char* kind, size_t begin) {
  const bool object = kind[0] == 'o';
  // The header, __metadata__ and a tensor entry are objects: any other kind is refused at its first byte.
  if (role == Role::Header && !object) problem("the header is a JSON array, not an object");
  if (role == Role::Metadata && !object) problem("__metadata__ is a JSON array, expected an object of strings");
  if (role == Role::Entry && !object) {
    entry_.name = key_;
    problem("header entry of ", tensor(), " is a JSON array, expected an object with dtype, shape and data_offsets");
  }
  if (role == Role::Entry) {
    auto placed = tensors_.try_emplace(key_).first;
    entry_ = Entry{};
    entry_.name = placed->first;
    entry_.planned = &placed->second;
  }
  const bool structured = (object && (role == Role::Header || role == Role::Metadata || role == Role::Entry)) ||
                          (!object && (role == Role::Shape || role == Role::Offsets));
  // A value of the wrong kind is refused when it ends, whatever it holds: nothing in it is checked or kept.
  const bool refused = (!levels_.empty() && levels_.back().refused) || (!structured && role != Role::Skipped);
  levels_.push_back({role, kind, begin, structured, refused, {}});
}

void HeaderReader::close(size_t end) {
  Level level = std::move(levels_.back());
  levels_.pop_back();
  if (level.structured && level.role == Role::Entry) return finish_entry();
  if (level.structured && (level.role == Role::Header || level.role == Role::Metadata)) return;
  value_done(level.role, Item{level.kind, Json(), level.begin, end});
}

void HeaderReader::value_done(Role role, Item item) {
  switch (role) {
    case Role::Header: problem("the header is a JSON ", item.kind, ", not an object");
    case Role::Metadata: problem("__metadata__ is a JSON ", item.kind, ", expected an object of strings");
    case Role::Entry:
      entry_.name = key_;
      problem("header entry of ", tensor(), " is a JSON ", item.kind,
              ", expected an object with dtype, shape and data_offsets");
    case Role::MetadataValue: return metadata_value(std::move(item));
    case Role::Dtype: entry_.dtype = std::move(item); return;
    case Role::Shape: entry_.shape = std::move(item); return;
    case Role::Offsets: entry_.offsets = std::move(item); return;
    case Role::ShapeEntry:
      if (++entry_.rank <= kMaxRank) entry_.extents.push_back(std::move(item));
      return;
    case Role::OffsetsEntry:
      if (++entry_.bound_count <= 2) entry_.bounds.push_back(std::move(item));
      return;
    case Role::Skipped: return;
  }
}

void HeaderReader::metadata_value(Item item) {
  if (!item.value.is_string())
    problem("__metadata__ value of '", echo(*metadata_key_), "' is a JSON ", item.kind, " (", excerpt(item),
            "), expected a string");
  std::string& value = item.value.get_ref<std::string&>();
  metadata_bytes_ += value.size();
  if (metadata_bytes_ > kMaxMetadataBytes)
    problem("__metadata__ holds more than ", kMaxMetadataBytes, " bytes of keys and values (the reader's limit)");
  *metadata_value_ = std::move(value);
}

// A non-negative integer, or an error naming the field and the tensor.
uint64_t HeaderReader::read_count(const Item& item, const char* field) const {
  if (!item.value.is_number_integer() || json::as_integer(item.value) < 0)
    problem(field, " of ", tensor(), " has the entry ", excerpt(item),
            item.value.is_number_float() ? " (written with a fraction or an exponent, or beyond int64)" : "",
            ", expected a non-negative integer");
  return static_cast<uint64_t>(json::as_integer(item.value));
}

// The entry's checks, in the order: fields present, dtype, shape, data_offsets.
void HeaderReader::finish_entry() {
  Entry& e = entry_;
  using Field = std::pair<const char*, const Item*>;
  for (auto [field, item] : std::initializer_list<Field>{{"dtype", &e.dtype}, {"shape", &e.shape},
                                                          {"data_offsets", &e.offsets}})
    if (item->kind == nullptr) problem("header entry of ", tensor(), " lacks \"", field, "\"");

  if (!e.dtype.value.is_string()) problem("dtype of ", tensor(), " is ", excerpt(e.dtype), ", expected a string");
  const std::string& dtype_name = json::as_string(e.dtype.value);
  const std::optional<DType> dtype = dtype_from_safetensors(dtype_name);
  if (!dtype)
    problem("not supported: dtype ", echo(dtype_name), " in ", tensor(),
            " (mixtape reads F32, F16, BF16, F64, I32 and I64)");

  if (e.shape.kind != std::string_view("array")) problem("shape of ", tensor(), " is ", excerpt(e.shape), ", expected an array");
  // No model has tensors of more than a handful of dimensions: a longer shape is refused (its entries past
  // the limit were counted, not kept).
  if (e.rank > kMaxRank)
    problem("shape of ", tensor(), " has ", e.rank, " dimensions, more than the ", kMaxRank, " this reader accepts");
  Planned& planned = *e.planned;
  planned.dtype = *dtype;
  // numel * itemsize, with overflow detected: a hostile shape must not wrap around to a small size. The
  // product of the non-zero extents must fit int64 even when some extent is 0, or the strides would not.
  uint64_t nonzero_product = 1;
  bool has_zero = false, overflow = false;
  for (const Item& size : e.extents) {
    const uint64_t extent = read_count(size, "shape");
    if (extent == 0) has_zero = true;
    else overflow = overflow || __builtin_mul_overflow(nonzero_product, extent, &nonzero_product);
    planned.shape.push_back(static_cast<int64_t>(extent));
  }
  uint64_t bytes = 0;
  if (!has_zero) overflow = overflow || __builtin_mul_overflow(nonzero_product, dtype_size(*dtype), &bytes);
  if (overflow || nonzero_product > static_cast<uint64_t>(INT64_MAX))
    problem("shape ", excerpt(e.shape), " of ", tensor(), " is too large (more than 2^63 elements or bytes)");

  if (e.offsets.kind != std::string_view("array") || e.bound_count != 2)
    problem("data_offsets of ", tensor(), " is ", excerpt(e.offsets), ", expected [begin, end]");
  planned.begin = read_count(e.bounds[0], "data_offsets");
  planned.end = read_count(e.bounds[1], "data_offsets");
  if (planned.end < planned.begin)
    problem("data_offsets [", planned.begin, ", ", planned.end, "] of ", tensor(), " end before they begin");
  if (planned.end - planned.begin != bytes)
    problem(tensor(), " has data_offsets [", planned.begin, ", ", planned.end, "] (", planned.end - planned.begin,
            " bytes) but ", dtype_name, " ", shape_str(planned.shape), " needs ", bytes, " bytes");
  entry_ = Entry{};
}

class Loader {
 public:
  explicit Loader(const std::string& path) : path_(path) {}

  StateDict load() {
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever; it is then refused as
    // not a regular file. (On a regular file the flag changes nothing.)
    const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) problem("cannot open: ", system_error_text(errno));
    struct FdCloser {
      int fd;
      ~FdCloser() { ::close(fd); }
    } closer{fd};
    struct stat info;
    if (::fstat(fd, &info) != 0) problem("cannot stat: ", system_error_text(errno));
    if (!S_ISREG(info.st_mode)) problem("not a regular file");
    file_size_ = static_cast<uint64_t>(info.st_size);

    const uint64_t header_length = read_header_length(fd);
    StateDict state;
    std::map<std::string, Planned> plan = read_header(fd, header_length, state.metadata);
    read_data(fd, file_size_ - 8 - header_length, plan, state);
    return state;
  }

 private:
  template <class... Parts>
  [[noreturn]] void problem(const Parts&... parts) const {
    fail("load_safetensors: ", shown_path(path_), ": ", parts...);
  }

  void read_exactly(int fd, void* data, uint64_t size, const std::string& what) const {
    const int status = read_all(fd, data, size);
    if (status == -1) problem("truncated: the file ended while reading ", what);
    if (status != 0) problem("cannot read ", what, ": ", system_error_text(status));
  }

  // The 8-byte little-endian length of the JSON header. A file of another kind (a text file, a PyTorch
  // pickle) shows here as a length beyond the file or the format's limit, and is named for what it is.
  uint64_t read_header_length(int fd) {
    if (file_size_ < 8)
      problem("truncated: the file is ", file_size_, " bytes, shorter than the 8-byte header length");
    char length_bytes[9] = {};
    read_exactly(fd, length_bytes, 8, "the header length");
    uint64_t header_length = 0;
    for (int i = 0; i < 8; ++i) header_length |= static_cast<uint64_t>(static_cast<unsigned char>(length_bytes[i])) << (8 * i);
    if (header_length > kMaxHeaderBytes || header_length > file_size_ - 8) {
      const bool brace_follows = ::pread(fd, &length_bytes[8], 1, 8) == 1 && length_bytes[8] == '{';
      if (!brace_follows)
        problem("is not a safetensors file: it starts with the bytes '", echo(std::string_view(length_bytes, 8)),
                "' (a safetensors file starts with an 8-byte little-endian header length, then '{')");
    }
    if (header_length > kMaxHeaderBytes)
      problem("header length ", header_length, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
    if (header_length > file_size_ - 8)
      problem("truncated or corrupt: header length ", header_length, " is larger than the ", file_size_ - 8,
              " bytes after the length field");
    return header_length;
  }

  // The tensors the header describes, by name, each checked on its own; the metadata goes into `metadata`.
  std::map<std::string, Planned> read_header(int fd, uint64_t header_length,
                                             std::map<std::string, std::string>& metadata) const {
    std::string text(header_length, '\0');
    read_exactly(fd, text.data(), header_length, "the header");
    HeaderReader reader(text, path_, metadata);
    try {
      json::parse(text, reader, json::Limits{kMaxTokenBytes});
    } catch (const HeaderProblem&) {
      throw;
    } catch (const Error& error) {
      problem("invalid JSON header (byte offsets count from the header's start, file byte 8): ", error.what());
    } catch (const std::bad_alloc&) {
      problem("out of memory parsing its ", header_length, "-byte JSON header");
    }
    return std::move(reader.tensors());
  }

  // Checks that the tensors tile [0, data_size) exactly, then reads them in one sequential pass (fd stands
  // at the data region, the header having just been read).
  void read_data(int fd, uint64_t data_size, std::map<std::string, Planned>& plan, StateDict& state) const {
    std::vector<std::map<std::string, Planned>::iterator> order;
    order.reserve(plan.size());
    for (auto it = plan.begin(); it != plan.end(); ++it) order.push_back(it);
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
      return a->second.begin != b->second.begin ? a->second.begin < b->second.begin : a->second.end < b->second.end;
    });
    uint64_t position = 0;
    for (const auto& it : order) {
      const Planned& tensor = it->second;
      const std::string name = echo(it->first);
      if (tensor.end > data_size)
        problem("data_offsets [", tensor.begin, ", ", tensor.end, "] of tensor '", name,
                "' are outside the data region of ", data_size, " bytes (truncated file?)");
      if (tensor.begin > position)
        problem("gap in the data: no tensor covers bytes [", position, ", ", tensor.begin, ") before tensor '",
                name, "'");
      if (tensor.begin < position)
        problem("tensor '", name, "' at data_offsets [", tensor.begin, ", ", tensor.end,
                "] overlaps the tensor before it, which ends at ", position);
      position = tensor.end;
    }
    if (position != data_size)
      problem("the data region is ", data_size, " bytes but the tensors end at byte ", position,
              " (trailing bytes)");

    for (const auto& it : order) {
      auto planned = plan.extract(it);  // its name moves into the state, its plan goes
      const Planned& tensor = planned.mapped();
      Tensor values = Tensor::empty(tensor.shape, tensor.dtype);
      if (tensor.end > tensor.begin)
        read_exactly(fd, values.data_ptr(), tensor.end - tensor.begin, "tensor '" + echo(planned.key()) + "'");
      state.tensors.emplace(std::move(planned.key()), std::move(values));
    }
  }

  std::string path_;
  uint64_t file_size_ = 0;
};

}  // namespace

StateDict load_safetensors(const std::string& path) { return Loader(path).load(); }

}  // namespace mixtape
