#include "runtime/atomic_file.h"

#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "runtime/error.h"

namespace memtune {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kTempMarker = ".tmp-";

// Temporaries owned by live AtomicFile / AtomicDirectory objects of this process, so
// remove_stale_temporaries() never deletes work in progress.
std::mutex& live_mutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& live_temporaries() {
  static std::set<std::string> s;
  return s;
}
void register_live(const fs::path& p) {
  std::lock_guard<std::mutex> lock(live_mutex());
  live_temporaries().insert(fs::absolute(p).lexically_normal().string());
}
void unregister_live(const fs::path& p) {
  std::lock_guard<std::mutex> lock(live_mutex());
  live_temporaries().erase(fs::absolute(p).lexically_normal().string());
}
bool is_live(const fs::path& p) {
  std::lock_guard<std::mutex> lock(live_mutex());
  return live_temporaries().count(fs::absolute(p).lexically_normal().string()) > 0;
}

std::string errno_text() { return std::strerror(errno); }

fs::path parent_of(const fs::path& p) {
  fs::path parent = p.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// Removes a leftover temporary of ours (same pid, no live owner) before reusing its name.
void clear_dead_temporary(const fs::path& temp) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(temp, ec))) return;
  MEMTUNE_CHECK(!is_live(temp), "atomic write: ", temp,
                " is already being written by this process", "",
                "; write each target from one place at a time");
  remove_tree(temp, ec);
  MEMTUNE_CHECK(!ec, "atomic write: cannot remove the leftover temporary ", temp, ": ",
                ec.message());
}

void fsync_tree(const fs::path& root) {
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (entry.is_symlink()) continue;  // its target is not ours to sync
    if (entry.is_regular_file() || entry.is_directory()) fsync_path(entry.path());
  }
  fsync_path(root);
}

// rename(2) with renameat2's flags where the filesystem has them; returns errno or 0.
int rename_with_flags(const fs::path& from, const fs::path& to, unsigned flags) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags) == 0) return 0;
  return errno;
}

}  // namespace

fs::path temporary_name_for(const fs::path& final_path) {
  fs::path p = final_path;
  if (!p.has_filename()) p = p.parent_path();  // "dir/" -> "dir"
  return parent_of(p) / (p.filename().string() + std::string(kTempMarker) +
                         std::to_string(::getpid()));
}

void fsync_path(const fs::path& path) {
  const bool is_dir = fs::is_directory(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (is_dir ? O_DIRECTORY : 0));
  MEMTUNE_CHECK(fd >= 0, "fsync: cannot open ", path, ": ", errno_text());
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  const int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on directories (EINVAL); the data is as durable as they
  // allow, so that is not an error.
  MEMTUNE_CHECK(rc == 0 || (is_dir && err == EINVAL), "fsync: ", path, " failed: ",
                std::strerror(err), "; is the disk full or failing?");
}

// ---- AtomicFile ----

AtomicFile::AtomicFile(fs::path final_path)
    : final_(std::move(final_path)), temp_(temporary_name_for(final_)) {
  MEMTUNE_CHECK(!fs::is_directory(final_), "atomic write: ", final_,
                " is a directory, expected a file path");
  fs::create_directories(parent_of(final_));
  remove_stale_temporaries(parent_of(final_));  // what killed writers left here
  clear_dead_temporary(temp_);
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  MEMTUNE_CHECK(fd_ >= 0, "atomic write: cannot create ", temp_, ": ", errno_text(),
                "; check that the directory is writable");
  register_live(temp_);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) {
    std::error_code ec;
    fs::remove(temp_, ec);
    unregister_live(temp_);
  }
}

void AtomicFile::write(const void* data, std::size_t size) {
  MEMTUNE_INTERNAL_ASSERT(fd_ >= 0, "atomic write: ", final_, " is already committed");
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    // Linux writes at most ~2 GiB per call.
    const std::size_t chunk = size < (std::size_t(1) << 30) ? size : (std::size_t(1) << 30);
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0 && errno == EINTR) continue;
    MEMTUNE_CHECK(n > 0, "atomic write: writing ", temp_, " failed after ", written_,
                  " bytes: ", errno_text(), "; is the disk full?");
    p += n;
    size -= static_cast<std::size_t>(n);
    written_ += static_cast<std::size_t>(n);
  }
}

void AtomicFile::commit() {
  MEMTUNE_INTERNAL_ASSERT(fd_ >= 0, "atomic write: ", final_, " is already committed");
  int rc;
  do {
    rc = ::fsync(fd_);
  } while (rc != 0 && errno == EINTR);
  MEMTUNE_CHECK(rc == 0, "atomic write: fsync of ", temp_, " failed: ", errno_text());
  MEMTUNE_CHECK(::close(fd_) == 0, "atomic write: closing ", temp_, " failed: ", errno_text());
  fd_ = -1;
  MEMTUNE_CHECK(::rename(temp_.c_str(), final_.c_str()) == 0, "atomic write: renaming ", temp_,
                " to ", final_, " failed: ", errno_text());
  unregister_live(temp_);
  temp_.clear();
  fsync_path(parent_of(final_));
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

// ---- AtomicDirectory ----

namespace {

thread_local std::uintmax_t g_removed = 0;
thread_local int g_remove_errno = 0;

int remove_entry(const char* path, const struct stat*, int, struct FTW*) {
  if (std::remove(path) != 0) {  // a file, a link, or a directory emptied before (FTW_DEPTH)
    g_remove_errno = errno;
    return 1;
  }
  ++g_removed;
  return 0;
}

}  // namespace

std::uintmax_t remove_tree(const fs::path& path, std::error_code& ec) {
  ec.clear();
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return 0;
    ec.assign(errno, std::generic_category());
    return static_cast<std::uintmax_t>(-1);
  }
  g_removed = 0;
  g_remove_errno = 0;
  if (::nftw(path.c_str(), remove_entry, 32, FTW_DEPTH | FTW_PHYS) != 0) {
    ec.assign(g_remove_errno != 0 ? g_remove_errno : errno, std::generic_category());
    return static_cast<std::uintmax_t>(-1);
  }
  return g_removed;
}

std::uintmax_t remove_tree(const fs::path& path) {
  std::error_code ec;
  const std::uintmax_t n = remove_tree(path, ec);
  MEMTUNE_CHECK(!ec, "cannot remove ", path, ": ", ec.message());
  return n;
}

AtomicDirectory::AtomicDirectory(fs::path final_path, bool replace_existing)
    : final_(std::move(final_path)), replace_(replace_existing) {
  if (!final_.has_filename()) final_ = final_.parent_path();
  temp_ = temporary_name_for(final_);
  MEMTUNE_CHECK(replace_ || !fs::exists(final_), "checkpoint directory ", final_,
                " already exists", "; choose another name or allow replacing it");
  fs::create_directories(parent_of(final_));
  remove_stale_temporaries(parent_of(final_));
  clear_dead_temporary(temp_);
  std::error_code ec;
  fs::create_directory(temp_, ec);
  MEMTUNE_CHECK(!ec, "cannot create the temporary directory ", temp_, ": ", ec.message());
  register_live(temp_);
}

AtomicDirectory::~AtomicDirectory() {
  if (!committed_) {
    std::error_code ec;
    remove_tree(temp_, ec);
    unregister_live(temp_);
  }
}

void AtomicDirectory::commit() {
  MEMTUNE_INTERNAL_ASSERT(!committed_, "checkpoint directory ", final_, " is already committed");
  fsync_tree(temp_);
  const fs::path parent = parent_of(final_);
  if (!replace_) {
    int err = rename_with_flags(temp_, final_, RENAME_NOREPLACE);
    if (err == EINVAL || err == ENOSYS) {  // filesystem without renameat2 flags
      MEMTUNE_CHECK(!fs::exists(final_), "checkpoint directory ", final_, " already exists");
      err = rename_with_flags(temp_, final_, 0);
    }
    MEMTUNE_CHECK(err != EEXIST && err != ENOTEMPTY, "checkpoint directory ", final_,
                  " appeared while it was being written; it was not replaced",
                  "; write each checkpoint from one place");
    MEMTUNE_CHECK(err == 0, "renaming ", temp_, " to ", final_, " failed: ", std::strerror(err));
  } else if (!fs::exists(final_)) {
    const int err = rename_with_flags(temp_, final_, 0);
    MEMTUNE_CHECK(err == 0, "renaming ", temp_, " to ", final_, " failed: ", std::strerror(err));
  } else {
    // Swap atomically: the new directory takes the final name, the old one takes the
    // temporary name (a crash now leaves a stale temporary, never a missing checkpoint).
    int err = rename_with_flags(temp_, final_, RENAME_EXCHANGE);
    if (err == EINVAL || err == ENOSYS) {
      // Without RENAME_EXCHANGE there is a moment with no final directory; the old one
      // is kept as `<final>.old-<pid>` (not a temporary) until the new one is in place.
      const fs::path old = parent / (final_.filename().string() + ".old-" +
                                     std::to_string(::getpid()));
      std::error_code ec;
      remove_tree(old, ec);
      err = rename_with_flags(final_, old, 0);
      MEMTUNE_CHECK(err == 0, "moving the old ", final_, " aside failed: ", std::strerror(err));
      err = rename_with_flags(temp_, final_, 0);
      MEMTUNE_CHECK(err == 0, "renaming ", temp_, " to ", final_, " failed: ", std::strerror(err));
      fsync_path(parent);
      remove_tree(old, ec);
    } else {
      MEMTUNE_CHECK(err == 0, "replacing ", final_, " with ", temp_, " failed: ",
                    std::strerror(err));
      fsync_path(parent);
      std::error_code ec;
      remove_tree(temp_, ec);  // now the old directory
    }
  }
  committed_ = true;
  unregister_live(temp_);
  fsync_path(parent);
}

void create_output_directory(const fs::path& dir, std::string_view what) {
  std::error_code ec;
  const auto st = fs::status(dir, ec);
  MEMTUNE_CHECK(!fs::exists(st) || fs::is_directory(st), what, ": ", dir,
                " exists and is not a directory; name a directory to write into");
  fs::create_directories(dir, ec);
  MEMTUNE_CHECK(!ec, what, ": cannot create the directory ", dir, ": ", ec.message(),
                "; check that its parent exists and is writable");
}

// ---- stale temporaries ----

int remove_stale_temporaries(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  int removed = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const auto at = name.rfind(kTempMarker);
    if (at == std::string::npos || at == 0) continue;
    const std::string digits = name.substr(at + kTempMarker.size());
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    bool stale;
    if (pid == ::getpid())
      stale = !is_live(entry.path());
    else
      stale = ::kill(pid, 0) != 0 && errno == ESRCH;
    if (!stale) continue;
    remove_tree(entry.path(), ec);
    if (!ec) ++removed;
  }
  return removed;
}

}  // namespace memtune
