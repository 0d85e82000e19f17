// DistEnv: torchrun's and Slurm's variables, Slurm's host lists, inconsistent values.
#include <gtest/gtest.h>

#include <map>

#include "runtime/dist_env.h"
#include "runtime/error.h"

using memtune::DistEnv;
using memtune::expand_slurm_nodelist;

namespace {
DistEnv from(const std::map<std::string, std::string>& vars) {
  return DistEnv::from_environment([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    from(vars);
  } catch (const memtune::UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(SlurmNodelist, ExpandsRangesListsAndPadding) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_slurm_nodelist("gpu5"), V{"gpu5"});
  EXPECT_EQ(expand_slurm_nodelist("node[01-04,07],gpu5"),
            (V{"node01", "node02", "node03", "node04", "node07", "gpu5"}));
  EXPECT_EQ(expand_slurm_nodelist("a[8-11]"), (V{"a8", "a9", "a10", "a11"}));
  EXPECT_EQ(expand_slurm_nodelist("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_slurm_nodelist("rack[1-2]-n[1,3]"), (V{"rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"}));
  EXPECT_EQ(expand_slurm_nodelist("x-[3]z,y"), (V{"x-3z", "y"}));
}

TEST(SlurmNodelist, RejectsMalformedLists) {
  for (const char* bad : {"", "node[01-04", "node[a-b]", "node[4-1]", "node]1[", ",a", "n[[1]]"}) {
    EXPECT_THROW(expand_slurm_nodelist(bad), memtune::UserError) << bad;
  }
}

TEST(DistEnv, SingleProcessWithoutVariables) {
  DistEnv d = from({});
  EXPECT_FALSE(d.enabled());
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
}

TEST(DistEnv, ReadsTorchrunVariables) {
  DistEnv d = from({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                    {"GROUP_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29501"},
                    {"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "0"}});
  EXPECT_TRUE(d.enabled());
  EXPECT_EQ(d.source, "torchrun");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.master_addr, "10.0.0.1");
  EXPECT_EQ(d.master_port, 29501);
}

TEST(DistEnv, ReadsSlurmVariablesAndTheFirstHost) {
  DistEnv d = from({{"SLURM_NTASKS", "8"}, {"SLURM_PROCID", "6"}, {"SLURM_LOCALID", "2"}, {"SLURM_NODEID", "1"},
                    {"SLURM_NNODES", "2"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(d.source, "slurm");
  EXPECT_EQ(d.rank, 6);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 2);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.node_rank, 1);
  EXPECT_EQ(d.master_addr, "gpu07");
  EXPECT_EQ(d.master_port, 29500 + 456);
  DistEnv e = from({{"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS_PER_NODE", "2"},
                    {"SLURM_JOB_NODELIST", "n1"}, {"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}});
  EXPECT_EQ(e.master_addr, "head");
  EXPECT_EQ(e.master_port, 4000);
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(DistEnv, InconsistentValuesAreErrorsNamingTheVariable) {
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_PORT", "1"}}).find("not below the world size 2"),
            std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "two"}}).find("WORLD_SIZE='two'"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("RANK is not"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}}).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"MASTER_PORT", "1"}})
                .find("local rank 3"),
            std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_PORT", "1"}})
                .find("LOCAL_WORLD_SIZE=4 exceeds"),
            std::string::npos);
  EXPECT_NE(error_of({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_PORT", "70000"}}).find("not a TCP port"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_NTASKS", "2"}}).find("SLURM_PROCID is not"), std::string::npos);
  EXPECT_NE(error_of({{"SLURM_NTASKS", "2"}, {"SLURM_PROCID", "0"}}).find("SLURM_JOB_NODELIST"), std::string::npos);
}
