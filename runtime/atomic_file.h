#pragma once
// Crash-safe writes: a file or a directory is built under a temporary name in the same
// directory, fsynced, then renamed to its final name and the parent directory fsynced.
// A crash at any point leaves either the previous complete version or the new complete
// version under the final name, never a partial one; what remains is a temporary named
// `<final>.tmp-<pid>` that remove_stale_temporaries() deletes, which every AtomicFile and
// AtomicDirectory runs on its directory before it writes: a killed writer's leftovers go
// with the next write there. Every file memtune writes whole goes through these.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

namespace memtune {

// `<final>.tmp-<pid>` in final's directory.
std::filesystem::path temporary_name_for(const std::filesystem::path& final_path);

// fsyncs a file or a directory (directories: their entries, so a rename is durable).
void fsync_path(const std::filesystem::path& path);

// Removes a file or a whole directory tree without following symbolic links, as
// std::filesystem::remove_all does; a missing path removes nothing. Returns the entries
// removed (ec set and -1 on failure). Its own walk (nftw): the PyTorch wheel's libtorch.so
// exports a remove_all of its own that crashes when called from code built against the
// system's libstdc++, and the dynamic linker may bind memtune's calls to it.
std::uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec);
// The same; a failure is a UserError naming the path.
std::uintmax_t remove_tree(const std::filesystem::path& path);

// A file written under a temporary name, renamed over `final_path` by commit() (an
// existing file is replaced atomically). Destroying an uncommitted one removes the
// temporary.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path final_path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, std::size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  std::size_t bytes_written() const { return written_; }
  // fsync, rename, fsync the parent directory.
  void commit();

  const std::filesystem::path& temporary_path() const { return temp_; }
  const std::filesystem::path& final_path() const { return final_; }

 private:
  std::filesystem::path final_;
  std::filesystem::path temp_;
  int fd_ = -1;
  std::size_t written_ = 0;
};

// Makes `dir` (and its parents) for output; `what` names it in errors ("--out",
// "training.output_dir"). A path that exists as a file, or a directory that cannot be
// made, is a UserError with the path and the reason, never a raw filesystem_error.
void create_output_directory(const std::filesystem::path& dir, std::string_view what);

// Writes `bytes` to `path` atomically (AtomicFile in one call).
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// A directory (a checkpoint) built under `<final>.tmp-<pid>`; commit() fsyncs every file
// and directory inside, renames it to `final_path` and fsyncs the parent. The final name
// must not exist unless `replace_existing` (then the old directory is swapped out
// atomically and removed). Destroying an uncommitted one removes the temporary.
class AtomicDirectory {
 public:
  explicit AtomicDirectory(std::filesystem::path final_path, bool replace_existing = false);
  ~AtomicDirectory();
  AtomicDirectory(const AtomicDirectory&) = delete;
  AtomicDirectory& operator=(const AtomicDirectory&) = delete;

  // Where to write the files while building.
  const std::filesystem::path& path() const { return temp_; }
  const std::filesystem::path& final_path() const { return final_; }
  bool committed() const { return committed_; }
  void commit();

 private:
  std::filesystem::path final_;
  std::filesystem::path temp_;
  bool replace_;
  bool committed_ = false;
};

// Removes `*.tmp-<pid>` files and directories directly inside `dir` left by a process
// that died (its pid no longer runs, or it is this process but no live AtomicFile /
// AtomicDirectory owns the name: pids repeat across container restarts). Returns how
// many were removed.
int remove_stale_temporaries(const std::filesystem::path& dir);

}  // namespace memtune
