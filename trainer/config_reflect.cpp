#include "trainer/config_reflect.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace memtune::trainer::reflect {

// ---- Text ----

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

std::string nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool parse_bool(const std::string& s, bool& out) {
  std::string l = lower(s);
  if (l == "true" || l == "yes" || l == "on") return out = true, true;
  if (l == "false" || l == "no" || l == "off") return out = false, true;
  return false;
}

bool parse_int64(const std::string& s, int64_t& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  out = v;
  return true;
}

bool parse_double(const std::string& s, double& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
  out = v;
  return true;
}

std::string format_double(double v) {
  char buf[40];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {  // whole numbers without an exponent
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// ---- Where a value came from ----

std::string Ctx::at(const YAML::Mark& mark) const {
  if (!override_text.empty()) return "override '" + override_text + "'";
  if (mark.is_null()) return source;
  return str_cat(source, ":", mark.line + 1, ":", mark.column + 1);
}

YAML::Mark mark_of(const YAML::Node& value, const YAML::Node& key) {
  YAML::Mark m = value.Mark();
  return (m.is_null() || value.IsNull()) ? key.Mark() : m;
}

std::string text_of(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return n.Scalar();
  YAML::Emitter e;
  e.SetMapFormat(YAML::Flow);
  e.SetSeqFormat(YAML::Flow);
  e << n;
  return e.c_str();
}

namespace {
std::string display(const std::string& path) { return path.empty() ? "config" : path; }
}  // namespace

void unknown_key(const std::string& at, const std::string& path, const std::vector<std::string>& known) {
  std::string name = path.substr(path.rfind('.') == std::string::npos ? 0 : path.rfind('.') + 1);
  fail(at, ": ", path, ": unknown key (did you mean ", nearest(name, known), "?)");
}

void wrong_type(const Ctx& ctx, const Item& it, const std::string& expected) {
  fail(ctx.at(it.mark), ": ", display(it.path), ": expected ", expected, ", got '", text_of(it.node), "'");
}

void check_keys(const Item& it, const std::vector<std::string>& known, const Ctx& ctx) {
  std::map<std::string, YAML::Mark> first;
  for (const auto& kv : it.node) {
    const YAML::Node& key = kv.first;
    if (!key.IsScalar())
      fail(ctx.at(key.Mark()), ": ", display(it.path), ": keys must be names, got '", text_of(key), "'");
    const std::string path = join(it.path, key.Scalar());
    if (std::find(known.begin(), known.end(), key.Scalar()) == known.end())
      unknown_key(ctx.at(key.Mark()), path, known);
    auto [pos, fresh] = first.emplace(key.Scalar(), key.Mark());
    MEMTUNE_CHECK(fresh, ctx.at(key.Mark()), ": ", path, ": duplicate key (first at line ",
                  pos->second.line + 1, ")");
  }
}

const std::string& scalar(const Item& it, const Ctx& ctx, const std::string& expected) {
  if (!it.node.IsScalar()) wrong_type(ctx, it, expected);
  return it.node.Scalar();
}

// ---- Type names ----

std::string type_name(const bool&, const Field&) { return "bool"; }
std::string type_name(const int&, const Field& f) { return f.or_auto ? "integer|auto" : "integer"; }
std::string type_name(const int64_t&, const Field&) { return "integer"; }
std::string type_name(const uint64_t&, const Field&) { return "non-negative integer"; }
std::string type_name(const double&, const Field&) { return "number"; }
std::string type_name(const std::string&, const Field& f) {
  if (f.type) return f.type;
  if (f.choices.empty()) return "string";
  std::string out;
  for (const auto& c : f.choices) out += (out.empty() ? "" : "|") + c;
  return out;
}
std::string type_name(const std::vector<std::string>&, const Field&) { return "string or list of strings"; }
std::string type_name(const std::vector<int>&, const Field&) { return "list of integers"; }

// ---- Reading ----

void read_value(const Item& it, bool& v, Ctx& ctx, const Field& f) {
  if (!parse_bool(scalar(it, ctx, type_name(v, f)), v)) wrong_type(ctx, it, type_name(v, f));
}

void read_value(const Item& it, int& v, Ctx& ctx, const Field& f) {
  const std::string& s = scalar(it, ctx, type_name(v, f));
  if (f.or_auto && lower(s) == "auto") {
    v = kAuto;
    return;
  }
  int64_t x = 0;
  if (!parse_int64(s, x) || x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    wrong_type(ctx, it, type_name(v, f));
  v = static_cast<int>(x);
}

void read_value(const Item& it, int64_t& v, Ctx& ctx, const Field& f) {
  if (!parse_int64(scalar(it, ctx, type_name(v, f)), v)) wrong_type(ctx, it, type_name(v, f));
}

void read_value(const Item& it, uint64_t& v, Ctx& ctx, const Field& f) {
  const std::string& s = scalar(it, ctx, type_name(v, f));
  errno = 0;
  char* end = nullptr;
  unsigned long long x = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0])) || errno != 0 || *end != '\0')
    wrong_type(ctx, it, type_name(v, f));
  v = x;
}

void read_value(const Item& it, double& v, Ctx& ctx, const Field& f) {
  if (!parse_double(scalar(it, ctx, type_name(v, f)), v)) wrong_type(ctx, it, type_name(v, f));
}

void read_value(const Item& it, std::string& v, Ctx& ctx, const Field& f) {
  if (it.node.IsNull()) {
    v.clear();
    return;
  }
  v = scalar(it, ctx, type_name(v, f));
  if (f.normalize) v = f.normalize(v, it.node.Tag() == "!");  // quoted scalars are tagged "!"
}

void read_value(const Item& it, std::vector<std::string>& v, Ctx& ctx, const Field& f) {
  v.clear();
  if (it.node.IsNull()) return;
  if (it.node.IsScalar()) {
    v.push_back(it.node.Scalar());
    return;
  }
  if (!it.node.IsSequence()) wrong_type(ctx, it, type_name(v, f));
  for (size_t i = 0; i < it.node.size(); ++i) {
    const YAML::Node& e = it.node[i];
    Item item{e, str_cat(it.path, "[", i, "]"), e.Mark()};
    if (!e.IsScalar()) wrong_type(ctx, item, "string");
    v.push_back(e.Scalar());
  }
}

void read_value(const Item& it, std::vector<int>& v, Ctx& ctx, const Field& f) {
  v.clear();
  if (it.node.IsNull()) return;
  if (it.node.IsScalar()) {
    v.emplace_back();
    read_value(it, v.back(), ctx, Field{});
    return;
  }
  if (!it.node.IsSequence()) wrong_type(ctx, it, type_name(v, f));
  for (size_t i = 0; i < it.node.size(); ++i) {
    const YAML::Node& e = it.node[i];
    v.emplace_back();
    read_value(Item{e, str_cat(it.path, "[", i, "]"), e.Mark()}, v.back(), ctx, Field{});
  }
}

// ---- Writing ----

void write(YAML::Emitter& e, const bool& v, const Field&) { e << v; }
void write(YAML::Emitter& e, const int& v, const Field& f) {
  if (f.or_auto && v == kAuto)
    e << "auto";
  else
    e << v;
}
void write(YAML::Emitter& e, const int64_t& v, const Field&) { e << v; }
void write(YAML::Emitter& e, const uint64_t& v, const Field&) { e << v; }
void write(YAML::Emitter& e, const double& v, const Field&) { e << format_double(v); }
void write(YAML::Emitter& e, const std::string& v, const Field&) { e << v; }

// ---- Checking ----

void Checker::one_of(const std::string& path, const std::string& value, const std::vector<std::string>& choices,
                     const std::string& note) const {
  if (std::find(choices.begin(), choices.end(), value) != choices.end()) return;
  std::string reason = note.empty() ? "expected one of " : note + "; expected one of ";
  for (size_t i = 0; i < choices.size(); ++i) reason += (i ? "|" : "") + choices[i];
  const std::string guess = nearest(value, choices);
  if (edit_distance(value, guess) <= std::max<size_t>(2, value.size() / 3)) reason += " (did you mean " + guess + "?)";
  check(false, path, value, reason);
}

std::string Checker::at(std::string path) const {
  while (seen_ && !path.empty()) {
    auto it = seen_->find(path);
    if (it != seen_->end()) return it->second.at;
    size_t cut = path.find_last_of(".[");
    path = cut == std::string::npos ? "" : path.substr(0, cut);
  }
  return source_;
}

}  // namespace memtune::trainer::reflect
