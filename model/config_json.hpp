#pragma once
// The JSON readers behind the model configs (a Hugging Face / fla config.json): each names the
// file and the field and what was expected, so a bad config fails before any work with the key
// to fix. Shared by LlamaConfig, GlaConfig and ModelConfig's dispatch.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace loom::config_json {

using json = nlohmann::json;

// Parses `text` and requires an object; `what` says which kind ("a Hugging Face config.json").
json parse_object(const std::string& text, const std::string& source, const char* what);

// A value for a message: its JSON type and (up to 60 characters of) its text.
std::string found(const json& v);
// Present and not null: a null field means the default, as in transformers and fla.
bool present(const json& obj, const char* key);

// Typed getters; `field` is the name used in messages (may be dotted). The integer ones check
// the type and range first: nlohmann's get<int64_t>() of a float or of a too-large integer is an
// undefined conversion, not an error.
int64_t to_int(const json& v, const std::string& source, const std::string& field);
int64_t get_int(const json& obj, const char* key, const std::string& source,
                const std::string& field);
double get_number(const json& obj, const char* key, const std::string& source,
                  const std::string& field);
bool get_bool(const json& obj, const char* key, const std::string& source,
              const std::string& field);

// A field that must be there: loom::Error naming `source` and the key when it is absent or null.
int64_t required_int(const json& obj, const char* key, const std::string& source);

// Each reader leaves `out` at its default when the key is absent or null.
void read(const json& j, const char* key, const std::string& source, int64_t& out);
void read(const json& j, const char* key, const std::string& source, double& out);
void read(const json& j, const char* key, const std::string& source, bool& out);

}  // namespace loom::config_json
