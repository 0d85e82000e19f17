#include "runtime/cuda_info.h"

#include <ATen/Context.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace memtune {
namespace {

TEST(CudaInfo, VersionStringDecodesCudaIntegers) {
  // CUDA's encoding: 1000 * major + 10 * minor (cuda_runtime_api.h).
  EXPECT_EQ(cuda_version_string(12040), "12.4");
  EXPECT_EQ(cuda_version_string(11080), "11.8");
  EXPECT_EQ(cuda_version_string(13000), "13.0");
}

TEST(CudaInfo, DescribesEachCase) {
  EXPECT_EQ(describe(CudaInfo{}), "no CUDA (built without MEMTUNE_CUDA)");
  EXPECT_EQ(describe(CudaInfo{true, 12040, 12040, 0, 0}),
            "CUDA 12.4 (runtime 12.4, no driver), 0 devices");
  EXPECT_EQ(describe(CudaInfo{true, 12040, 12060, 12080, 1}),
            "CUDA 12.4 (runtime 12.6, driver 12.8), 1 device");
  EXPECT_EQ(describe(CudaInfo{true, 12040, 0, 12080, 2}),
            "CUDA 12.4 (runtime unknown, driver 12.8), 2 devices");
}

TEST(CudaInfo, MatchesTheBuildAndLibTorch) {
  const CudaInfo info = cuda_info();
#ifdef MEMTUNE_CUDA
  EXPECT_TRUE(info.compiled);
  EXPECT_GE(info.toolkit_version, 11000);
  // The runtime loaded is never older than the toolkit's major version.
  EXPECT_GE(info.runtime_version / 1000, info.toolkit_version / 1000);
#else
  EXPECT_FALSE(info.compiled);
  EXPECT_EQ(info.runtime_version, 0);
#endif
  // ATen's own view: devices exactly when at::hasCUDA().
  EXPECT_EQ(info.device_count > 0, at::hasCUDA());
}

TEST(CudaInfo, SeesTheDevices_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const CudaInfo info = cuda_info();
  EXPECT_TRUE(info.compiled);
  EXPECT_GE(info.device_count, 1);
  EXPECT_GE(info.driver_version, info.runtime_version) << "a driver older than the runtime cannot run it";
  EXPECT_NE(describe(info).find(std::to_string(info.device_count) + " device"), std::string::npos);
}

}  // namespace
}  // namespace memtune

TEST(CudaInfo, Bf16IsNativeFromAmpereOn) {
  // auto picks bf16 only where tensor cores compute it: sm_80 (A100) and later; a T4
  // (sm_75) or V100 (sm_70) gets fp16.
  EXPECT_FALSE(memtune::has_native_bf16(0));
  EXPECT_FALSE(memtune::has_native_bf16(70));
  EXPECT_FALSE(memtune::has_native_bf16(75));
  EXPECT_TRUE(memtune::has_native_bf16(80));
  EXPECT_TRUE(memtune::has_native_bf16(86));
  EXPECT_TRUE(memtune::has_native_bf16(90));
  // Without a device there is no capability to report.
  EXPECT_EQ(memtune::cuda_compute_capability(-1), 0);
  EXPECT_EQ(memtune::cuda_compute_capability(memtune::cuda_info().device_count), 0);
}
