#include "parallel/pipeline/schedule_csv.hpp"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace loom::pp {
namespace {

std::string trim(const std::string& x) {
  size_t a = 0, b = x.size();
  while (a < b && std::isspace(static_cast<unsigned char>(x[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(x[b - 1]))) --b;
  return x.substr(a, b - a);
}

// "<digits><F|B|I|W><digits>", nothing else.
bool parse_action(const std::string& cell, Action& a) {
  size_t i = 0;
  auto number = [&](int& out) {
    const size_t start = i;
    while (i < cell.size() && std::isdigit(static_cast<unsigned char>(cell[i]))) ++i;
    if (i == start || i - start > 6) return false;
    out = std::stoi(cell.substr(start, i - start));
    return true;
  };
  if (!number(a.stage) || i >= cell.size()) return false;
  const char op = cell[i++];
  if (op == 'F')
    a.op = Op::F;
  else if (op == 'B')
    a.op = Op::B;
  else if (op == 'I')
    a.op = Op::I;
  else if (op == 'W')
    a.op = Op::W;
  else
    return false;
  return number(a.mb) && i == cell.size();
}

}  // namespace

std::string schedule_csv(const Schedule& s) {
  std::string out;
  for (const auto& order : s.orders) {
    for (size_t k = 0; k < order.size(); ++k) {
      if (k) out += ',';
      out += to_string(order[k]);
    }
    out += '\n';
  }
  return out;
}

Schedule parse_schedule_csv(const std::string& text, const std::string& name) {
  Schedule s;
  s.name = name;
  std::istringstream lines(text);
  std::string line;
  int stages = 0, mbs = 0;
  for (int lineno = 1; std::getline(lines, line); ++lineno) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;  // a trailing blank line is not a rank
    std::vector<Action> order;
    std::istringstream cells(line);
    std::string cell;
    for (int col = 1; std::getline(cells, cell, ','); ++col) {
      cell = trim(cell);
      if (cell.empty()) continue;
      Action a;
      LOOM_CHECK(parse_action(cell, a), "pp_schedule_csv ", name, ": line ", lineno, ", cell ", col,
                 ": \"", cell, "\" is not an action; expected <stage><F|B|I|W><micro-batch> ",
                 "such as 0F3 (compute-only format, one row per pp rank)");
      stages = std::max(stages, a.stage + 1);
      mbs = std::max(mbs, a.mb + 1);
      order.push_back(a);
    }
    s.orders.push_back(std::move(order));
  }
  s.ranks = int(s.orders.size());
  s.stages = stages;
  s.microbatches = mbs;
  LOOM_CHECK(s.ranks > 0 && stages > 0, "pp_schedule_csv ", name,
             ": no actions; expected one row of actions per pp rank");
  s.stage_rank.assign(size_t(stages), -1);
  for (int r = 0; r < s.ranks; ++r)
    for (const Action& a : s.orders[size_t(r)]) {
      int& owner = s.stage_rank[size_t(a.stage)];
      LOOM_CHECK(owner == -1 || owner == r, "pp_schedule_csv ", name, ": stage ", a.stage,
                 " has actions on rows ", owner + 1, " and ", r + 1, " (pp ranks ", owner, " and ",
                 r, "); expected each stage on one rank");
      owner = r;
    }
  for (int st = 0; st < stages; ++st)
    LOOM_CHECK(s.stage_rank[size_t(st)] >= 0, "pp_schedule_csv ", name, ": stage ", st,
               " has no action; expected stages 0..", stages - 1, " all present");
  LOOM_CHECK(stages % s.ranks == 0, "pp_schedule_csv ", name, ": ", stages, " stages on ", s.ranks,
             " ranks; expected the same number of stages on every rank");
  validate(s);
  return s;
}

Schedule read_schedule_csv(const std::string& path) {
  std::ifstream in(path);
  LOOM_CHECK(in.good(), "parallelism.pp_schedule_csv = \"", path, "\": cannot read the file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_schedule_csv(text.str(), path);
}

void write_schedule_csv(const Schedule& s, const std::string& path) {
  std::ofstream out(path);
  out << schedule_csv(s);
  LOOM_CHECK(out.good(), "pp schedule ", s.name, ": cannot write ", path);
}

}  // namespace loom::pp
