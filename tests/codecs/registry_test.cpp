// The registry: one name and one wire id per codec, given once at registration and checked
// there; and docs/codecs.md's table of codecs, checked against it.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

#include "terse/codec.h"

namespace terse {
namespace {

std::unique_ptr<Codec> make_nothing(SpecReader&) { return nullptr; }

std::string registration_error(CodecInfo info) {
  try {
    register_codec(std::move(info));
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(CodecRegistry, ATakenNameOrIdIsRefusedNamingBothCodecs) {
  const auto before = registered_codecs();
  std::string e = registration_error({"topk", 200, "a second topk", make_nothing});
  EXPECT_NE(e.find("'topk' (id 200)"), std::string::npos) << e;
  EXPECT_NE(e.find("'topk' (id 8)"), std::string::npos) << e;
  EXPECT_NE(e.find("name"), std::string::npos) << e;
  e = registration_error({"second-topk", 8, "another id 8", make_nothing});
  EXPECT_NE(e.find("'second-topk' (id 8)"), std::string::npos) << e;
  EXPECT_NE(e.find("'topk' (id 8)"), std::string::npos) << e;
  EXPECT_NE(e.find("wire id"), std::string::npos) << e;
  // Nothing refused was registered.
  EXPECT_EQ(registered_codecs().size(), before.size());
}

TEST(CodecRegistry, NamesASpecCannotHoldAndReservedIdsAreRefused) {
  for (const char* name : {"", "a:b", "a,b", "a=b", "a b"}) {
    EXPECT_NE(registration_error({name, 201, "bad name", make_nothing}), "") << name;
  }
  EXPECT_NE(registration_error({"no-make", 202, "no make()", nullptr}), "");
  EXPECT_NE(registration_error({"failure-id", 255, "the failure messages' id", make_nothing})
                .find("reserved"),
            std::string::npos);
}

TEST(CodecRegistry, EveryCodecCarriesTheNameAndIdOfItsRegistration) {
  for (const auto& info : registered_codecs()) {
    auto codec = make_codec(info.name);
    EXPECT_EQ(codec->name(), info.name);
    EXPECT_EQ(codec->id(), info.id) << info.name;
    if (!codec->traits().lossless && !codec->traits().multi_round &&
        !codec->traits().builtin_feedback) {
      EXPECT_EQ(make_codec(info.name + ":ef=1")->id(), info.id) << info.name;
    }
  }
}

// docs/codecs.md: one row per codec in its table ("| name | id | bits | summable | unbiased |
// stateful | page |") and one section "## name (id N)", both matching the registry; the
// summable and stateful cells, where they say yes or no, match the codec's traits.
TEST(CodecDocs, TheTableOfCodecsMatchesTheRegistry) {
  std::ifstream in(std::string(TERSE_SOURCE_DIR) + "/docs/codecs.md");
  ASSERT_TRUE(in) << "cannot read docs/codecs.md";
  std::map<std::string, std::vector<std::string>> rows;
  std::map<std::string, int> sections;
  const std::regex row(R"(^\| *([a-z0-9_-]+) *\| *([0-9]+) *\|(.*)$)");
  const std::regex section(R"(^## ([a-z0-9_-]+) \(id ([0-9]+)\)$)");
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_match(line, m, row)) {
      std::vector<std::string> cells{m[1], m[2]};
      std::stringstream rest(m[3].str());
      std::string cell;
      while (std::getline(rest, cell, '|')) {
        cells.push_back(std::regex_replace(cell, std::regex("^ +| +$"), ""));
      }
      EXPECT_TRUE(rows.emplace(m[1], cells).second) << "two rows for " << m[1];
    } else if (std::regex_match(line, m, section)) {
      EXPECT_TRUE(sections.emplace(m[1], std::stoi(m[2])).second) << "two sections for " << m[1];
    }
  }
  const auto codecs = registered_codecs();
  EXPECT_EQ(rows.size(), codecs.size());
  EXPECT_EQ(sections.size(), codecs.size());
  for (const auto& info : codecs) {
    ASSERT_TRUE(rows.count(info.name)) << info.name << " has no row in docs/codecs.md";
    const auto& cells = rows[info.name];
    EXPECT_EQ(cells[1], std::to_string(info.id)) << info.name;
    EXPECT_EQ(sections[info.name], info.id) << info.name << "'s section";
    const CodecTraits t = make_codec(info.name)->traits();
    ASSERT_GE(cells.size(), 6u) << info.name;
    auto check = [&](const std::string& cell, bool value, const char* what) {
      if (cell == "yes" || cell == "no") {
        EXPECT_EQ(cell == "yes", value) << info.name << ": " << what;
      }
    };
    check(cells[3], t.summable, "summable");
    check(cells[5], t.stateful, "stateful");
  }
}

}  // namespace
}  // namespace terse
