// adapter_config.json as read by models/peft.h.
#include <gtest/gtest.h>

#include "models/peft.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

std::string adapter_config_error(const std::string& text) {
  const fs::path dir = temp_dir();
  write_file(dir / "adapter_config.json", text);
  try {
    models::read_adapter_config(dir);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Found by fuzz/adapter_config_fuzz.cpp (fuzz/regressions/adapter_config-*): JSON that is not
// an object, or a key of the wrong type before `r`, escaped as nlohmann's type_error (exit 1).
TEST(AdapterConfig, WrongTypesAreRefusedWithTheFile) {
  for (const std::string text : {"0", "[]", "\"LORA\"", R"({"peft_type": 5, "r": 8, "target_modules": "q_proj"})",
                                 R"({"bias": [], "r": 8, "target_modules": "q_proj"})",
                                 R"({"use_dora": "no", "r": 8, "target_modules": "q_proj"})",
                                 R"({"r": "8", "target_modules": "q_proj"})",
                                 R"({"r": 8, "target_modules": "q_proj", "rank_pattern": 3})"}) {
    const std::string e = adapter_config_error(text);
    EXPECT_NE(e.find("adapter_config.json: "), std::string::npos) << text << " -> '" << e << "'";
  }
  EXPECT_EQ(adapter_config_error(R"({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]})"), "");
}

}  // namespace
}  // namespace memtune::testing
