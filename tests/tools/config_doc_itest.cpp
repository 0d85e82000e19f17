// docs/config.md is generated from the schema (scripts/make_config_doc.sh): it must say what
// `memtune train --help-config` says today, or the reference has drifted from the code.
#include <gtest/gtest.h>

#include "test_util.h"

namespace memtune::testing {
namespace {

TEST(ConfigDoc, DocsConfigMdIsTheSchemasOwnHelp) {
  auto r = run(memtune_bin() + " train --help-config 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string doc = read_file(source_dir() / "docs/config.md");
  const size_t begin = doc.find("```\n"), end = doc.rfind("```");
  ASSERT_NE(begin, std::string::npos);
  ASSERT_GT(end, begin);
  EXPECT_EQ(doc.substr(begin + 4, end - begin - 4), r.output)
      << "docs/config.md is out of date: run `bash scripts/make_config_doc.sh` and commit it";
}

}  // namespace
}  // namespace memtune::testing
