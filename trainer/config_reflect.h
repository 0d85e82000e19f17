#pragma once
// The YAML reflection engine behind memtune's config: plain structs that declare their keys
// once, in a `fields(f)` visitor, as `f("name", member, "help", Field{...})`, are read from
// YAML (positions, nearest-key hints, duplicate keys), overridden by `key.path=value`,
// written back, compared, checked for allowed values and described for --help-config, all
// from that one declaration (as llama.cpp's common_arg declares an option once).
//
// The engine knows YAML and C++ scalars, strings, lists and nested structs. A struct's own
// value types (sizes, device maps) bring their overloads of read_value / write / type_name /
// same in this namespace (found by argument-dependent lookup through Item, Field and the
// emitter's arguments); trainer/config.cpp does so for memtune's schema. Included by the
// schema's .cpp only: it pulls in yaml-cpp.
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/error.h"

namespace memtune::trainer::reflect {

// How a key's value is read beyond its C++ type; the default is the type's plain syntax.
struct Field {
  std::vector<std::string> choices;  // a string key's allowed values, declared here only
  std::string choice_note;           // said before the list when a value is not one of them
  const char* type = nullptr;        // the type as help and errors name it, when not the C++ type's name
  // A string's spellings mapped to the canonical one (torch.float16 -> float16); `quoted`
  // is true for a quoted YAML scalar.
  std::string (*normalize)(const std::string& text, bool quoted) = nullptr;
  bool or_auto = false;  // an integer key that also takes `auto` (stored as kAuto)

  Field() = default;
  Field(std::initializer_list<const char*> allowed) : choices(allowed.begin(), allowed.end()) {}
  // Choices with what to say before listing them ("only nf4 is supported; expected one of nf4").
  static Field one_of(std::initializer_list<const char*> allowed, std::string note) {
    Field f(allowed);
    f.choice_note = std::move(note);
    return f;
  }
  static Field integer_or_auto() {
    Field f;
    f.or_auto = true;
    return f;
  }
};

constexpr int kAuto = -1;  // an integer_or_auto key set to `auto`

// ---- Text ----

size_t edit_distance(const std::string& a, const std::string& b);  // with adjacent transpositions
std::string nearest(const std::string& word, const std::vector<std::string>& candidates);
std::string lower(std::string s);
bool parse_bool(const std::string& s, bool& out);      // true|yes|on|false|no|off, any case
bool parse_int64(const std::string& s, int64_t& out);  // the whole text, no leading space
bool parse_double(const std::string& s, double& out);  // finite only
std::string format_double(double v);                   // the shortest text that reads back as v
std::string join(const std::string& prefix, const std::string& name);

// ---- Where a value came from ----

struct Seen {
  std::string at;    // "file:line:col" or "override 'k=v'"
  std::string text;  // the value as written
};

struct Ctx {
  std::string source;
  std::string override_text;         // set while one override is applied
  std::map<std::string, Seen> seen;  // key path -> where it was last set

  std::string at(const YAML::Mark& mark) const;
};

// A value being read: its node, key path and the best position for it.
struct Item {
  const YAML::Node& node;
  std::string path;
  YAML::Mark mark;
};

YAML::Mark mark_of(const YAML::Node& value, const YAML::Node& key);
std::string text_of(const YAML::Node& n);
[[noreturn]] void unknown_key(const std::string& at, const std::string& path, const std::vector<std::string>& known);
[[noreturn]] void wrong_type(const Ctx& ctx, const Item& it, const std::string& expected);
void check_keys(const Item& it, const std::vector<std::string>& known, const Ctx& ctx);  // unknown, repeated
const std::string& scalar(const Item& it, const Ctx& ctx, const std::string& expected);

// ---- Structs that declare fields ----

struct NoopVisitor {
  template <class... A>
  void operator()(A&&...) {}
};
template <class T, class = void>
struct HasFields : std::false_type {};
template <class T>
struct HasFields<T, std::void_t<decltype(std::declval<T&>().fields(std::declval<NoopVisitor&>()))>>
    : std::true_type {};

// fields() is not const; the visitors given here only read.
template <class S, class F>
void visit(const S& s, F&& f) {
  const_cast<S&>(s).fields(f);
}

template <class S>
std::vector<std::string> names_of() {
  std::vector<std::string> names;
  S probe;
  probe.fields([&](const char* name, auto&, const char*, const Field& = {}) { names.push_back(name); });
  return names;
}

// ---- Type names, for errors and help ----

std::string type_name(const bool&, const Field& f);
std::string type_name(const int&, const Field& f);
std::string type_name(const int64_t&, const Field& f);
std::string type_name(const uint64_t&, const Field& f);
std::string type_name(const double&, const Field& f);
std::string type_name(const std::string&, const Field& f);  // the choices, when declared
std::string type_name(const std::vector<std::string>&, const Field& f);
std::string type_name(const std::vector<int>&, const Field& f);

// ---- Reading ----

void read_value(const Item& it, bool& v, Ctx& ctx, const Field& f);
void read_value(const Item& it, int& v, Ctx& ctx, const Field& f);
void read_value(const Item& it, int64_t& v, Ctx& ctx, const Field& f);
void read_value(const Item& it, uint64_t& v, Ctx& ctx, const Field& f);
void read_value(const Item& it, double& v, Ctx& ctx, const Field& f);
void read_value(const Item& it, std::string& v, Ctx& ctx, const Field& f);  // null: empty
void read_value(const Item& it, std::vector<std::string>& v, Ctx& ctx, const Field& f);
void read_value(const Item& it, std::vector<int>& v, Ctx& ctx, const Field& f);

template <class T>
void read(const Item& it, T& v, Ctx& ctx, const Field& f);

template <class S>
void read_struct(const Item& it, S& s, Ctx& ctx) {
  if (it.node.IsNull()) return;  // a section with nothing under it
  if (!it.node.IsMap()) wrong_type(ctx, it, "a mapping");
  check_keys(it, names_of<S>(), ctx);
  s.fields([&](const char* name, auto& member, const char*, const Field& f = {}) {
    for (const auto& kv : it.node)
      if (kv.first.Scalar() == name) return read(Item{kv.second, join(it.path, name), mark_of(kv.second, kv.first)}, member, ctx, f);
  });
}

template <class T>
void read(const Item& it, T& v, Ctx& ctx, const Field& f) {
  ctx.seen[it.path] = {ctx.at(it.mark), text_of(it.node)};
  if constexpr (HasFields<T>::value)
    read_struct(it, v, ctx);
  else
    read_value(it, v, ctx, f);
}

// ---- Overrides: key.path=value ----

template <class T>
struct IsStringMap : std::false_type {};
template <class V>
struct IsStringMap<std::map<std::string, V>> : std::true_type {};
template <class V>
struct IsStringMap<std::vector<std::pair<std::string, V>>> : std::true_type {};  // keys in order

template <class V>
void set_entry(std::map<std::string, V>& m, const std::string& key, V value) {
  m[key] = std::move(value);
}
// An ordered map's entry keeps its place; a new key goes last.
template <class V>
void set_entry(std::vector<std::pair<std::string, V>>& m, const std::string& key, V value) {
  for (auto& [k, v] : m)
    if (k == key) {
      v = std::move(value);
      return;
    }
  m.emplace_back(key, std::move(value));
}

template <class S>
void seek(S& s, const std::vector<std::string>& segments, size_t i, const std::string& prefix,
          const YAML::Node& value, Ctx& ctx) {
  const YAML::Mark none = YAML::Mark::null_mark();
  bool found = false;
  s.fields([&](const char* name, auto& member, const char*, const Field& f = {}) {
    using T = std::decay_t<decltype(member)>;
    if (found || segments[i] != name) return;
    found = true;
    const std::string path = join(prefix, name);
    if (i + 1 == segments.size()) return read(Item{value, path, none}, member, ctx, f);
    if constexpr (HasFields<T>::value) {
      seek(member, segments, i + 1, path, value, ctx);
    } else if constexpr (IsStringMap<T>::value) {
      // One entry of a map-valued key (model.max_memory.cuda:0=20GiB, lora.rank_pattern.q_proj=16):
      // the rest of the path, dots included, is the entry's key; the map's own reader checks
      // and normalises it.
      std::string key = segments[i + 1];
      for (size_t k = i + 2; k < segments.size(); ++k) key += "." + segments[k];
      YAML::Node one(YAML::NodeType::Map);
      one[key] = value;
      T parsed;
      read(Item{one, path, none}, parsed, ctx, f);
      for (auto& [k, v] : parsed) set_entry(member, k, std::move(v));
    } else {
      fail(ctx.at(none), ": ", join(path, segments[i + 1]), ": unknown key (", path, " is a ", type_name(member, f),
           ", not a section)");
    }
  });
  if (!found) unknown_key(ctx.at(none), join(prefix, segments[i]), names_of<S>());
}

// Splits "a.b.c=value" and reads the value into the key it names.
template <class S>
void apply_override(S& config, const std::string& text, Ctx& ctx) {
  const std::string how = " (write key=value, e.g. training.learning_rate=1e-4)";
  const size_t eq = text.find('=');
  MEMTUNE_CHECK(eq != std::string::npos && eq > 0, "override '", text, "': expected key=value", how);
  std::string key = text.substr(0, eq);
  while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
  YAML::Node value;
  try {
    value = YAML::Load(text.substr(eq + 1));
  } catch (const YAML::Exception& e) {
    fail("override '", text, "': ", key, ": cannot read the value as YAML (", e.msg, ")");
  }
  std::vector<std::string> segments;
  std::stringstream ss(key);
  for (std::string s; std::getline(ss, s, '.');) segments.push_back(s);
  if (segments.empty() || key.back() == '.') segments.emplace_back();
  ctx.override_text = text;
  seek(config, segments, 0, "", value, ctx);
  ctx.override_text.clear();
}

// ---- Writing ----

void write(YAML::Emitter& e, const bool& v, const Field& f);
void write(YAML::Emitter& e, const int& v, const Field& f);  // kAuto as auto where allowed
void write(YAML::Emitter& e, const int64_t& v, const Field& f);
void write(YAML::Emitter& e, const uint64_t& v, const Field& f);
void write(YAML::Emitter& e, const double& v, const Field& f);
void write(YAML::Emitter& e, const std::string& v, const Field& f);
template <class T>
void write(YAML::Emitter& e, const std::vector<T>& v, const Field&) {
  e << YAML::Flow << YAML::BeginSeq;
  for (const auto& x : v) e << x;
  e << YAML::EndSeq;
}
template <class S, std::enable_if_t<HasFields<S>::value, int> = 0>
void write(YAML::Emitter& e, const S& s, const Field&) {
  e << YAML::BeginMap;
  visit(s, [&](const char* name, const auto& member, const char*, const Field& f = {}) {
    e << YAML::Key << name << YAML::Value;
    write(e, member, f);
  });
  e << YAML::EndMap;
}

// One value on one line, as YAML flow.
template <class T>
std::string render(const T& v, const Field& f) {
  YAML::Emitter e;
  e.SetNullFormat(YAML::LowerNull);
  e.SetMapFormat(YAML::Flow);
  e.SetSeqFormat(YAML::Flow);
  write(e, v, f);
  return e.c_str();
}

// ---- Equality: every leaf compared, in visiting order ----

// A value type's own overload (found through Field) replaces this one where == is missing.
template <class T>
bool same(const T& a, const T& b, const Field&) {
  return a == b;
}

struct LeafAddresses {
  std::vector<const void*>& out;
  template <class T>
  void operator()(const char*, T& member, const char*, const Field& = {}) {
    if constexpr (HasFields<T>::value)
      member.fields(*this);
    else
      out.push_back(&member);
  }
};

struct LeafCompare {
  const std::vector<const void*>& other;
  size_t next = 0;
  bool equal = true;
  template <class T>
  void operator()(const char*, T& member, const char*, const Field& f = {}) {
    if constexpr (HasFields<T>::value)
      member.fields(*this);
    else
      equal = same(member, *static_cast<const T*>(other[next++]), f) && equal;
  }
};

template <class S>
bool equal_fields(const S& a, const S& b) {
  std::vector<const void*> leaves;
  visit(b, LeafAddresses{leaves});
  LeafCompare compare{leaves};
  visit(a, compare);
  return compare.equal;
}

// The dotted name of the first leaf (in visiting order) where a and b differ; "" where equal.
struct LeafDifference {
  const std::vector<const void*>& other;
  std::string prefix;
  size_t next = 0;
  std::string found;
  template <class T>
  void operator()(const char* name, T& member, const char*, const Field& f = {}) {
    if constexpr (HasFields<T>::value) {
      LeafDifference inner{other, prefix + name + ".", next, ""};
      member.fields(inner);
      next = inner.next;
      if (found.empty()) found = inner.found;
    } else {
      const bool equal = same(member, *static_cast<const T*>(other[next++]), f);
      if (!equal && found.empty()) found = prefix + name;
    }
  }
};

template <class S>
std::string first_difference(const S& a, const S& b) {
  std::vector<const void*> leaves;
  visit(b, LeafAddresses{leaves});
  LeafDifference diff{leaves, "", 0, ""};
  visit(a, diff);
  return diff.found;
}

// ---- Checking: the schema's validate() functions call check(); choices are checked here ----

class Checker {
 public:
  // `seen` (may be null) gives each key's position and text as written.
  Checker(std::string source, const std::map<std::string, Seen>* seen)
      : source_(source.empty() ? "config" : std::move(source)), seen_(seen) {}

  // Refuses `value` at `path` unless `ok`: "where: path: invalid value 'v': reason".
  template <class T>
  void check(bool ok, const std::string& path, const T& value, const std::string& reason,
             const Field& f = {}) const {
    if (ok) return;
    std::string text = render(value, f);
    if (seen_ && seen_->count(path)) text = seen_->at(path).text;
    fail(at(path), ": ", path, ": invalid value '", text, "': ", reason);
  }
  // A literal as the value is text (a char array would otherwise be written as a bool).
  void check(bool ok, const std::string& path, const char* value, const std::string& reason, const Field& f = {}) const {
    check(ok, path, std::string(value), reason, f);
  }

  // `value` must be one of `choices`; the message lists them and the nearest one.
  void one_of(const std::string& path, const std::string& value, const std::vector<std::string>& choices,
              const std::string& note = "") const;

 private:
  std::string at(std::string path) const;  // where a key was set, or its nearest enclosing key

  std::string source_;
  const std::map<std::string, Seen>* seen_;
};

// Every string key with declared choices holds one of them.
template <class S>
void check_choices(const S& s, const std::string& prefix, const Checker& c) {
  visit(s, [&](const char* name, const auto& member, const char*, const Field& f = {}) {
    using T = std::decay_t<decltype(member)>;
    const std::string path = join(prefix, name);
    if constexpr (HasFields<T>::value)
      check_choices(member, path, c);
    else if constexpr (std::is_same_v<T, std::string>) {
      if (!f.choices.empty()) c.one_of(path, member, f.choices, f.choice_note);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      if (!f.choices.empty())
        for (const std::string& v : member) c.one_of(path, v, f.choices, f.choice_note);
    }
  });
}

// ---- Help: every key with its type, default and help, sections first ----

template <class S>
void help_of(const S& defaults, const std::string& prefix, std::ostringstream& out) {
  visit(defaults, [&](const char* name, const auto& member, const char* help, const Field& f = {}) {
    using T = std::decay_t<decltype(member)>;
    const std::string path = join(prefix, name);
    if constexpr (HasFields<T>::value) {
      if (prefix.empty())
        out << "\n" << path << ": " << help << "\n";
      else
        out << "  " << path << ".*: " << help << "\n";
      help_of(member, path, out);
    } else {
      out << "  " << path << " (" << type_name(member, f) << ", default: " << render(member, f) << ")\n"
          << "      " << help << "\n";
    }
  });
}

}  // namespace memtune::trainer::reflect
