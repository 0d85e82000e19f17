// `memtune report`: from a metrics.jsonl written here with known values and events, the
// PNGs are real PNG files of the asked size, report.html embeds exactly those bytes (decoded
// by Python's base64, not ours) and states the summary figures and events; bad inputs give
// errors that say what and where. Then the real command on a real (tiny) training run.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "test_util.h"
#include "trainer/report.h"

namespace memtune::testing {
namespace {

using nlohmann::json;
constexpr int64_t GiB = int64_t(1) << 30;

std::string throws_message(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UserError thrown";
  return "";
}

void write_rows(const fs::path& dir, const std::vector<json>& rows) {
  fs::create_directories(dir);
  std::string text;
  for (const auto& r : rows) text += r.dump() + "\n";
  write_file(dir / "metrics.jsonl", text);
}

json step_row(int64_t step, double loss, int64_t micro, int64_t peak, json events = json::array()) {
  return {{"step", step},
          {"epoch", 0},
          {"loss", loss},
          {"lr", 1e-3 * std::min<double>(1.0, step / 4.0)},
          {"grad_norm", events.empty() ? json(0.5) : json(nullptr)},
          {"tokens", 256},
          {"tokens_per_s", 1000.0 + step},
          {"loss_scale", 1.0},
          {"micro_batch", micro},
          {"accumulation", 8 / micro},
          {"memory", {{"cpu", {{"allocated", GiB}, {"peak", peak}, {"limit", 4 * GiB}}}}},
          {"events", events}};
}

// 12 steps: an OOM and shrink at step 4, a grow at 9, a skipped step at 11; eval every 5
// steps; accuracy before and after. Known figures: final loss 0.8125, lowest eval loss
// 1.5 at step 10, peak 3 GiB of a 4 GiB limit, accuracy 25 % -> 75 %.
std::vector<json> known_run() {
  std::vector<json> rows = {{{"step", 0}, {"accuracy", 0.25}, {"accuracy_rows", 8}}};
  for (int64_t s = 1; s <= 12; ++s) {
    json ev = json::array();
    int64_t micro = s >= 4 && s < 9 ? 2 : 4;
    if (s == 4)
      ev = {{{"step", 3}, {"kind", "oom"}, {"detail", "injected <out of memory>"}},
            {{"step", 3}, {"kind", "shrink"}, {"detail", "micro-batch 4 -> 2"}}};
    if (s == 9) ev = {{{"step", 8}, {"kind", "grow"}, {"detail", "micro-batch 2 -> 4 after 5 steps"}}};
    if (s == 11) ev = {{{"step", 10}, {"kind", "skip"}, {"detail", "inf/nan gradients"}}};
    const int64_t peak = s == 7 ? 3 * GiB : 2 * GiB;
    rows.push_back(step_row(s, s == 12 ? 0.8125 : 3.0 - 0.15 * s, micro, peak, ev));
    if (s % 5 == 0)
      rows.push_back({{"step", s}, {"eval_loss", s == 10 ? 1.5 : 2.25}, {"eval_perplexity", std::exp(s == 10 ? 1.5 : 2.25)},
                      {"eval_tokens", 512}});
  }
  rows.push_back({{"step", 12}, {"eval_loss", 1.75}, {"eval_perplexity", std::exp(1.75)}, {"eval_tokens", 512}});
  rows.push_back({{"step", 12}, {"accuracy", 0.75}, {"accuracy_rows", 8}});
  return rows;
}

// Width and height from a PNG's IHDR chunk; fails the test unless the file is a PNG.
std::pair<uint32_t, uint32_t> png_size(const fs::path& p) {
  const std::string b = read_file(p);
  EXPECT_GT(b.size(), 1000u) << p;
  if (b.size() < 24) return {0, 0};
  EXPECT_EQ(b.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8)) << p;
  EXPECT_EQ(b.substr(12, 4), "IHDR") << p;
  auto be32 = [&](size_t i) {
    return (uint32_t(uint8_t(b[i])) << 24) | (uint32_t(uint8_t(b[i + 1])) << 16) | (uint32_t(uint8_t(b[i + 2])) << 8) |
           uint32_t(uint8_t(b[i + 3]));
  };
  return {be32(16), be32(20)};
}

std::string table_row(const std::string& what, const std::string& value) {
  return "<tr><th>" + what + "</th><td>" + value + "</td></tr>";
}

TEST(Report, PlotsAndSelfContainedHtmlFromKnownMetrics) {
  const fs::path run_dir = temp_dir("run"), out = temp_dir("out");
  write_rows(run_dir, known_run());
  write_file(run_dir / "config.yaml", "model:\n  name_or_path: tiny-llama\ntraining:\n  max_steps: 12\n");
  write_file(run_dir / "memory_report.txt", "memtune memory report (cpu)\npeak in backward: 3.00 GiB\n");

  trainer::ReportOptions o;
  o.out_dir = out;
  o.width = 800;
  o.height = 400;
  const trainer::ReportFiles f = trainer::write_report(run_dir, o);
  EXPECT_EQ(f.html, out / "report.html");
  ASSERT_EQ(f.plots.size(), 4u);
  for (const char* name : {"loss.png", "lr.png", "tokens_per_s.png", "memory.png"}) {
    EXPECT_NE(std::find(f.plots.begin(), f.plots.end(), out / name), f.plots.end()) << name;
    EXPECT_EQ(png_size(out / name), std::make_pair(800u, 400u)) << name;
  }
  EXPECT_FALSE(fs::exists(run_dir / "report.html")) << "--out must be honoured";

  const std::string html = read_file(f.html);
  // Self-contained: no URL is fetched.
  EXPECT_EQ(html.find("http://"), std::string::npos);
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  // The data URIs, decoded by Python, are the PNG files' bytes, in order.
  write_file(out / "check.py",
             "import base64, re, sys\n"
             "html = open(sys.argv[1]).read()\n"
             "uris = re.findall(r'src=\"data:image/png;base64,([A-Za-z0-9+/=]+)\"', html)\n"
             "files = sys.argv[2:]\n"
             "assert len(uris) == len(files), (len(uris), len(files))\n"
             "for u, f in zip(uris, files):\n"
             "    assert base64.b64decode(u, validate=True) == open(f, 'rb').read(), f\n"
             "print('ok', len(uris))\n");
  std::string cmd = python() + " " + (out / "check.py").string() + " " + f.html.string();
  for (const auto& p : f.plots) cmd += " " + p.string();
  const CommandResult check = run(cmd, 60);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_NE(check.output.find("ok 4"), std::string::npos) << check.output;

  // Summary figures.
  EXPECT_NE(html.find(table_row("steps", "12 (12 rows logged)")), std::string::npos);
  EXPECT_NE(html.find(table_row("final loss", "0.8125")), std::string::npos);
  EXPECT_NE(html.find(table_row("best eval loss", "1.5000 (step 10, perplexity 4.48)")), std::string::npos);
  EXPECT_NE(html.find(table_row("final eval loss", "1.7500 (step 12, perplexity 5.75, 512 tokens)")),
            std::string::npos);
  EXPECT_NE(html.find(table_row("accuracy before training", "25.0% (8 rows)")), std::string::npos);
  EXPECT_NE(html.find(table_row("accuracy after training", "75.0% (8 rows, step 12)")), std::string::npos);
  EXPECT_NE(html.find(table_row("peak memory (cpu)", "3.00 GiB of a 4.00 GiB limit (75.0%)")), std::string::npos);
  EXPECT_NE(html.find(table_row("micro-batch x accumulation", "4 x 2 at the first logged step, 4 x 2 at the last")),
            std::string::npos);
  EXPECT_NE(html.find(table_row("events", "1 grow, 1 oom, 1 shrink, 1 skip")), std::string::npos);
  // Events table, details escaped.
  EXPECT_NE(html.find("<tr><td>4</td><td class=\"oom\">oom</td><td>injected &lt;out of memory&gt;</td></tr>"),
            std::string::npos);
  EXPECT_NE(html.find("<tr><td>4</td><td class=\"shrink\">shrink</td><td>micro-batch 4 -&gt; 2</td></tr>"),
            std::string::npos);
  EXPECT_NE(html.find("<td class=\"grow\">grow</td>"), std::string::npos);
  EXPECT_NE(html.find("<tr><td>11</td><td class=\"skip\">skip</td><td>inf/nan gradients</td></tr>"),
            std::string::npos);
  // The run's own files.
  EXPECT_NE(html.find("name_or_path: tiny-llama"), std::string::npos);
  EXPECT_NE(html.find("peak in backward: 3.00 GiB"), std::string::npos);
}

TEST(Report, ResumedRunReplacesTheStoppedRunsRows) {
  // Stopped after step 6 with a checkpoint at 4: the resumed run logs 5.. again.
  std::vector<json> rows;
  for (int64_t s = 1; s <= 6; ++s) rows.push_back(step_row(s, 9.0, 4, GiB));
  rows.back()["events"] = {{{"step", 5}, {"kind", "oom"}, {"detail", "stopped run"}}};
  for (int64_t s = 5; s <= 8; ++s) rows.push_back(step_row(s, 2.0 - 0.125 * s, 4, GiB));
  const fs::path run_dir = temp_dir();
  write_rows(run_dir, rows);
  const std::string html = read_file(trainer::write_report(run_dir).html);
  EXPECT_NE(html.find(table_row("steps", "8 (8 rows logged)")), std::string::npos);
  EXPECT_NE(html.find(table_row("final loss", "1.0000")), std::string::npos);
  EXPECT_NE(html.find(table_row("lowest loss", "1.0000 (step 8)")), std::string::npos);
  EXPECT_NE(html.find(table_row("events", "none")), std::string::npos);
  EXPECT_NE(html.find("2 rows of a stopped run replaced"), std::string::npos);
  EXPECT_NE(html.find(table_row("peak memory (cpu)", "1.00 GiB of a 4.00 GiB limit (25.0%)")), std::string::npos);
}

TEST(Report, BadInputsSayWhatAndWhere) {
  const fs::path base = temp_dir();
  std::string m = throws_message([&] { trainer::write_report(base / "nope"); });
  EXPECT_NE(m.find("nope"), std::string::npos) << m;
  EXPECT_NE(m.find("does not exist"), std::string::npos) << m;

  m = throws_message([&] { trainer::write_report(base); });
  EXPECT_NE(m.find("metrics.jsonl not found"), std::string::npos) << m;

  const fs::path bad = base / "bad";
  fs::create_directories(bad);
  write_file(bad / "metrics.jsonl", step_row(1, 2.0, 4, GiB).dump() + "\n\n{\"step\": 2, \"loss\": 1.5,\n");
  m = throws_message([&] { trainer::write_report(bad); });
  EXPECT_NE(m.find((bad / "metrics.jsonl").string() + ":3: not valid JSON"), std::string::npos) << m;

  write_file(bad / "metrics.jsonl", step_row(1, 2.0, 4, GiB).dump() + "\n{\"step\": 2, \"loss\": \"low\"}\n");
  m = throws_message([&] { trainer::write_report(bad); });
  EXPECT_NE(m.find("metrics.jsonl:2: 'loss' is \"low\", expected a number"), std::string::npos) << m;

  write_file(bad / "metrics.jsonl", "{\"loss\": 1.0}\n");
  m = throws_message([&] { trainer::write_report(bad); });
  EXPECT_NE(m.find("metrics.jsonl:1: key 'step' is missing"), std::string::npos) << m;

  write_file(bad / "metrics.jsonl", "[1, 2]\n");
  m = throws_message([&] { trainer::write_report(bad); });
  EXPECT_NE(m.find("metrics.jsonl:1: a row is [1,2], expected a JSON object"), std::string::npos) << m;

  write_file(bad / "metrics.jsonl", "{\"step\": 0, \"accuracy\": 0.5}\n");
  m = throws_message([&] { trainer::write_report(bad); });
  EXPECT_NE(m.find("no training step logged"), std::string::npos) << m;

  write_rows(bad, {step_row(1, 2.0, 4, GiB)});
  trainer::ReportOptions o;
  o.gnuplot = (base / "no-such-gnuplot").string();
  m = throws_message([&] { trainer::write_report(bad, o); });
  EXPECT_NE(m.find("cannot run"), std::string::npos) << m;
  EXPECT_NE(m.find("gnuplot-nox"), std::string::npos) << m;

  // A gnuplot that fails: its status and output are reported.
  write_file(base / "failing-gnuplot", "#!/bin/sh\necho 'pngcairo: unknown terminal' >&2\nexit 3\n");
  fs::permissions(base / "failing-gnuplot", fs::perms::owner_all);
  o.gnuplot = (base / "failing-gnuplot").string();
  m = throws_message([&] { trainer::write_report(bad, o); });
  EXPECT_NE(m.find("exited with status 3"), std::string::npos) << m;
  EXPECT_NE(m.find("pngcairo: unknown terminal"), std::string::npos) << m;
}

// Two runs side by side, as the 8-bit against 32-bit AdamW comparison: the other run's losses
// are in the plot's data and named in its legend, and the table's figures are those the test
// computes from the rows it wrote.
TEST(Report, ComparedRunsAreDrawnAndTabled) {
  const fs::path base = temp_dir();
  const fs::path mine = base / "adamw_torch", other = base / "adamw_8bit", out = base / "out";
  write_rows(mine, known_run());
  std::vector<json> rows;
  std::vector<double> losses;
  for (int64_t s = 1; s <= 14; ++s) {  // two steps more than this run: the x range covers both
    losses.push_back(3.1 - 0.17 * static_cast<double>(s));
    rows.push_back(step_row(s, losses.back(), 4, GiB));
  }
  rows.push_back({{"step", 14}, {"eval_loss", 0.625}, {"eval_perplexity", std::exp(0.625)}, {"eval_tokens", 512}});
  write_rows(other, rows);

  trainer::ReportOptions o;
  o.out_dir = out;
  o.compare = {other};
  const trainer::ReportFiles f = trainer::write_report(mine, o);
  EXPECT_EQ(png_size(out / "loss.png"), std::make_pair(960u, 480u));

  // The script holds the other run's 14 losses and its eval, both named in the legend.
  const std::string script = read_file(f.script);
  const size_t block = script.find("$compare0 << EOD\n");
  ASSERT_NE(block, std::string::npos) << script;
  std::istringstream data(script.substr(block + 17));
  std::string line;
  int64_t n = 0;
  while (std::getline(data, line) && line != "EOD") {
    std::istringstream fields(line);
    int64_t step;
    double loss;
    fields >> step >> loss;
    ASSERT_LT(n, 14) << line;
    EXPECT_EQ(step, n + 1);
    EXPECT_NEAR(loss, losses[n], 1e-9);
    ++n;
  }
  EXPECT_EQ(n, 14);
  EXPECT_NE(script.find("$compare0_eval << EOD\n14 0.625\nEOD"), std::string::npos) << script;
  EXPECT_NE(script.find("title \"train loss: adamw_8bit\""), std::string::npos);
  EXPECT_NE(script.find("title \"eval loss: adamw_8bit\""), std::string::npos);
  EXPECT_NE(script.find("title \"train loss: adamw_torch\""), std::string::npos);
  EXPECT_NE(script.find("set xrange [0:14]"), std::string::npos);

  // The table: the mean of each run's last 10 losses, and the other's relative to this one's.
  double mine_tail = 0, other_tail = 0;
  for (int64_t s = 3; s <= 12; ++s) mine_tail += s == 12 ? 0.8125 : 3.0 - 0.15 * static_cast<double>(s);
  for (int64_t i = 4; i < 14; ++i) other_tail += losses[i];
  mine_tail /= 10;  // 1.83625: summed, then divided, so the double (and its rounding to 4 places) is the code's
  other_tail /= 10;
  const std::string html = read_file(f.html);
  EXPECT_NE(html.find("<h2>Compared runs</h2>"), std::string::npos);
  EXPECT_NE(html.find(fmt::format("<tr><td>adamw_torch</td><td>12</td><td>0.8125</td><td>{:.4f}</td><td>-</td>"
                                  "<td>1.7500</td><td>75.0%</td></tr>",
                                  mine_tail)),
            std::string::npos)
      << html;
  EXPECT_NE(html.find(fmt::format("<tr><td>adamw_8bit</td><td>14</td><td>{:.4f}</td><td>{:.4f}</td><td>{:+.1f}%</td>"
                                  "<td>0.6250</td><td>-</td></tr>",
                                  losses.back(), other_tail, 100 * (other_tail - mine_tail) / mine_tail)),
            std::string::npos)
      << html;

  // A compared directory that is not a run: named, and nothing is written.
  fs::remove_all(out);
  o.compare = {base / "nope"};
  const std::string m = throws_message([&] { trainer::write_report(mine, o); });
  EXPECT_NE(m.find("--compare: " + (base / "nope" / "metrics.jsonl").string() + " not found"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists(out / "report.html"));
}

TEST(Report, CommandPrintsThePathsItWrote) {
  const fs::path run_dir = temp_dir("run"), out = temp_dir("out");
  write_rows(run_dir, known_run());
  CommandResult r = run(memtune_bin() + " report " + run_dir.string() + " --out " + out.string(), 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"report.html", "loss.png", "lr.png", "tokens_per_s.png", "memory.png"}) {
    EXPECT_NE(r.output.find((out / name).string() + "\n"), std::string::npos) << name << "\n" << r.output;
    EXPECT_TRUE(fs::is_regular_file(out / name)) << name;
  }
  r = run(memtune_bin() + " report " + (run_dir / "missing").string(), 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
}

// A real run: `memtune train` with an injected OOM (shrink) and a grow, then `memtune report`.
TEST(Report, RealTrainingRunWithOomAndGrow) {
  const fs::path dir = temp_dir(), src = source_dir();
  write_file(dir / "config.yaml.in",
             "model:\n"
             "  name_or_path: tiny-llama\n"
             "  tokenizer: " + (src / "examples/tiny-tokenizer").string() + "\n"
             "  quantization_config: {load_in_4bit: true, bnb_4bit_compute_dtype: auto}\n"
             "lora: {r: 4, lora_alpha: 8, target_modules: all-linear}\n"
             "runtime: {device: cpu}\n"  // CPU budgets and fp32, on a GPU machine too
             "training:\n"
             "  output_dir: " + (dir / "out").string() + "\n"
             "  per_device_train_batch_size: 4\n"
             "  gradient_accumulation_steps: 1\n"
             "  max_steps: 8\n"
             "  seed: 7\n"
             "data:\n"
             "  train_file: " + (src / "examples/data/tasks_train.jsonl").string() + "\n"
             "  format: instruction\n"
             "  max_seq_length: 64\n"
             "  cache_dir: " + (dir / "cache").string() + "\n"
             "memory:\n"
             "  inject_oom: \"2:backward\"\n"
             "  device_limit: 8GiB\n"
             "  grow_after_steps: 3\n");
  CommandResult r = run(memtune_bin() + " train " + (dir / "config.yaml.in").string(), 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run(memtune_bin() + " report " + (dir / "out").string(), 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"loss.png", "lr.png", "tokens_per_s.png", "memory.png"})
    EXPECT_EQ(png_size(dir / "out" / name), std::make_pair(960u, 480u)) << name;
  const std::string html = read_file(dir / "out" / "report.html");
  EXPECT_NE(html.find(table_row("steps", "8 (8 rows logged)")), std::string::npos);
  EXPECT_NE(html.find("<tr><td>3</td><td class=\"oom\">oom</td>"), std::string::npos);
  EXPECT_NE(html.find("<tr><td>3</td><td class=\"shrink\">shrink</td><td>micro-batch 4 -&gt; 2"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"grow\">grow</td>"), std::string::npos);
  EXPECT_NE(html.find("memtune memory report"), std::string::npos);
  EXPECT_NE(html.find("inject_oom"), std::string::npos) << "the effective config is shown";
}

}  // namespace
}  // namespace memtune::testing
