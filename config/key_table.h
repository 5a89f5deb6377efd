// Key tables: each config key defined once (JSON name, field, range, what "auto" means), and
// the two loops that read a section from JSON and print it back from the same table. Internal
// to config/; the tables themselves are in deepspeed_keys.cc and porter_keys.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

#include "config/json_reader.h"

namespace porter::config::detail {

using OJson = nlohmann::ordered_json;

// Note [Key tables]
// Each section struct S of config.h that is read by table has one table of Key<S>, returned
// by keys_of<S>(). read_keys() walks it to read the section and write_keys() to print it, so
// a key's name, field, default and range are written once. The table order is the order in
// which to_json prints the keys (the order DeepSpeed documents them) and the order in which
// they are read: it decides which error comes first when a section has two, and the order of
// the known keys that an unknown key's did-you-mean is chosen from (ties go to the earlier).
// A key is one of:
//   - a Field: a member of S that the generic loop converts, range-checks and prints, with an
//     optional rule for "auto", a default worked out from the rest of the config, one extra
//     check on the value, and a deprecated alias;
//   - a Custom: a member with its own syntax (an enum, "nvme" as an offload device, a memory
//     budget, a list of ops), read and printed by its own two functions.
// A rule that needs several keys (the batch triple, offload against the stage, the checkpoint
// policy) stays in the section's reader, after the loop; so do deprecated keys that stand for
// a whole section (cpu_offload) and sections whose key set depends on a value (scheduler).

// What "auto" (the HF Trainer's spelling) means for a field.
enum class AutoRule {
  kRejected,        // an error that says the key does not take "auto"
  kDefault,         // the default
  kDerived,         // derive(section, config); absent still means the default
  kDerivedDefault,  // derive(section, config), for "auto" and when the key is absent
};

// Options of a Field, given after the member in a table row.
struct AutoIsDefault {};
inline constexpr AutoIsDefault kAutoIsDefault{};
template <typename S, typename V>
struct AutoIs {
  V (*derive)(const S& section, const Config& config);
};
template <typename S, typename V>
struct DefaultIs {
  V (*derive)(const S& section, const Config& config);
};
template <typename V>
struct Check {
  void (*check)(const V& value, const std::string& path);  // throws ConfigError
};
// The key's old name: accepted with a warning naming the new one; an error together with it.
struct Alias {
  std::string_view old_name;
};
// An optional field prints nothing when it is none (instead of null).
struct OmitNone {};
inline constexpr OmitNone kOmitNone{};
// The minimum of a byte count. A std::optional<uint64_t> field is always a byte count: a
// number, or a string with a unit ("2GiB").
struct Bytes {
  uint64_t min = 0;
};

template <typename T>
struct ValueOf {
  using type = T;
};
template <typename T>
struct ValueOf<std::optional<T>> {
  using type = T;
};

template <typename T>
inline constexpr bool kIsOptional = false;
template <typename T>
inline constexpr bool kIsOptional<std::optional<T>> = true;

// What a field's values are checked against, by member type: nothing for bool and strings.
template <typename T, typename V = typename ValueOf<T>::type>
using RangeOf = std::conditional_t<
    std::is_same_v<T, std::optional<uint64_t>>, Bytes,
    std::conditional_t<std::is_floating_point_v<V>, RealRange,
                       std::conditional_t<std::is_integral_v<V> && !std::is_same_v<V, bool>,
                                          IntRange, std::monostate>>>;

// One member of S read and printed by the generic loop. std::optional members are "none"
// when absent or null.
template <typename S, typename T>
struct Field {
  using Value = typename ValueOf<T>::type;
  T S::*member = nullptr;
  RangeOf<T> range{};
  AutoRule on_auto = AutoRule::kRejected;
  Value (*derive)(const S& section, const Config& config) = nullptr;
  void (*check)(const Value& value, const std::string& path) = nullptr;
};

// A key with its own syntax. read() is called when the key is present (the value may be
// null); write() returns what to print, or nullopt to print nothing.
template <typename S>
struct Custom {
  void (*read)(const Json& value, const std::string& path, S& section, Diagnostics& diag);
  std::optional<OJson> (*write)(const S& section);
};

template <typename S>
struct Key {
  using Member = std::variant<Field<S, bool>, Field<S, int>, Field<S, int64_t>,
                              Field<S, uint64_t>, Field<S, double>,
                              Field<S, std::optional<int64_t>>, Field<S, std::optional<double>>,
                              Field<S, std::optional<uint64_t>>,
                              Field<S, std::optional<std::string>>, Custom<S>>;

  std::string_view name;
  Member member;
  std::string_view alias;  // empty: none
  bool omit_none = false;

  template <typename T, typename... Options>
  constexpr Key(std::string_view key_name, T S::*field_member, Options... options)
      : name(key_name), member(make_field(field_member, options...)) {
    (apply_to_key(options), ...);
  }
  template <typename... Options>
  constexpr Key(std::string_view key_name, Custom<S> custom, Options... options)
      : name(key_name), member(custom) {
    (apply_to_key(options), ...);
  }

 private:
  template <typename T, typename... Options>
  static constexpr Field<S, T> make_field(T S::*field_member, Options... options) {
    Field<S, T> f;
    f.member = field_member;
    (apply_to_field(f, options), ...);
    return f;
  }

  template <typename F, typename O>
  static constexpr void apply_to_field(F& f, const O& option) {
    using V = typename F::Value;
    if constexpr (std::is_same_v<O, decltype(f.range)>) {
      f.range = option;
    } else if constexpr (std::is_same_v<O, AutoIsDefault>) {
      f.on_auto = AutoRule::kDefault;
    } else if constexpr (std::is_same_v<O, AutoIs<S, V>>) {
      f.on_auto = AutoRule::kDerived;
      f.derive = option.derive;
    } else if constexpr (std::is_same_v<O, DefaultIs<S, V>>) {
      f.on_auto = AutoRule::kDerivedDefault;
      f.derive = option.derive;
    } else if constexpr (std::is_same_v<O, Check<V>>) {
      f.check = option.check;
    } else {
      static_assert(std::is_same_v<O, Alias> || std::is_same_v<O, OmitNone>,
                    "option does not fit this field's type");
    }
  }

  template <typename O>
  constexpr void apply_to_key(const O& option) {
    if constexpr (std::is_same_v<O, Alias>) alias = option.old_name;
    if constexpr (std::is_same_v<O, OmitNone>) omit_none = true;
  }
};

template <typename S>
using KeyTable = std::span<const Key<S>>;

// The table of section S (defined in sections.h).
template <typename S>
KeyTable<S> keys_of();

// A Custom for an enum member, spelled as `table` names it.
template <auto kMember, const auto& kTable>
struct EnumKey {
  template <typename S, typename E>
  static S section_of(E S::*);
  using S = decltype(section_of(kMember));

  static void read(const Json& value, const std::string& path, S& section, Diagnostics&) {
    section.*kMember = as_enum(value, path, kTable);
  }
  static std::optional<OJson> write(const S& section) {
    return OJson(enum_name(kTable, section.*kMember));
  }
};
template <auto kMember, const auto& kTable>
constexpr auto enum_key() {
  using K = EnumKey<kMember, kTable>;
  return Custom<typename K::S>{&K::read, &K::write};
}

namespace key_table_impl {

template <typename V, typename Range>
V convert(const Json& value, const std::string& path, const Range& range) {
  if constexpr (std::is_same_v<V, bool>) {
    return as_bool(value, path);
  } else if constexpr (std::is_same_v<V, std::string>) {
    return as_string(value, path);
  } else if constexpr (std::is_same_v<Range, Bytes>) {
    return as_bytes(value, path, range.min);
  } else if constexpr (std::is_same_v<V, double>) {
    return as_real(value, path, range);
  } else {
    return static_cast<V>(as_integer(value, path, range));
  }
}

template <typename S, typename T>
void read_field(const Json* value, const std::string& path, const Field<S, T>& f, S& section,
                const Config& config) {
  const bool derived = f.on_auto == AutoRule::kDerived || f.on_auto == AutoRule::kDerivedDefault;
  if (value == nullptr) {
    if (f.on_auto == AutoRule::kDerivedDefault) section.*f.member = f.derive(section, config);
    return;
  }
  if constexpr (kIsOptional<T>) {
    if (value->is_null()) {
      section.*f.member = std::nullopt;
      return;
    }
  }
  if (f.on_auto != AutoRule::kRejected && is_auto(*value)) {
    if (derived) section.*f.member = f.derive(section, config);
    return;
  }
  typename Field<S, T>::Value v =
      convert<typename Field<S, T>::Value>(*value, path, f.range);
  if (f.check != nullptr) f.check(v, path);
  section.*f.member = std::move(v);
}

template <typename S, typename T>
void write_field(OJson& out, const Key<S>& key, const Field<S, T>& f, const S& section) {
  const T& v = section.*f.member;
  if constexpr (kIsOptional<T>) {
    if (v) {
      out[key.name] = *v;
    } else if (!key.omit_none) {
      out[key.name] = nullptr;
    }
  } else {
    out[key.name] = v;
  }
}

}  // namespace key_table_impl

// Reads every key of S's table from `r` into `section`, in table order. `config` is the
// config being built (porter's section is already read), for derived values.
template <typename S>
void read_keys(ObjectReader& r, S& section, const Config& config) {
  for (const Key<S>& key : keys_of<S>()) {
    std::string_view name = key.name;
    if (!key.alias.empty() &&
        r.deprecated(key.alias, key.name, "\"" + std::string(key.name) + "\"")) {
      name = key.alias;
    }
    const Json* value = r.get(name);
    std::visit(
        [&](const auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, Custom<S>>) {
            if (value != nullptr) m.read(*value, r.path_of(name), section, r.diag());
          } else {
            key_table_impl::read_field(value, r.path_of(name), m, section, config);
          }
        },
        key.member);
  }
}

// Prints every key of S's table into the object `out`, in table order.
template <typename S>
void write_keys(OJson& out, const S& section) {
  for (const Key<S>& key : keys_of<S>()) {
    std::visit(
        [&](const auto& m) {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, Custom<S>>) {
            if (std::optional<OJson> v = m.write(section)) out[key.name] = std::move(*v);
          } else {
            key_table_impl::write_field(out, key, m, section);
          }
        },
        key.member);
  }
}

template <typename S>
OJson keys_json(const S& section) {
  OJson out = OJson::object();
  write_keys(out, section);
  return out;
}

}  // namespace porter::config::detail
