#pragma once
// The safetensors file format (github.com/huggingface/safetensors), so checkpoints move to and from PyTorch:
//   [u64 little-endian N][N bytes of UTF-8 JSON header, space-padded][raw little-endian tensor data]
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
// the first data byte) and may hold "__metadata__", an object of string -> string.
#include <string>

#include "io/state_dict.h"

namespace mixtape {

// Writes every tensor (CPU only; dtype kept, made contiguous, named in sorted order, laid out in that order
// without gaps) and the metadata. The header is padded with spaces so the data starts at a multiple of 8
// bytes, as the reference writer does. Atomic: writes a temp file, fsyncs it, names it path + ".tmp.<pid>"
// and renames it over path, then fsyncs the directory; on any failure the temp file is removed, an existing
// file at path is left as it was, and Error names the path and the system's reason. The temp file is
// unnamed (O_TMPFILE) until its data is synced, where the file system allows it, so a process killed
// during the write leaves nothing behind; elsewhere (some FUSE, NFS) it is named from the start. Either
// way, a save first removes the "<path>.tmp.<pid>" regular files that saves killed before their rename
// left, those whose process no longer exists on this machine (a live process's is its save in progress).
// A symbolic link at path is written through (the file it points to is replaced, the link stays); only a
// regular file is replaced (a device, FIFO or directory is an Error).
void save_safetensors(const std::string& path, const StateDict& state);

// The file a write to `path` lands in: `path` itself unless it is a symbolic link, else the file the link
// names, followed link by link (a relative target read from the link's directory) whether or not that file
// exists yet (std::filesystem::weakly_canonical stops at such a dangling link, where open() would create
// its target). Error for a link that cannot be read or a chain of more than 40.
std::string write_destination(const std::string& path);

// Where save_safetensors(path) writes: the file `path` names, through a symbolic link the file it points to
// (the link stays). `problem` says why no checkpoint may go there ("exists and is not a regular file (a
// device); ..."), empty when it may; for callers that check before hours of work rather than after. With
// try_create it also creates and removes the temp file save_safetensors would write first (unnamed where
// the file system allows it: nothing appears in the directory), so a directory that does not exist or takes
// no new file ("cannot create a file there (No such file or directory: ...)") is found too.
struct SaveTarget {
  std::string path;
  std::string problem;
};
SaveTarget save_target(const std::string& path, bool try_create = false);

// Reads the whole file in one pass, validating all of it first: a truncated, corrupt or unsupported file is
// an Error naming the file and the problem, never a partial result. Reads F32, F16, BF16, F64, I32, I64.
//
// The header is read as it is parsed, keeping only the tensors' names, dtypes, shapes and offsets and the
// metadata, so the memory a load takes follows what the file describes: the header's text (read whole), the
// tensors, ~500 bytes and the name of each tensor, and the metadata. Whitespace, members the reader skips
// and refused values cost nothing. Beyond the format's own limit of 100,000,000 header bytes, the reader
// refuses (an Error naming the limit, "(the reader's limit)"), each far above what real checkpoints hold:
//   - more than 131,072 tensor entries (each costs ~500 bytes of memory, however small the tensor);
//   - a shape of more than 64 dimensions;
//   - more than 65,536 __metadata__ keys, or more than 32 MiB (33,554,432 bytes) of metadata keys and values;
//   - a string or number longer than 16 MiB (16,777,216 bytes) as written, or more than 16 MiB of JSON
//     without a string or a number ("[null,null,...]"; a run of whitespace counts one byte) (the JSON parser
//     holds the token it reads several times over, and copies what it reads between two such tokens);
//   - inside tensor entries, more than 65,536 keys besides dtype, shape and data_offsets (extra members,
//     which are skipped, and the objects inside them), or such a key longer than 256 bytes.
// Values from the file that an error message repeats (names, keys, dtypes, JSON values) are shown printable
// and cut after 100 characters (echo(), json::excerpt()).
StateDict load_safetensors(const std::string& path);

}  // namespace mixtape
