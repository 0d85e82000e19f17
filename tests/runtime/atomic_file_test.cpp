// Crash-safe files and checkpoint directories: contents, refusal to clobber, stale
// temporaries, and processes killed with SIGKILL while writing.
#include "runtime/atomic_file.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <thread>

#include "runtime/error.h"
#include "test_util.h"

namespace fs = std::filesystem;
namespace mt = memtune::testing;
using memtune::AtomicDirectory;
using memtune::AtomicFile;
using memtune::remove_stale_temporaries;
using memtune::write_file_atomic;

namespace {

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A pid that no longer runs: a child that exited and was reaped.
pid_t dead_pid() {
  pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}

void kill_and_reap(pid_t pid) {
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

// A complete checkpoint: two files agreeing on the generation.
void write_checkpoint(const fs::path& dir, int generation, bool replace = false) {
  AtomicDirectory d(dir, replace);
  mt::write_file(d.path() / "state.json", "{\"step\": " + std::to_string(generation) + "}");
  mt::write_file(d.path() / "weights.bin", std::string(4096 + generation, 'w'));
  d.commit();
}

// Which generation `dir` holds; fails the test if its files disagree or are partial.
int checkpoint_generation(const fs::path& dir) {
  const std::string state = mt::read_file(dir / "state.json");
  const int generation = std::stoi(state.substr(state.find(':') + 1));
  EXPECT_EQ(mt::read_file(dir / "weights.bin"), std::string(4096 + generation, 'w')) << dir;
  return generation;
}

}  // namespace

TEST(AtomicFile, WriteReplacesWholeFile) {
  const fs::path dir = mt::temp_dir();
  write_file_atomic(dir / "a.json", "first version, long");
  write_file_atomic(dir / "a.json", "second");
  EXPECT_EQ(mt::read_file(dir / "a.json"), "second");
  EXPECT_EQ(entries(dir), std::vector<std::string>{"a.json"});
}

TEST(AtomicFile, UncommittedLeavesNothing) {
  const fs::path dir = mt::temp_dir();
  write_file_atomic(dir / "a.bin", "old");
  {
    AtomicFile f(dir / "a.bin");
    f.write("new bytes");
    EXPECT_TRUE(fs::exists(f.temporary_path()));
    EXPECT_EQ(mt::read_file(dir / "a.bin"), "old");
  }
  EXPECT_EQ(mt::read_file(dir / "a.bin"), "old");
  EXPECT_EQ(entries(dir), std::vector<std::string>{"a.bin"});
}

TEST(AtomicDirectory, AppearsOnlyOnCommit) {
  const fs::path dir = mt::temp_dir();
  AtomicDirectory d(dir / "step-1");
  EXPECT_EQ(d.path().filename().string(), "step-1.tmp-" + std::to_string(getpid()));
  mt::write_file(d.path() / "sub" / "x.txt", "x");
  EXPECT_FALSE(fs::exists(dir / "step-1"));
  d.commit();
  EXPECT_EQ(mt::read_file(dir / "step-1" / "sub" / "x.txt"), "x");
  EXPECT_EQ(entries(dir), std::vector<std::string>{"step-1"});
}

TEST(AtomicDirectory, UncommittedIsRemoved) {
  const fs::path dir = mt::temp_dir();
  {
    AtomicDirectory d(dir / "step-1");
    mt::write_file(d.path() / "x.txt", "x");
  }
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(AtomicDirectory, RefusesToReplaceUnlessTold) {
  const fs::path dir = mt::temp_dir();
  write_checkpoint(dir / "ckpt", 1);
  EXPECT_THROW(AtomicDirectory(dir / "ckpt"), memtune::UserError);
  // The final name appearing while the new one is written is refused at commit too.
  {
    AtomicDirectory d(dir / "late");
    mt::write_file(d.path() / "state.json", "new");
    mt::write_file(dir / "late" / "state.json", "{\"step\": 7}");  // another writer's
    mt::write_file(dir / "late" / "weights.bin", std::string(4096 + 7, 'w'));
    EXPECT_THROW(d.commit(), memtune::UserError);
  }
  EXPECT_EQ(checkpoint_generation(dir / "late"), 7);
  EXPECT_EQ(checkpoint_generation(dir / "ckpt"), 1);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"ckpt", "late"}));
}

TEST(AtomicDirectory, ReplacesWhenTold) {
  const fs::path dir = mt::temp_dir();
  write_checkpoint(dir / "latest", 1);
  mt::write_file(dir / "latest" / "only-in-old.txt", "old");
  write_checkpoint(dir / "latest", 2, /*replace=*/true);
  EXPECT_EQ(checkpoint_generation(dir / "latest"), 2);
  EXPECT_FALSE(fs::exists(dir / "latest" / "only-in-old.txt"));
  EXPECT_EQ(entries(dir), std::vector<std::string>{"latest"});
}

TEST(AtomicDirectory, RemoveStaleTemporaries) {
  const fs::path dir = mt::temp_dir();
  const std::string dead = std::to_string(dead_pid()), self = std::to_string(getpid());
  mt::write_file(dir / ("a.tmp-" + dead) / "x", "x");
  mt::write_file(dir / ("b.tmp-" + dead), "x");
  mt::write_file(dir / ("c.tmp-" + self) / "x", "x");  // ours, but no live owner
  mt::write_file(dir / "e.tmp-1", "x");                // pid 1 runs
  mt::write_file(dir / "f.tmp-abc", "x");
  mt::write_file(dir / "g" / "x", "x");
  EXPECT_EQ(remove_stale_temporaries(dir), 3);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"e.tmp-1", "f.tmp-abc", "g"}));
  EXPECT_EQ(remove_stale_temporaries(dir / "missing"), 0);
  // A live writer's temporary is never stale; and every new write in a directory removes
  // the stale ones first (a killed writer's leftovers go with the next write there).
  AtomicDirectory live(dir / "d");
  mt::write_file(dir / ("h.tmp-" + dead), "x");
  EXPECT_EQ(remove_stale_temporaries(dir), 1);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"d.tmp-" + self, "e.tmp-1", "f.tmp-abc", "g"}));
  mt::write_file(dir / ("i.tmp-" + dead), "x");
  write_file_atomic(dir / "j", "x");
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"d.tmp-" + self, "e.tmp-1", "f.tmp-abc", "g", "j"}));
}

// A process killed after the first file of a new checkpoint, in the middle of a large
// second file, leaves the previous checkpoint intact and no partial final directory.
TEST(AtomicDirectory, KillMidWriteKeepsPreviousCheckpoint) {
  const fs::path dir = mt::temp_dir();
  write_checkpoint(dir / "step-1", 1);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(ready[0]);
    AtomicDirectory d(dir / "step-2");
    mt::write_file(d.path() / "state.json", "{\"step\": 2}");
    std::ofstream big(d.path() / "weights.bin", std::ios::binary);
    const std::string chunk(1 << 20, 'w');
    big.write(chunk.data(), chunk.size());
    big.flush();
    if (write(ready[1], "1", 1) != 1) _exit(3);
    for (int i = 0; i < 64; ++i) big.write(chunk.data(), chunk.size());
    pause();
    _exit(4);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  kill_and_reap(child);

  EXPECT_EQ(checkpoint_generation(dir / "step-1"), 1);
  EXPECT_FALSE(fs::exists(dir / "step-2"));
  const std::string temp = "step-2.tmp-" + std::to_string(child);
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"step-1", temp}));
  EXPECT_GT(fs::file_size(dir / temp / "weights.bin"), 0u);
  EXPECT_EQ(remove_stale_temporaries(dir), 1);
  EXPECT_EQ(entries(dir), std::vector<std::string>{"step-1"});
}

// The same for a single file replaced with write_file_atomic / AtomicFile.
TEST(AtomicFile, KillMidWriteKeepsPreviousFile) {
  const fs::path dir = mt::temp_dir();
  write_file_atomic(dir / "trainer_state.json", "{\"step\": 1}");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(ready[0]);
    AtomicFile f(dir / "trainer_state.json");
    const std::string chunk(1 << 20, 's');
    f.write(chunk);
    if (write(ready[1], "1", 1) != 1) _exit(3);
    for (int i = 0; i < 64; ++i) f.write(chunk);
    pause();
    _exit(4);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  kill_and_reap(child);
  EXPECT_EQ(mt::read_file(dir / "trainer_state.json"), "{\"step\": 1}");
  EXPECT_EQ(remove_stale_temporaries(dir), 1);
  EXPECT_EQ(entries(dir), std::vector<std::string>{"trainer_state.json"});
}

// A process replacing `latest` over and over is killed at arbitrary moments, commit and
// swap included: `latest` is always one complete generation.
TEST(AtomicDirectory, KillAtRandomMomentsDuringReplaceLoop) {
  const fs::path dir = mt::temp_dir();
  write_checkpoint(dir / "latest", 0);
  int last_seen = 0;
  for (int round = 0; round < 6; ++round) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (int generation = 1000 * (round + 1);; ++generation)
        write_checkpoint(dir / "latest", generation, /*replace=*/true);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(15 + 23 * round));
    kill_and_reap(child);
    ASSERT_TRUE(fs::exists(dir / "latest")) << "round " << round;
    const int generation = checkpoint_generation(dir / "latest");
    EXPECT_GE(generation, last_seen);
    last_seen = generation;
    remove_stale_temporaries(dir);
    EXPECT_EQ(entries(dir), std::vector<std::string>{"latest"}) << "round " << round;
  }
  EXPECT_GT(last_seen, 0);  // the child did commit some generations
}

TEST(RemoveTree, RemovesNestedEntriesButNotWhatALinkPointsTo) {
  const fs::path dir = mt::temp_dir();
  const fs::path outside = dir / "outside";
  fs::create_directories(outside);
  mt::write_file(outside / "kept.txt", "kept");
  const fs::path tree = dir / "tree";
  fs::create_directories(tree / "a" / "b");
  mt::write_file(tree / "top.txt", "1");
  mt::write_file(tree / "a" / "b" / "deep.txt", "2");
  fs::create_directory_symlink(outside, tree / "a" / "link");
  std::error_code ec;
  // tree, top.txt, a, a/b, a/b/deep.txt, a/link: six entries, as std::filesystem counts them.
  EXPECT_EQ(memtune::remove_tree(tree, ec), 6u);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(fs::exists(tree));
  EXPECT_EQ(mt::read_file(outside / "kept.txt"), "kept");  // the link, not its target
  // A missing path removes nothing and is no error; a file alone is one entry.
  EXPECT_EQ(memtune::remove_tree(tree, ec), 0u);
  EXPECT_FALSE(ec);
  EXPECT_EQ(memtune::remove_tree(outside / "kept.txt"), 1u);
  EXPECT_FALSE(fs::exists(outside / "kept.txt"));
}

TEST(RemoveTree, APathThatCannotBeReachedIsAnErrorNamingIt) {
  const fs::path dir = mt::temp_dir();
  mt::write_file(dir / "file.txt", "x");
  const fs::path bad = dir / "file.txt" / "below";  // a file is no directory
  std::error_code ec;
  EXPECT_EQ(memtune::remove_tree(bad, ec), static_cast<std::uintmax_t>(-1));
  EXPECT_EQ(ec, std::errc::not_a_directory) << ec.message();
  try {
    memtune::remove_tree(bad);
    ADD_FAILURE() << "expected an error";
  } catch (const memtune::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot remove \"" + bad.string() + "\""), std::string::npos) << e.what();
  }
  EXPECT_EQ(mt::read_file(dir / "file.txt"), "x");
}
