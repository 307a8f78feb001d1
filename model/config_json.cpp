#include "model/config_json.hpp"

#include "core/error.hpp"

namespace loom::config_json {

json parse_object(const std::string& text, const std::string& source, const char* what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(source, ": not valid JSON: ", e.what());
  }
  LOOM_CHECK(j.is_object(), source, ": expected a JSON object (", what, "), found ", j.type_name());
  return j;
}

std::string found(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return str_cat(v.type_name(), " ", s);
}

bool present(const json& obj, const char* key) {
  return obj.contains(key) && !obj.at(key).is_null();
}

int64_t to_int(const json& v, const std::string& source, const std::string& field) {
  LOOM_CHECK(v.is_number_integer(), source, ": field '", field, "': expected an integer, found ",
             found(v));
  LOOM_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= INT64_MAX, source, ": field '", field,
             "': value ", v.dump(), " is too large");
  return v.get<int64_t>();
}

int64_t get_int(const json& obj, const char* key, const std::string& source,
                const std::string& field) {
  return to_int(obj.at(key), source, field);
}

double get_number(const json& obj, const char* key, const std::string& source,
                  const std::string& field) {
  const json& v = obj.at(key);
  LOOM_CHECK(v.is_number(), source, ": field '", field, "': expected a number, found ", found(v));
  return v.get<double>();
}

bool get_bool(const json& obj, const char* key, const std::string& source,
              const std::string& field) {
  const json& v = obj.at(key);
  LOOM_CHECK(v.is_boolean(), source, ": field '", field, "': expected true or false, found ",
             found(v));
  return v.get<bool>();
}

void read(const json& j, const char* key, const std::string& source, int64_t& out) {
  if (present(j, key)) out = get_int(j, key, source, key);
}
void read(const json& j, const char* key, const std::string& source, double& out) {
  if (present(j, key)) out = get_number(j, key, source, key);
}
void read(const json& j, const char* key, const std::string& source, bool& out) {
  if (present(j, key)) out = get_bool(j, key, source, key);
}

int64_t required_int(const json& obj, const char* key, const std::string& source) {
  LOOM_CHECK(present(obj, key), source, ": missing required field '", key,
             "' (expected a positive integer)");
  return get_int(obj, key, source, key);
}

}  // namespace loom::config_json
