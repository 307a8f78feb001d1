#pragma once
// Schedules as torchtitan's compute-only CSV (`[parallelism] pp_schedule_csv`): one row per pp
// rank, one cell per action in the order it runs, each "<stage><F|B|I|W><micro-batch>" ("0F3");
// an empty cell is an idle slot. The stage -> rank map is where each stage's actions are; the
// numbers of stages and micro-batches are one more than the largest that appear. A schedule made
// elsewhere can be run, and loom's generators diffed against torch's.
#include <string>

#include "parallel/pipeline/schedule.hpp"

namespace loom::pp {

std::string schedule_csv(const Schedule& s);
// `name` (the file) is in every message, with the line and cell; the result is validated.
Schedule parse_schedule_csv(const std::string& text, const std::string& name);
Schedule read_schedule_csv(const std::string& path);
void write_schedule_csv(const Schedule& s, const std::string& path);

}  // namespace loom::pp
