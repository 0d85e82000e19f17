#include "trainer/report.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/units.h"

extern char** environ;

namespace memtune::trainer {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// ---- metrics.jsonl, as trainer.cpp writes it -------------------------------------------

struct DeviceMemory {
  double allocated = NAN, peak = NAN, limit = 0;  // bytes; limit 0: none
};

struct StepRow {
  int64_t step = 0;
  double epoch = NAN, loss = NAN, lr = NAN, grad_norm = NAN, tokens_per_s = NAN, loss_scale = NAN;
  int64_t micro_batch = 0, accumulation = 0;
  int64_t samples = 0;  // 0: not logged (earlier versions)
  std::map<std::string, DeviceMemory> memory;  // device name ("cpu", "cuda:0") -> bytes
};

struct EventRow {
  int64_t step = 0;  // the logged step whose row carried it (the x of the plots)
  std::string kind, detail;
};

struct EvalRow {
  int64_t step = 0;
  double loss = NAN, perplexity = NAN;
  int64_t tokens = 0;
};

struct AccuracyRow {
  int64_t step = 0;
  double accuracy = NAN;  // share of rows answered right, in [0, 1]
  int64_t rows = 0;
};

struct RunMetrics {
  std::vector<StepRow> steps;
  std::vector<EvalRow> evals;
  std::vector<AccuracyRow> accuracy;
  std::vector<EventRow> events;
  int64_t superseded = 0;  // rows replaced by a resumed run logging the same steps again
};

// One row's fields, with errors that name file:line and the key.
struct Row {
  const json& j;
  const std::string& where;

  const json& at(const char* key) const {
    auto it = j.find(key);
    MEMTUNE_CHECK(it != j.end(), where, ": key '", key, "' is missing (row: ", j.dump(), ")");
    return *it;
  }
  double number(const char* key) const {
    const json& v = at(key);
    MEMTUNE_CHECK(v.is_number(), where, ": '", key, "' is ", v.dump(), ", expected a number");
    return v.get<double>();
  }
  // Absent or null (grad_norm of a skipped step): NaN.
  double optional_number(const char* key) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return NAN;
    MEMTUNE_CHECK(it->is_number(), where, ": '", key, "' is ", it->dump(), ", expected a number or null");
    return it->get<double>();
  }
  int64_t integer(const char* key) const {
    const json& v = at(key);
    MEMTUNE_CHECK(v.is_number_integer(), where, ": '", key, "' is ", v.dump(), ", expected an integer");
    return v.get<int64_t>();
  }
  int64_t optional_integer(const char* key) const { return j.contains(key) ? integer(key) : 0; }
};

StepRow parse_step(const Row& r, std::vector<EventRow>& events) {
  StepRow s;
  s.step = r.integer("step");
  s.loss = r.number("loss");
  s.epoch = r.optional_number("epoch");
  s.lr = r.optional_number("lr");
  s.grad_norm = r.optional_number("grad_norm");
  s.tokens_per_s = r.optional_number("tokens_per_s");
  s.loss_scale = r.optional_number("loss_scale");
  s.micro_batch = r.optional_integer("micro_batch");
  s.accumulation = r.optional_integer("accumulation");
  s.samples = r.optional_integer("samples");
  if (r.j.contains("memory")) {
    const json& m = r.j["memory"];
    MEMTUNE_CHECK(m.is_object(), r.where, ": 'memory' is ", m.dump(),
                  ", expected {device: {allocated, peak, limit}}");
    for (const auto& [device, stats] : m.items()) {
      MEMTUNE_CHECK(stats.is_object(), r.where, ": 'memory.", device, "' is ", stats.dump(),
                    ", expected {allocated, peak, limit}");
      const std::string where = r.where + " (memory." + device + ")";
      Row d{stats, where};
      const double limit = d.optional_number("limit");
      s.memory[device] = {d.optional_number("allocated"), d.optional_number("peak"), std::isnan(limit) ? 0.0 : limit};
    }
  }
  if (r.j.contains("events")) {
    const json& ev = r.j["events"];
    MEMTUNE_CHECK(ev.is_array(), r.where, ": 'events' is ", ev.dump(), ", expected a list");
    for (const json& e : ev) {
      MEMTUNE_CHECK(e.is_object() && e.contains("kind") && e["kind"].is_string(), r.where, ": event ", e.dump(),
                    " has no 'kind' string");
      std::string detail = e.contains("detail") && e["detail"].is_string() ? e["detail"].get<std::string>() : "";
      events.push_back({s.step, e["kind"].get<std::string>(), detail});
    }
  }
  return s;
}

RunMetrics read_metrics(const fs::path& file) {
  std::ifstream in(file);
  MEMTUNE_CHECK(in, file.string(), ": cannot be read: ", std::strerror(errno));
  RunMetrics m;
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = file.string() + ":" + std::to_string(line_no);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      fail(where, ": not valid JSON (", e.what(), "); each line of metrics.jsonl is one JSON object");
    }
    MEMTUNE_CHECK(j.is_object(), where, ": a row is ", j.dump(), ", expected a JSON object");
    Row r{j, where};
    const int64_t step = r.integer("step");
    if (j.contains("loss")) {
      // A resumed run logs again from the step after its checkpoint: its rows replace
      // those the stopped run wrote from there on.
      if (!m.steps.empty() && step <= m.steps.back().step) {
        auto later = [step](const auto& x) { return x.step >= step; };
        const size_t before = m.steps.size() + m.evals.size() + m.accuracy.size();
        m.steps.erase(std::remove_if(m.steps.begin(), m.steps.end(), later), m.steps.end());
        m.evals.erase(std::remove_if(m.evals.begin(), m.evals.end(), later), m.evals.end());
        m.accuracy.erase(std::remove_if(m.accuracy.begin(), m.accuracy.end(), later), m.accuracy.end());
        m.events.erase(std::remove_if(m.events.begin(), m.events.end(), later), m.events.end());
        m.superseded += static_cast<int64_t>(before - m.steps.size() - m.evals.size() - m.accuracy.size());
      }
      m.steps.push_back(parse_step(r, m.events));
    } else if (j.contains("eval_loss")) {
      m.evals.push_back({step, r.number("eval_loss"), r.optional_number("eval_perplexity"),
                         r.optional_integer("eval_tokens")});
    } else if (j.contains("accuracy")) {
      m.accuracy.push_back({step, r.number("accuracy"), r.optional_integer("accuracy_rows")});
    } else {
      fail(where, ": a row with neither 'loss' (a training step), 'eval_loss' nor 'accuracy': ", j.dump());
    }
  }
  MEMTUNE_CHECK(!m.steps.empty(), file.string(),
                ": no training step logged (no row with 'loss'); did the run reach its first step?");
  return m;
}

// A compared run: its label on the plot and in the table (the directory's name), its metrics.
struct Compared {
  std::string label;
  RunMetrics m;
};

std::string run_label(const fs::path& dir) {
  const fs::path d = fs::absolute(dir).lexically_normal();
  const std::string name = (d.has_filename() ? d : d.parent_path()).filename().string();
  return name.empty() ? d.string() : name;
}

// The mean loss of the last n logged steps (fewer when fewer were logged): what "the loss
// after training" means for a noisy per-step loss.
double tail_mean(const RunMetrics& m, size_t n) {
  const size_t k = std::min(n, m.steps.size());
  double sum = 0;
  for (size_t i = m.steps.size() - k; i < m.steps.size(); ++i) sum += m.steps[i].loss;
  return sum / static_cast<double>(k);
}

constexpr size_t kTailSteps = 10;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ---- gnuplot ---------------------------------------------------------------------------

// Event kinds marked on the plots, most severe first (a step with several takes the first's
// colour); the others (warning, release) are in the events table only.
const std::vector<std::pair<std::string, std::string>>& marked_kinds() {
  static const std::vector<std::pair<std::string, std::string>> k = {
      {"oom", "#d62728"},   {"emergency", "#e377c2"}, {"shrink", "#ff7f0e"},   {"ladder", "#9467bd"},
      {"grow_failed", "#8c564b"}, {"grow", "#2ca02c"}, {"skip", "#7f7f7f"}};
  return k;
}

std::string gp_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string num(double v) { return std::isfinite(v) ? fmt::format("{:.10g}", v) : "NaN"; }

// The memory plot's scale: the limit is drawn unless it is so far above the use that the
// curves would lie flat on the axis; then it is named in the title instead.
struct MemoryScale {
  double unit = 1024.0 * 1024;  // bytes per plotted unit
  const char* unit_name = "MiB";
  double top = 0;               // bytes: top of the y axis before the margin
  bool draw_limit = false;
  double limit = 0;             // bytes, largest of the devices'; 0: none
};

MemoryScale memory_scale(const RunMetrics& m) {
  MemoryScale s;
  double used = 0;
  for (const auto& st : m.steps)
    for (const auto& [d, v] : st.memory) {
      for (double x : {v.peak, v.allocated})
        if (std::isfinite(x)) used = std::max(used, x);
      s.limit = std::max(s.limit, v.limit);
    }
  s.draw_limit = s.limit > 0 && s.limit <= 4 * used;
  s.top = s.draw_limit ? std::max(used, s.limit) : used;
  if (s.top >= 1024.0 * 1024 * 1024) s.unit = 1024.0 * 1024 * 1024, s.unit_name = "GiB";
  return s;
}

std::vector<std::string> devices(const RunMetrics& m) {
  std::vector<std::string> out;
  for (const auto& s : m.steps)
    for (const auto& [d, v] : s.memory)
      if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  return out;
}

std::string gnuplot_script(const RunMetrics& m, const std::vector<Compared>& others, const std::string& label,
                           const fs::path& out, const ReportOptions& o) {
  std::ostringstream g;
  g << "# memtune report: plots of metrics.jsonl (gnuplot 5)\n";
  g << "set terminal pngcairo size " << o.width << "," << o.height << " noenhanced font \"sans,10\"\n";
  g << "set grid lc rgb \"#dddddd\"\nset key outside right top\nset xlabel \"step\"\n";

  // From step 0 (before training), so sparse logging (logging_steps) still shows the start.
  int64_t x0 = 0, x1 = m.steps.back().step;
  for (const auto& e : m.evals) x1 = std::max(x1, e.step);
  for (const auto& c : others) {
    x1 = std::max(x1, c.m.steps.back().step);
    for (const auto& e : c.m.evals) x1 = std::max(x1, e.step);
  }
  if (x1 <= x0) x1 = x0 + 1;
  g << "set xrange [" << x0 << ":" << x1 << "]\n";

  const MemoryScale scale = memory_scale(m);
  const std::vector<std::string> devs = devices(m);
  // step loss lr tokens_per_s micro_batch, then allocated peak limit per device (in unit)
  g << "$steps << EOD\n";
  for (const auto& s : m.steps) {
    g << s.step << " " << num(s.loss) << " " << num(s.lr) << " " << num(s.tokens_per_s) << " "
      << (s.micro_batch > 0 ? num(static_cast<double>(s.micro_batch)) : "NaN");
    for (const auto& d : devs) {
      auto it = s.memory.find(d);
      if (it == s.memory.end()) {
        g << " NaN NaN NaN";
        continue;
      }
      g << " " << num(it->second.allocated / scale.unit) << " " << num(it->second.peak / scale.unit) << " "
        << (it->second.limit > 0 ? num(it->second.limit / scale.unit) : "NaN");
    }
    g << "\n";
  }
  g << "EOD\n";
  if (!m.evals.empty()) {
    g << "$eval << EOD\n";
    for (const auto& e : m.evals) g << e.step << " " << num(e.loss) << "\n";
    g << "EOD\n";
  }
  // Compared runs: step loss, then their evals.
  for (size_t i = 0; i < others.size(); ++i) {
    g << "$compare" << i << " << EOD\n";
    for (const auto& s : others[i].m.steps) g << s.step << " " << num(s.loss) << "\n";
    g << "EOD\n";
    if (!others[i].m.evals.empty()) {
      g << "$compare" << i << "_eval << EOD\n";
      for (const auto& e : others[i].m.evals) g << e.step << " " << num(e.loss) << "\n";
      g << "EOD\n";
    }
  }

  // Events: one dashed vertical line per step, labelled with its kinds.
  std::map<int64_t, std::vector<std::string>> at_step;
  for (const auto& e : m.events)
    for (const auto& [kind, colour] : marked_kinds())
      if (e.kind == kind) {
        auto& kinds = at_step[e.step];
        if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
      }
  std::vector<std::string> kinds_seen;
  int id = 1;
  const bool labels = at_step.size() <= 40;  // beyond that labels overlap; the lines stay
  for (auto& [step, kinds] : at_step) {
    std::string colour, label;
    for (const auto& [kind, c] : marked_kinds())
      if (std::find(kinds.begin(), kinds.end(), kind) != kinds.end()) {
        if (colour.empty()) {
          colour = c;  // the legend names the kinds whose colour a line has
          if (std::find(kinds_seen.begin(), kinds_seen.end(), kind) == kinds_seen.end()) kinds_seen.push_back(kind);
        }
        label += (label.empty() ? "" : "+") + kind;
      }
    g << "set arrow " << id << " from first " << step << ", graph 0 to first " << step
      << ", graph 1 nohead dt 2 lw 1.5 lc rgb " << gp_quote(colour) << " front\n";
    if (labels)
      g << "set label " << id << " " << gp_quote(label + " @" + std::to_string(step)) << " at first " << step
        << ", graph 0.98 rotate by 90 right offset -1.2,0 font \",8\" tc rgb " << gp_quote(colour) << " front\n";
    ++id;
  }
  std::string event_keys;
  for (const auto& [kind, colour] : marked_kinds())
    if (std::find(kinds_seen.begin(), kinds_seen.end(), kind) != kinds_seen.end())
      event_keys += ", NaN with lines dt 2 lw 1.5 lc rgb " + gp_quote(colour) + " title " + gp_quote(kind);

  // One plot; a plot whose series hold no number says so instead of failing in gnuplot.
  auto plot = [&](const char* file, const char* title, const std::string& ylabel, const std::vector<std::string>& items) {
    g << "set output " << gp_quote((out / file).string()) << "\nset title " << gp_quote(title) << "\nset ylabel "
      << gp_quote(ylabel) << "\n";
    if (items.empty()) {
      g << "set yrange [0:1]\nset label 999 \"no figures for this plot in metrics.jsonl\" at graph 0.5, graph 0.5 "
           "center\nplot 2 notitle\nunset label 999\nset yrange [*:*]\n";
      return;
    }
    g << "plot ";
    for (size_t i = 0; i < items.size(); ++i) g << (i ? ", " : "") << items[i];
    g << event_keys << "\n";
  };
  auto any = [&](auto get) {
    return std::any_of(m.steps.begin(), m.steps.end(), [&](const StepRow& s) { return std::isfinite(get(s)); });
  };

  // With compared runs each line names its run; this run keeps its colours, the others
  // theirs from a palette (train solid, eval with points).
  const std::string own = others.empty() ? "" : ": " + label;
  std::vector<std::string> items = {"$steps using 1:2 with lines lw 2 lc rgb \"#1f77b4\" title " +
                                    gp_quote("train loss" + own)};
  if (!m.evals.empty())
    items.push_back("$eval using 1:2 with linespoints lw 2 pt 7 lc rgb \"#d62728\" title " + gp_quote("eval loss" + own));
  const char* compare_palette[] = {"#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};
  for (size_t i = 0; i < others.size(); ++i) {
    const std::string c = gp_quote(compare_palette[i % 6]);
    items.push_back(fmt::format("$compare{} using 1:2 with lines lw 2 lc rgb {} title {}", i, c,
                                gp_quote("train loss: " + others[i].label)));
    if (!others[i].m.evals.empty())
      items.push_back(fmt::format("$compare{}_eval using 1:2 with linespoints lw 2 pt 5 dt 2 lc rgb {} title {}", i, c,
                                  gp_quote("eval loss: " + others[i].label)));
  }
  plot("loss.png", others.empty() ? "loss" : "loss, compared", "loss (mean cross-entropy per target token)", items);

  items.clear();
  if (any([](const StepRow& s) { return s.lr; }))
    items.push_back("$steps using 1:3 with lines lw 2 lc rgb \"#1f77b4\" title \"lr\"");
  // From zero, with room above a constant line that would hide in the frame.
  auto from_zero = [&](auto get) {
    double top = 0;
    for (const auto& st : m.steps)
      if (std::isfinite(get(st))) top = std::max(top, get(st));
    g << (top > 0 ? "set yrange [0:" + num(1.1 * top) + "]\n" : std::string("set yrange [*:*]\n"));
  };
  from_zero([](const StepRow& s) { return s.lr; });
  g << "set format y \"%.1e\"\n";
  plot("lr.png", "learning rate", "learning rate", items);
  g << "set format y \"% h\"\n";
  from_zero([](const StepRow& s) { return s.tokens_per_s; });

  items.clear();
  if (any([](const StepRow& s) { return s.tokens_per_s; }))
    items.push_back("$steps using 1:4 with linespoints lw 2 pt 7 ps 0.5 lc rgb \"#1f77b4\" title \"tokens/s\"");
  plot("tokens_per_s.png", "throughput", "target tokens per second", items);

  // Memory per device (allocated solid, peak dotted, the limit black), micro-batch on y2.
  items.clear();
  const char* palette[] = {"#1f77b4", "#9467bd", "#17becf", "#bcbd22"};
  for (size_t i = 0; i < devs.size(); ++i) {
    const size_t col = 6 + 3 * i;
    const std::string c = gp_quote(palette[i % 4]), d = devs[i];
    auto field = [&](double DeviceMemory::*f) {
      return [&, f](const StepRow& s) {
        auto it = s.memory.find(d);
        return it == s.memory.end() ? NAN : it->second.*f;
      };
    };
    if (any(field(&DeviceMemory::allocated)))
      items.push_back(fmt::format("$steps using 1:{} with lines lw 2 lc rgb {} title {}", col, c, gp_quote(d + " allocated")));
    if (any(field(&DeviceMemory::peak)))
      items.push_back(fmt::format("$steps using 1:{} with lines lw 2 dt 3 lc rgb {} title {}", col + 1, c, gp_quote(d + " peak")));
    if (scale.draw_limit && any([&](const StepRow& s) {
          auto it = s.memory.find(d);
          return it == s.memory.end() || it->second.limit <= 0 ? NAN : it->second.limit;
        }))
      items.push_back(fmt::format("$steps using 1:{} with lines lw 2 lc rgb \"#000000\" title {}", col + 2, gp_quote(d + " limit")));
  }
  if (any([](const StepRow& s) { return s.micro_batch > 0 ? static_cast<double>(s.micro_batch) : NAN; })) {
    int64_t most = 0;
    for (const auto& st : m.steps) most = std::max(most, st.micro_batch);
    g << "set y2range [0:" << num(1.25 * static_cast<double>(most)) << "]\nset y2label \"micro-batch\"\nset y2tics\nset ytics nomirror\n";
    items.push_back("$steps using 1:5 axes x1y2 with steps lw 1 lc rgb \"#999999\" title \"micro-batch\"");
  }
  // Room above the limit line, which would hide in the frame.
  if (scale.top > 0) g << "set yrange [0:" << num(1.1 * scale.top / scale.unit) << "]\n";
  const std::string title = scale.limit > 0 && !scale.draw_limit
                                ? "memory (limit " + format_bytes(static_cast<int64_t>(scale.limit)) + ", off the scale)"
                                : std::string("memory");
  plot("memory.png", title.c_str(), std::string("memory (") + scale.unit_name + ")", items);
  return g.str();
}

// Runs `gnuplot script`, output captured; throws UserError when it is missing or fails.
void run_gnuplot(const std::string& gnuplot, const fs::path& script) {
  int pipe_fd[2];
  if (pipe(pipe_fd) != 0) fail("gnuplot: cannot create a pipe: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addclose(&actions, pipe_fd[0]);
  posix_spawn_file_actions_adddup2(&actions, pipe_fd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fd[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipe_fd[1]);
  std::string arg0 = gnuplot, arg1 = script.string();
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, gnuplot.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fd[1]);
  if (rc != 0) {
    close(pipe_fd[0]);
    fail("gnuplot: cannot run '", gnuplot, "' (", std::strerror(rc),
         "); memtune report draws its plots with gnuplot: install it (Debian: apt-get install gnuplot-nox, as "
         "scripts/setup.sh does)");
  }
  std::string output;
  char buf[4096];
  for (ssize_t n; (n = read(pipe_fd[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    output.append(buf, static_cast<size_t>(n));
  }
  close(pipe_fd[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (output.size() > 2000) output = "..." + output.substr(output.size() - 2000);
  MEMTUNE_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "gnuplot (", gnuplot, " ", script.string(), ") ",
                WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                  : "was killed by signal " + std::to_string(WTERMSIG(status)),
                ":\n", output, "\nhint: a gnuplot with the pngcairo terminal is needed (Debian: gnuplot-nox)");
}

// ---- report.html -----------------------------------------------------------------------

std::string base64(const std::string& bytes) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  if (i + 1 == bytes.size()) {
    const uint32_t v = uint8_t(bytes[i]) << 16;
    out += {t[v >> 18], t[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == bytes.size()) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], '='};
  }
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string percent(double share) { return fmt::format("{:.1f}%", 100.0 * share); }

// The summary: (what, value) rows.
std::vector<std::pair<std::string, std::string>> summary(const RunMetrics& m) {
  std::vector<std::pair<std::string, std::string>> rows;
  const StepRow& first = m.steps.front();
  const StepRow& last = m.steps.back();
  rows.push_back({"steps", fmt::format("{} ({} rows logged)", last.step, m.steps.size())});
  if (std::isfinite(last.epoch)) rows.push_back({"epoch at the last step", fmt::format("{:g}", last.epoch)});
  rows.push_back({"final loss", fmt::format("{:.4f}", last.loss)});
  rows.push_back({"first loss", fmt::format("{:.4f} (step {})", first.loss, first.step)});
  auto lowest = std::min_element(m.steps.begin(), m.steps.end(), [](const auto& a, const auto& b) { return a.loss < b.loss; });
  rows.push_back({"lowest loss", fmt::format("{:.4f} (step {})", lowest->loss, lowest->step)});
  if (!m.evals.empty()) {
    auto best = std::min_element(m.evals.begin(), m.evals.end(), [](const auto& a, const auto& b) { return a.loss < b.loss; });
    rows.push_back({"best eval loss", fmt::format("{:.4f} (step {}, perplexity {:.2f})", best->loss, best->step, best->perplexity)});
    const EvalRow& e = m.evals.back();
    rows.push_back({"final eval loss", fmt::format("{:.4f} (step {}, perplexity {:.2f}, {} tokens)", e.loss, e.step,
                                                   e.perplexity, e.tokens)});
  }
  if (!m.accuracy.empty()) {
    const AccuracyRow& after = m.accuracy.back();
    if (m.accuracy.front().step == 0 && m.accuracy.size() > 1)
      rows.push_back({"accuracy before training", fmt::format("{} ({} rows)", percent(m.accuracy.front().accuracy),
                                                              m.accuracy.front().rows)});
    rows.push_back({after.step == 0 ? "accuracy before training" : "accuracy after training",
                    fmt::format("{} ({} rows, step {})", percent(after.accuracy), after.rows, after.step)});
  }
  for (const auto& d : devices(m)) {
    double peak = 0, limit = 0;
    for (const auto& s : m.steps) {
      auto it = s.memory.find(d);
      if (it == s.memory.end()) continue;
      if (std::isfinite(it->second.peak)) peak = std::max(peak, it->second.peak);
      limit = std::max(limit, it->second.limit);
    }
    rows.push_back({"peak memory (" + d + ")",
                    format_bytes(static_cast<int64_t>(peak)) +
                        (limit > 0 ? fmt::format(" of a {} limit ({})", format_bytes(static_cast<int64_t>(limit)),
                                                 percent(peak / limit))
                                   : std::string(" (no limit)"))});
  }
  std::vector<double> tps;
  for (const auto& s : m.steps)
    if (std::isfinite(s.tokens_per_s)) tps.push_back(s.tokens_per_s);
  if (!tps.empty()) {
    std::sort(tps.begin(), tps.end());
    rows.push_back({"tokens/s (median of logged steps)", fmt::format("{:.0f}", tps[tps.size() / 2])});
  }
  if (first.micro_batch > 0) {
    // The last whole step: an epoch's last one may be shorter (fewer micro-batches).
    int64_t most = 0;
    for (const auto& s : m.steps) most = std::max(most, s.samples);
    const StepRow* whole = &last;
    for (auto it = m.steps.rbegin(); it != m.steps.rend(); ++it)
      if (it->samples == most) {
        whole = &*it;
        break;
      }
    rows.push_back({"micro-batch x accumulation",
                    fmt::format("{} x {} at the first logged step, {} x {} at the last{}", first.micro_batch,
                                first.accumulation, whole->micro_batch, whole->accumulation,
                                whole == &last ? "" : " whole one")});
  }
  std::map<std::string, int> counts;
  for (const auto& e : m.events) ++counts[e.kind];
  std::string ev;
  for (const auto& [k, n] : counts) ev += (ev.empty() ? "" : ", ") + fmt::format("{} {}", n, k);
  rows.push_back({"events", ev.empty() ? "none" : ev});
  if (m.superseded > 0)
    rows.push_back({"resumed", fmt::format("{} rows of a stopped run replaced by the resumed run's", m.superseded)});
  return rows;
}

// The compared runs' table: final figures, and the relative difference of the tail mean
// against this run's (negative: lower loss than this run).
void compared_table(std::ostringstream& h, const std::string& label, const RunMetrics& m,
                    const std::vector<Compared>& others) {
  const double mine = tail_mean(m, kTailSteps);
  h << "<h2>Compared runs</h2>\n<table>\n<tr><th>run</th><th>steps</th><th>final loss</th><th>mean loss of the last "
    << kTailSteps << " logged steps</th><th>vs " << html_escape(label)
    << "</th><th>final eval loss</th><th>accuracy after training</th></tr>\n";
  auto row = [&](const std::string& name, const RunMetrics& r) {
    const double tail = tail_mean(r, kTailSteps);
    h << "<tr><td>" << html_escape(name) << "</td><td>" << r.steps.back().step << "</td><td>"
      << fmt::format("{:.4f}", r.steps.back().loss) << "</td><td>" << fmt::format("{:.4f}", tail) << "</td><td>"
      << (&r == &m ? std::string("-") : fmt::format("{:+.1f}%", 100.0 * (tail - mine) / mine)) << "</td><td>"
      << (r.evals.empty() ? std::string("-") : fmt::format("{:.4f}", r.evals.back().loss)) << "</td><td>"
      << (r.accuracy.empty() || r.accuracy.back().step == 0 ? std::string("-") : percent(r.accuracy.back().accuracy))
      << "</td></tr>\n";
  };
  row(label, m);
  for (const auto& c : others) row(c.label, c.m);
  h << "</table>\n";
}

std::string html(const fs::path& run_dir, const RunMetrics& m, const std::vector<Compared>& others,
                 const std::vector<fs::path>& plots) {
  std::ostringstream h;
  const std::string name = html_escape(fs::absolute(run_dir).lexically_normal().string());
  h << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>memtune report: " << name
    << "</title>\n<style>\n"
       "body{font-family:sans-serif;margin:2em auto;max-width:1000px;color:#222;padding:0 1em}\n"
       "h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}\n"
       "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
       "text-align:left;vertical-align:top}th{background:#f3f3f3}\n"
       "img{max-width:100%;border:1px solid #eee;margin:.4em 0}\n"
       "pre{background:#f7f7f7;padding:.8em;overflow-x:auto;font-size:.85em}\n"
       ".oom,.emergency{color:#d62728;font-weight:bold}.shrink{color:#ff7f0e}.grow{color:#2ca02c}\n"
       "</style></head><body>\n<h1>memtune report</h1>\n<p>Run: <code>"
    << name << "</code></p>\n<h2>Summary</h2>\n<table>\n";
  for (const auto& [k, v] : summary(m)) h << "<tr><th>" << html_escape(k) << "</th><td>" << html_escape(v) << "</td></tr>\n";
  h << "</table>\n";
  if (!others.empty()) compared_table(h, run_label(run_dir), m, others);
  h << "<h2>Plots</h2>\n";
  for (const auto& p : plots)
    h << "<p><img alt=\"" << html_escape(p.stem().string()) << "\" src=\"data:image/png;base64,"
      << base64(read_text(p)) << "\"></p>\n";
  h << "<h2>Events</h2>\n";
  if (m.events.empty()) {
    h << "<p>None.</p>\n";
  } else {
    h << "<table>\n<tr><th>step</th><th>kind</th><th>detail</th></tr>\n";
    for (const auto& e : m.events)
      h << "<tr><td>" << e.step << "</td><td class=\"" << html_escape(e.kind) << "\">" << html_escape(e.kind)
        << "</td><td>" << html_escape(e.detail) << "</td></tr>\n";
    h << "</table>\n";
  }
  auto file_section = [&](const char* title, const char* file) {
    h << "<h2>" << title << " (" << file << ")</h2>\n";
    const fs::path p = run_dir / file;
    if (fs::exists(p))
      h << "<pre>" << html_escape(read_text(p)) << "</pre>\n";
    else
      h << "<p>Not in the run directory.</p>\n";
  };
  file_section("Effective config", "config.yaml");
  file_section("Memory report", "memory_report.txt");
  h << "</body></html>\n";
  return h.str();
}

// A run directory's metrics.jsonl, read; `who` names the command (and flag) in the error.
RunMetrics read_run(const fs::path& dir, const std::string& who) {
  const fs::path file = dir / "metrics.jsonl";
  MEMTUNE_CHECK(fs::is_regular_file(file), who, ": ", file.string(), " not found; is '", dir.string(),
                "' the output_dir of a `memtune train` run?");
  return read_metrics(file);
}

}  // namespace

ReportFiles write_report(const fs::path& run_dir, const ReportOptions& o) {
  MEMTUNE_CHECK(fs::is_directory(run_dir), "memtune report: run directory '", run_dir.string(),
                "' does not exist (or is not a directory); give the training.output_dir of a run");
  const RunMetrics m = read_run(run_dir, "memtune report");
  std::vector<Compared> others;
  for (const fs::path& dir : o.compare) others.push_back({run_label(dir), read_run(dir, "memtune report --compare")});
  MEMTUNE_CHECK(o.width >= 200 && o.height >= 150, "memtune report: plot size ", o.width, "x", o.height,
                " is too small (at least 200x150)");

  const fs::path out = o.out_dir.empty() ? run_dir : o.out_dir;
  std::error_code ec;
  fs::create_directories(out, ec);
  MEMTUNE_CHECK(!ec, "memtune report: cannot create '", out.string(), "': ", ec.message());

  ReportFiles files;
  for (const char* n : {"loss.png", "lr.png", "tokens_per_s.png", "memory.png"}) {
    files.plots.push_back(out / n);
    fs::remove(out / n, ec);  // a stale plot must not pass for a new one
  }
  files.script = out / "plots.gnuplot";
  write_file_atomic(files.script, gnuplot_script(m, others, run_label(run_dir), out, o));
  run_gnuplot(o.gnuplot, files.script);
  for (const auto& p : files.plots)
    MEMTUNE_CHECK(fs::is_regular_file(p) && fs::file_size(p) > 0, "gnuplot ran but did not write ", p.string(),
                  "; see ", files.script.string());
  files.html = out / "report.html";
  write_file_atomic(files.html, html(run_dir, m, others, files.plots));
  return files;
}

}  // namespace memtune::trainer
