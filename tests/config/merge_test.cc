// Several config sources (Note [Several config files] in config/merge.h): the deep merge, --set
// overrides, the provenance of every key, and errors and warnings that name the right source.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "config/merge.h"

namespace porter::config {
namespace {

using nlohmann::json;

const std::filesystem::path kRealWorld = PORTER_REALWORLD_CONFIG_DIR;

ConfigSource source(const std::string& name, const std::string& text) {
  return config_source_from_string(name, text);
}

std::vector<ConfigOverride> sets(const std::vector<std::string>& assignments) {
  std::vector<ConfigOverride> out;
  for (const std::string& a : assignments) out.push_back(parse_config_override(a));
  return out;
}

// The what() of the ConfigError that `f` throws; "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> texts(const SourcedParseResult& r) {
  std::vector<std::string> out;
  for (const SourcedWarning& w : r.warnings) out.push_back(w.text());
  return out;
}

TEST(Merge, NestedObjectsMergeKeyByKey) {
  MergedConfig m = merge_config_sources(
      {source("a.json", R"({"zero_optimization": {"stage": 2, "overlap_comm": true},
                            "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "eps": 1e-8}}})"),
       source("b.json", R"({"zero_optimization": {"stage": 3},
                            "optimizer": {"params": {"lr": 0.2}}, "porter": {"model": {"layers": 2}}})")});
  EXPECT_EQ(m.json, json::parse(R"({"zero_optimization": {"stage": 3, "overlap_comm": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.2, "eps": 1e-8}},
      "porter": {"model": {"layers": 2}}})"));
  const std::map<std::string, std::string, std::less<>> expected = {
      {"zero_optimization.stage", "b.json"}, {"zero_optimization.overlap_comm", "a.json"},
      {"optimizer.type", "a.json"},          {"optimizer.params.lr", "b.json"},
      {"optimizer.params.eps", "a.json"},    {"porter.model.layers", "b.json"}};
  EXPECT_EQ(m.provenance.leaves(), expected);
}

TEST(Merge, ArraysScalarsAndNullReplace) {
  MergedConfig m = merge_config_sources(
      {source("a.json", R"({"optimizer": {"params": {"betas": [0.9, 0.999]}},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
                            "fp16": {"enabled": true}})"),
       source("b.json", R"({"optimizer": {"params": {"betas": [0.8]}}, "scheduler": null,
                            "fp16": {}})")});
  EXPECT_EQ(m.json, json::parse(R"({"optimizer": {"params": {"betas": [0.8]}}, "scheduler": null,
                                   "fp16": {"enabled": true}})"));
  EXPECT_EQ(m.provenance.sources_of("optimizer.params.betas"), std::vector<std::string>{"b.json"});
  // The replaced subtree is gone from the provenance; the null is b's leaf.
  EXPECT_EQ(m.provenance.leaves().count("scheduler.type"), 0u);
  EXPECT_EQ(m.provenance.sources_of("scheduler"), std::vector<std::string>{"b.json"});
  // {} over an object changes nothing.
  EXPECT_EQ(m.provenance.sources_of("fp16.enabled"), std::vector<std::string>{"a.json"});
}

TEST(Merge, ObjectReplacesScalarAndScalarReplacesObject) {
  MergedConfig m = merge_config_sources(
      {source("a.json", R"({"x": 1, "y": {"z": 2}})"), source("b.json", R"({"x": {"w": 3}, "y": 4})")});
  EXPECT_EQ(m.json, json::parse(R"({"x": {"w": 3}, "y": 4})"));
  const std::map<std::string, std::string, std::less<>> expected = {{"x.w", "b.json"},
                                                                    {"y", "b.json"}};
  EXPECT_EQ(m.provenance.leaves(), expected);
}

TEST(Merge, TheLastFileThatSetsAKeyWins) {
  MergedConfig m = merge_config_sources({source("a.json", R"({"train_batch_size": 8})"),
                                         source("b.json", R"({"train_batch_size": 16})"),
                                         source("c.json", R"({"steps_per_print": 1})")});
  EXPECT_EQ(m.json["train_batch_size"], 16);
  EXPECT_EQ(m.provenance.label("train_batch_size"), "b.json");
  EXPECT_EQ(m.provenance.label("steps_per_print"), "c.json");
  EXPECT_EQ(m.provenance.label(""), "a.json + b.json + c.json");
}

TEST(Set, CreatesTheObjectsOnItsPath) {
  MergedConfig m = merge_config_sources(
      {source("ds.json", R"({"train_batch_size": 8, "scheduler": null})")},
      sets({"porter.model.layers=8", "zero_optimization.stage=3", "optimizer.params.lr=1e-4",
            "scheduler.type=WarmupLR"}));
  EXPECT_EQ(m.json, json::parse(R"({"train_batch_size": 8, "porter": {"model": {"layers": 8}},
      "zero_optimization": {"stage": 3}, "optimizer": {"params": {"lr": 0.0001}},
      "scheduler": {"type": "WarmupLR"}})"));
  EXPECT_EQ(m.provenance.label("porter.model.layers"), "--set porter.model.layers");
  EXPECT_EQ(m.provenance.label("porter.model"), "--set porter.model.layers");
  EXPECT_EQ(m.provenance.label("scheduler.type"), "--set scheduler.type");
  EXPECT_EQ(m.provenance.label("train_batch_size"), "ds.json");
}

TEST(Set, ReplacesAFilesValueAndIsAppliedInOrder) {
  MergedConfig m = merge_config_sources(
      {source("model.json", R"({"porter": {"model": {"layers": 4, "hidden": 64}}})")},
      sets({"porter.model.layers=8", "porter.model.layers=2", "porter.model={\"heads\": 2}"}));
  EXPECT_EQ(m.json, json::parse(R"({"porter": {"model": {"heads": 2}}})"));
  EXPECT_EQ(m.provenance.label("porter.model.heads"), "--set porter.model");
  EXPECT_EQ(m.provenance.label("porter.model.hidden"), "--set porter.model");
}

TEST(Set, ValueIsJsonElseAString) {
  auto value = [](const std::string& a) { return parse_config_override(a).value; };
  EXPECT_EQ(value("a=8"), json(8));
  EXPECT_EQ(value("a=1e-4"), json(1e-4));
  EXPECT_EQ(value("a=true"), json(true));
  EXPECT_EQ(value("a=null"), json(nullptr));
  EXPECT_EQ(value("a=[1, 2]"), json::parse("[1, 2]"));
  EXPECT_EQ(value("a={\"b\": 1}"), json::parse(R"({"b": 1})"));
  EXPECT_EQ(value("a=\"8\""), json("8"));
  EXPECT_EQ(value("porter.checkpointing.policy=uniform"), json("uniform"));
  EXPECT_EQ(value("a=2GiB"), json("2GiB"));
  EXPECT_EQ(value("a= cpu "), json("cpu"));
  EXPECT_EQ(value("a="), json(""));
  EXPECT_EQ(value("a=x=y"), json("x=y"));  // the first '=' splits
  ConfigOverride o = parse_config_override(" porter.model.layers =8");
  EXPECT_EQ(o.name, "--set porter.model.layers");
  EXPECT_EQ(o.path, (std::vector<std::string>{"porter", "model", "layers"}));
}

TEST(Set, ThroughAValueThatIsNotAnObjectIsAnError) {
  const std::string e = error_of([] {
    merge_config_sources({source("model.json", R"({"porter": {"model": {"layers": 8}}})")},
                         sets({"porter.model.layers.deep=1"}));
  });
  EXPECT_EQ(e, "--set porter.model.layers.deep: porter.model.layers: 8 (from model.json) is not a "
               "JSON object, so it has no key \"deep\" to set; set porter.model.layers itself "
               "instead");
  EXPECT_THAT(error_of([] {
                merge_config_sources({source("a.json", R"({"optimizer": [1]})")},
                                     sets({"optimizer.type=Adam"}));
              }),
              ::testing::StartsWith("--set optimizer.type: optimizer: [1] (from a.json) is not a "));
}

TEST(Set, MalformedAssignmentsAreClearErrors) {
  auto e = [](const std::string& a) { return error_of([&] { parse_config_override(a); }); };
  EXPECT_EQ(e("porter.model.layers"),
            "--set \"porter.model.layers\": expected key.path=VALUE (no \"=\" found), e.g. --set "
            "porter.model.layers=8");
  EXPECT_EQ(e("=8"), "--set \"=8\": the key path before \"=\" is empty; expected key.path=VALUE, "
                     "e.g. --set porter.model.layers=8");
  EXPECT_EQ(e(" =8"), "--set \" =8\": the key path before \"=\" is empty; expected "
                      "key.path=VALUE, e.g. --set porter.model.layers=8");
  EXPECT_THAT(e("porter..layers=8"), ::testing::HasSubstr("empty key in the path \"porter..layers\""));
  EXPECT_THAT(e(".a=8"), ::testing::HasSubstr("empty key"));
  EXPECT_THAT(e("a.=8"), ::testing::HasSubstr("empty key"));
  EXPECT_THAT(e("optimizer.params.betas[0]=0.9"),
              ::testing::HasSubstr("a list element cannot be set on its own; set the whole list"));
  EXPECT_THAT(e("porter.data.paths=[a.txt]"),
              ::testing::StartsWith("--set \"porter.data.paths=[a.txt]\": the value is not valid "
                                    "JSON (malformed JSON at line 1, column 2"));
  EXPECT_THAT(e("a={\"b\": 1, \"b\": 2}"), ::testing::HasSubstr("duplicate key \"b\""));
}

TEST(Set, GivesTheOptimizerPatternListsAndRefusesATypoInTheirSection) {
  SourcedParseResult r = parse_config_sources(
      {source("ds.json", R"({"train_batch_size": 8})")},
      sets({"porter.optimizer.no_decay=[]",
            "porter.optimizer.param_groups=[{\"params\": [\"*.bias\"], \"lr_scale\": 2}]"}));
  EXPECT_TRUE(r.config.porter.optimizer.no_decay.empty());
  ASSERT_EQ(r.config.porter.optimizer.param_groups.size(), 1u);
  EXPECT_EQ(r.config.porter.optimizer.param_groups[0].lr_scale, 2.0);
  const std::string e = error_of([] {
    parse_config_sources({source("ds.json", R"({"train_batch_size": 8})")},
                         sets({"porter.optimizer.nodecay=[]"}));
  });
  EXPECT_THAT(e, ::testing::HasSubstr("porter.optimizer.nodecay"));
  EXPECT_THAT(e, ::testing::HasSubstr("no_decay"));
}

TEST(Attribution, AWarningNamesTheFileOfItsKey) {
  SourcedParseResult r = parse_config_sources(
      {source("ds.json", R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}})"),
       source("model.json", R"({"porter": {"model": {"layer": 2}}})")},
      {});
  EXPECT_EQ(texts(r), std::vector<std::string>{"model.json: porter.model.layer: unknown key, "
                                               "ignored (did you mean \"layers\"?)"});
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0].source, "model.json");
  EXPECT_EQ(r.warnings[0].warning.path, "porter.model.layer");
}

TEST(Attribution, AnErrorNamesTheFileOfItsKey) {
  const std::string e = error_of([] {
    parse_config_sources({source("ds.json", R"({"zero_optimization": {"stage": "two"}})"),
                          source("model.json", R"({"train_batch_size": 8})")},
                         {});
  });
  EXPECT_EQ(e, "ds.json: zero_optimization.stage: expected an integer in 0..3, got \"two\"");
  try {
    parse_config_sources({source("ds.json", R"({"train_batch_size": 8,
                                                "zero_optimization": {"stage": "two"}})")},
                         {});
    FAIL() << "no error";
  } catch (const SourcedConfigError& err) {
    EXPECT_EQ(err.source(), "ds.json");
    EXPECT_EQ(err.path(), "zero_optimization.stage");
    EXPECT_EQ(err.message(), "zero_optimization.stage: expected an integer in 0..3, got \"two\"");
  }
}

TEST(Attribution, SetIsNamedAsTheFlagAndItsPath) {
  const std::vector<ConfigSource> files = {source("ds.json", R"({"train_batch_size": 8})"),
                                           source("model.json", R"({"porter": {"model": {"layers": 2}}})")};
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"zero_optimization.stage=two"})); }),
            "--set zero_optimization.stage: zero_optimization.stage: expected an integer in 0..3, "
            "got \"two\"");
  // A key given by a file and then by --set is the flag's.
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"porter.model.layers=0"})); }),
            "--set porter.model.layers: porter.model.layers: expected an integer in 1..100000, "
            "got 0");
}

// Note [Set keys]: an unknown key given with --set is an error naming the flag, the key, the
// rule and the closest known key; the same key in a file is a warning.
TEST(SetKeys, AnUnknownKeyIsAnErrorWithADidYouMean) {
  const std::vector<ConfigSource> files = {source("ds.json", R"({"train_batch_size": 8})"),
                                           source("model.json", R"({"porter": {"model": {"layers": 2}}})")};
  constexpr const char* kRule =
      "; a key given with --set must be one porter reads (a key in a config file is only warned "
      "about)";
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"zero_optimisation.stage=3"})); }),
            std::string("--set zero_optimisation.stage: zero_optimisation: unknown key (did you "
                        "mean \"zero_optimization\"?)") + kRule);
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"zero_optimization.stge=3"})); }),
            std::string("--set zero_optimization.stge: zero_optimization.stge: unknown key (did "
                        "you mean \"stage\"?)") + kRule);
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"porter.model.layer=8"})); }),
            std::string("--set porter.model.layer: porter.model.layer: unknown key (did you mean "
                        "\"layers\"?)") + kRule);
  // Nothing close: no suggestion, still an error.
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"completely_unrelated=1"})); }),
            std::string("--set completely_unrelated: completely_unrelated: unknown key") + kRule);
  // The error is the source's, typed as such.
  try {
    parse_config_sources(files, sets({"porter.model.layers=3", "fp16.enabeld=true"}));
    FAIL() << "no error";
  } catch (const SourcedConfigError& e) {
    EXPECT_EQ(e.source(), "--set fp16.enabeld");
    EXPECT_EQ(e.path(), "fp16.enabeld");
  }
  // Several: one error listing each.
  EXPECT_EQ(error_of([&] {
              parse_config_sources(files, sets({"porter.model.layer=8", "gradient_cliping=1"}));
            }),
            std::string("--set porter.model.layer + --set gradient_cliping: 2 keys given with --set "
                        "are unknown") + kRule + ":\n"
            "  --set porter.model.layer: porter.model.layer: unknown key (did you mean "
            "\"layers\"?)\n"
            "  --set gradient_cliping: gradient_cliping: unknown key (did you mean "
            "\"gradient_clipping\"?)");
}

TEST(SetKeys, AFilesUnknownKeyStaysAWarningUnlessASetAddsToIt) {
  const std::vector<ConfigSource> files = {
      source("ds.json", R"({"train_batch_size": 8, "gradient_cliping": 1, "extra": {"a": 1}})")};
  // Strict or not, a --set of known keys leaves the file's unknown keys warnings.
  SourcedParseResult r = parse_config_sources(files, sets({"gradient_clipping=0.5"}));
  EXPECT_EQ(texts(r), (std::vector<std::string>{
                          "ds.json: extra: unknown key, ignored",
                          "ds.json: gradient_cliping: unknown key, ignored (did you mean "
                          "\"gradient_clipping\"?)"}));
  EXPECT_DOUBLE_EQ(r.config.gradient_clipping, 0.5);
  // A --set that adds to the file's unknown section is refused: it would do nothing.
  EXPECT_EQ(error_of([&] { parse_config_sources(files, sets({"extra.b=2"})); }),
            "--set extra.b: extra: unknown key; a key given with --set must be one porter reads "
            "(a key in a config file is only warned about)");
}

TEST(Notes, CarryTheSourceOfTheirKeyAndAreNotStrictErrors) {
  const std::vector<ConfigSource> files = {
      source("ds.json", R"({"train_batch_size": 8, "zero_optimization": {"stage": 2}})"),
      source("model.json", R"({"porter": {"model": {"layers": 2}}})")};
  const SourcedParseResult r = parse_config_sources(
      files, sets({"zero_optimization.contiguous_gradients=false"}), ParseOptions{1, true});
  EXPECT_TRUE(r.warnings.empty());
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_EQ(r.notes[0].text(),
            "--set zero_optimization.contiguous_gradients: zero_optimization.contiguous_gradients: "
            "porter always keeps gradients contiguous: they accumulate in one flat buffer (at "
            "ZeRO stages 2 and 3, the rank's gradient shard), whatever the value (the key has no "
            "effect)");
}

TEST(Attribution, RulesAcrossKeysListEveryFileInvolved) {
  // train_batch_size from ds.json, the micro-batch from model.json: both are named.
  EXPECT_EQ(error_of([] {
              parse_config_sources({source("ds.json", R"({"train_batch_size": 16,
                                                          "gradient_accumulation_steps": 1})"),
                                    source("model.json", R"({"train_micro_batch_size_per_gpu": 3})")},
                                   {});
            }),
            "ds.json + model.json: train_batch_size: 16 != train_micro_batch_size_per_gpu 3 x "
            "gradient_accumulation_steps 1 x world size 1 = 3; change one of these numbers (or "
            "give only two of the three batch keys)");
  // No key to trace: every source.
  EXPECT_THAT(error_of([] {
                parse_config_sources({source("a.json", "{}"), source("b.json", "{}")}, {},
                                     ParseOptions{0, false});
              }),
              ::testing::StartsWith("a.json + b.json: world size 0 is not valid"));
}

TEST(Attribution, ASectionNamesEverySourceUnderIt) {
  MergedConfig m = merge_config_sources(
      {source("ds.json", R"({"zero_optimization": {"stage": 3}})"),
       source("extra.json", R"({"zero_optimization": {"offload_param": {"device": "cpu"}}})")});
  EXPECT_EQ(m.provenance.label("zero_optimization"), "ds.json + extra.json");
  EXPECT_EQ(m.provenance.label("zero_optimization.offload_param"), "extra.json");
  // A key nobody gave under a section one source gave is that source's.
  EXPECT_EQ(m.provenance.label("zero_optimization.offload_param.pin_memory"), "extra.json");
  // A list element is the list's.
  MergedConfig l = merge_config_sources({source("a.json", R"({"x": {"y": [1, 2]}})")},
                                        sets({"x.z=1"}));
  EXPECT_EQ(l.provenance.label("x.y[1]"), "a.json");
  // A key nobody gave is the files': no --set gave it either.
  EXPECT_EQ(l.provenance.label("absent"), "a.json");
  EXPECT_EQ(l.provenance.label(""), "a.json");
}

TEST(Attribution, StrictListsEachWarningWithItsSource) {
  const std::vector<ConfigSource> files = {
      source("ds.json", R"({"train_batch_size": 8, "gradient_cliping": 1})"),
      source("model.json", R"({"porter": {"model": {"layer": 2}}})")};
  EXPECT_EQ(error_of([&] { parse_config_sources(files, {}, ParseOptions{1, true}); }),
            "ds.json + model.json: 2 warning(s), which strict mode makes errors:\n"
            "  model.json: porter.model.layer: unknown key, ignored (did you mean \"layers\"?)\n"
            "  ds.json: gradient_cliping: unknown key, ignored (did you mean "
            "\"gradient_clipping\"?)");
  // One source for all of them: parse_config_string's text after it.
  EXPECT_EQ(error_of([&] { parse_config_sources({files[0], source("b.json", "{}")}, {},
                                               ParseOptions{1, true}); }),
            "ds.json: 1 warning(s), which strict mode makes errors:\n"
            "  gradient_cliping: unknown key, ignored (did you mean \"gradient_clipping\"?)");
}

TEST(Syntax, ErrorsInTheSecondFileNameItWithLineAndColumn) {
  EXPECT_EQ(error_of([] { source("model.json", "{\n  \"a\": [1,\n}"); }),
            "model.json: malformed JSON at line 3, column 1: syntax error while parsing value - "
            "unexpected '}'; expected '[', '{', or a literal");
  EXPECT_THAT(error_of([] { source("model.json", "{\"porter\": {\n  \"model\": 1,\n  \"model\": 2}}"); }),
              ::testing::StartsWith("model.json: porter.model: duplicate key \"model\" at line 3, "
                                    "column 3"));
  EXPECT_THAT(error_of([] { source("model.json", " \n"); }),
              ::testing::StartsWith("model.json: the config is empty"));
  EXPECT_EQ(error_of([] { source("model.json", "[1]"); }),
            "model.json: expected a JSON object at the top level, got [1]");
  EXPECT_THROW(read_config_source("/nonexistent/model.json"), IoError);
}

// With one file and nothing set, every result and message is parse_config_file's after the
// file's name.
TEST(SingleSource, IsParseConfigFileAfterTheName) {
  for (const auto& entry : std::filesystem::directory_iterator(kRealWorld)) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    const std::string name = entry.path().string();
    ParseResult direct = parse_config_file(entry.path());
    SourcedParseResult sourced = parse_config_sources({read_config_source(entry.path())}, {});
    EXPECT_EQ(sourced.config, direct.config);
    std::vector<std::string> expected;
    for (const Warning& w : direct.warnings) expected.push_back(name + ": " + w.text());
    EXPECT_EQ(texts(sourced), expected);
    const std::string strict_direct =
        error_of([&] { parse_config_file(entry.path(), ParseOptions{1, true}); });
    const std::string strict_sourced = error_of(
        [&] { parse_config_sources({read_config_source(entry.path())}, {}, ParseOptions{1, true}); });
    EXPECT_EQ(strict_sourced, strict_direct.empty() ? "" : name + ": " + strict_direct);
  }
  const std::string bad = R"({"train_batch_size": 8, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"}}, "fp16": {"enabled": "yes"}})";
  EXPECT_EQ(error_of([&] { parse_config_sources({source("f.json", bad)}, {}); }),
            "f.json: " + error_of([&] { parse_config_string(bad); }));
}

}  // namespace
}  // namespace porter::config
