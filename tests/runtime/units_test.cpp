#include <gtest/gtest.h>

#include "runtime/error.h"
#include "runtime/units.h"

using memtune::parse_size;

TEST(Units, ParsesBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_size("6GiB").bytes, 6LL * 1024 * 1024 * 1024);
  EXPECT_EQ(parse_size("512MiB").bytes, 512LL * 1024 * 1024);
  EXPECT_EQ(parse_size("2GB").bytes, 2000000000LL);
  EXPECT_EQ(parse_size("1.5 KiB").bytes, 1536);
  EXPECT_EQ(parse_size("1048576").bytes, 1048576);
}

TEST(Units, FractionIsShareOfReference) {
  auto s = parse_size("0.9");
  EXPECT_LT(s.bytes, 1);
  EXPECT_DOUBLE_EQ(s.fraction, 0.9);
  EXPECT_EQ(s.resolve(1000), 900);
}

TEST(Units, FormatRoundTrips) {
  for (const char* text : {"6GiB", "512MiB", "1000", "0.75", "3KiB"}) {
    auto s = parse_size(text);
    auto back = parse_size(memtune::format_size(s));
    EXPECT_EQ(back.bytes, s.bytes) << text;
    EXPECT_DOUBLE_EQ(back.fraction, s.fraction) << text;
  }
}

TEST(Units, RejectsBadInputNamingWhere) {
  for (const char* text : {"", "GiB", "-1GiB", "6 parsecs", "0", "abc"}) {
    try {
      parse_size(text, "memory.device_limit");
      FAIL() << "accepted '" << text << "'";
    } catch (const memtune::UserError& e) {
      EXPECT_NE(std::string(e.what()).find("memory.device_limit"), std::string::npos) << e.what();
    }
  }
}
