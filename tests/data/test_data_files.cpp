// dataset_name's directories (runtime/src/config/data_files.h) against Hugging Face datasets'
// load_dataset_builder on the same directories, run at test time (dataset_dirs.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "config/data_files.h"
#include "memrt/error.h"
#include "test_util.h"

namespace {

using memrt::find_local_dataset;
using memrt::glob_match;
using memrt::LocalDataset;

TEST(DataFiles, GlobMatchesAsFsspec) {
  EXPECT_TRUE(glob_match("**/train[-._ 0-9]*", "train.jsonl"));
  EXPECT_TRUE(glob_match("**/train[-._ 0-9]*", "a/b/train-1.jsonl"));
  EXPECT_FALSE(glob_match("**/train[-._ 0-9]*", "trainer.jsonl"));
  EXPECT_FALSE(glob_match("**/train[-._ 0-9]*", "train/x.jsonl"));  // * stays in one component
  EXPECT_TRUE(glob_match("**/train/**", "data/train/x/y.jsonl"));
  EXPECT_TRUE(glob_match("**", "a/b/c"));
  EXPECT_TRUE(glob_match("data/*-[0-9][0-9]-of-*.*", "data/test-00-of-01.jsonl"));
  EXPECT_FALSE(glob_match("data/*-[0-9][0-9]-of-*.*", "data/x/test-00-of-01.jsonl"));
  EXPECT_TRUE(glob_match("[!a]?.txt", "bc.txt"));
  EXPECT_FALSE(glob_match("[!a]?.txt", "ac.txt"));
  EXPECT_TRUE(glob_match("a[.txt", "a[.txt"));  // an unclosed class is a literal
}

// Every layout: the builder and each split's files in datasets' order, or an error where
// datasets raises one.
TEST(DataFiles, SplitsAreTheOnesDatasetsLoads) {
  memrt::test::TempDir dir;
  ASSERT_TRUE(memrt::test::run_reference("dataset_dirs.py", dir.str() + " 2> /dev/null"));
  const rapidjson::Document want = memrt::test::read_json(dir.file("want.json"));
  ASSERT_GE(want["cases"].Size(), 19u);
  for (const auto& c : want["cases"].GetArray()) {
    const std::string name = c["name"].GetString(), root = c["dir"].GetString();
    const std::string config = c["config"].IsNull() ? "" : c["config"].GetString();
    SCOPED_TRACE(name);
    if (c.HasMember("error")) {
      EXPECT_THROW(find_local_dataset(root, config), memrt::Error) << "datasets: " << c["error"].GetString();
      continue;
    }
    LocalDataset got;
    try {
      got = find_local_dataset(root, config);
    } catch (const memrt::Error& e) {
      ADD_FAILURE() << e.what();
      continue;
    }
    EXPECT_EQ(got.module, c["module"].GetString());
    ASSERT_EQ(got.splits.size(), c["splits"].Size()) << got.split_names();
    for (rapidjson::SizeType k = 0; k < c["splits"].Size(); ++k) {
      const auto& split = c["splits"][k];
      EXPECT_EQ(got.splits[k].first, split[0].GetString());
      std::vector<std::string> files, expected;
      for (const std::string& f : got.splits[k].second)
        files.push_back(std::filesystem::path(f).lexically_relative(root).generic_string());
      for (const auto& f : split[1].GetArray()) expected.emplace_back(f.GetString());
      EXPECT_EQ(files, expected) << "split " << split[0].GetString();
    }
  }
}

}  // namespace
