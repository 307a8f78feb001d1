// GLA weights in fla's format: save_hf writes fla's names and shapes (GlaConfig::params) and a
// config.json that reads back as the same config; load_hf reads them into another model; a file
// with tensors of another variant is refused by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "model/gla.hpp"
#include "model/safetensors.hpp"
#include "tests/model/tiny_gla.hpp"
#include "tests/test_util.hpp"

using namespace loom;
namespace fs = std::filesystem;

TEST(GlaCheckpointIo, SavesFlaNamesAndLoadsThemBack) {
  const GlaConfig c = test::tiny_gla_config(101, true);
  const fs::path dir = fs::temp_directory_path() / "loom_gla_io";
  fs::remove_all(dir);
  GlaModel a(c, DType::f32);
  a.init_weights(3);
  a.save_hf(dir.string());

  const GlaConfig back = GlaConfig::from_file((dir / "config.json").string());
  EXPECT_EQ(back.to_json(), c.to_json());
  SafetensorsDir st(dir.string());
  std::map<std::string, Shape> want;
  for (const auto& p : c.params()) want[p.name] = Shape(p.shape.begin(), p.shape.end());
  EXPECT_EQ(st.names().size(), want.size());
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(st.has(name)) << name;
    EXPECT_EQ(st.file_of(name).entry(name).shape, shape) << name;
  }

  GlaModel b(back, DType::f32);
  b.init_weights(99);  // other weights, overwritten by the load
  b.load_hf(st);
  auto ua = a.units(), ub = b.units();
  for (size_t i = 0; i < ua.size(); ++i) {
    const float* x = ua[i]->flat().data<float>();
    const float* y = ub[i]->flat().data<float>();
    EXPECT_EQ(std::vector<float>(x, x + ua[i]->numel()), std::vector<float>(y, y + ub[i]->numel()))
        << ua[i]->name();
  }

  // The same file into a model without the short convolution: a conv tensor is named.
  GlaConfig other = c;
  other.use_short_conv = false;
  GlaModel m(other, DType::f32);
  test::expect_error([&] { m.load_hf(st); }, {"_conv1d.weight", "not a parameter"});
  fs::remove_all(dir);
}
