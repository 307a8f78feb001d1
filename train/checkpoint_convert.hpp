#pragma once
// `loom convert` (docs/design.md "The command line"): between loom checkpoints and Hugging Face
// model directories, streaming: one tensor in memory at a time, whatever the model's size.
#include <cstddef>
#include <string>

#include "core/dtype.hpp"

namespace loom {

struct ConvertOptions {
  DType dtype = DType::f32;                  // of the Hugging Face tensors written (f32, bf16)
  size_t max_shard_bytes = size_t(5) << 30;  // Hugging Face files are split beyond this
  bool verify = true;  // a loom checkpoint's files against its checksums first (verify_checkpoint)
};

// A loom checkpoint directory (or a Hugging Face one, to cast or re-split it) -> the Hugging Face
// directory `dst`, which must not exist: config.json, model.safetensors or
// model-0000i-of-0000n.safetensors + model.safetensors.index.json, and the tokenizer's files that
// `src` has. Every tensor of the model the config describes must be in `src` with its shape
// (errors name the directory, the file and the tensor); nothing is written until that is
// checked, and `dst` appears only complete (written as DST.tmp.<pid>, then renamed). A corrupt
// loom checkpoint is an error (verify_checkpoint) before anything is written. Returns a note for
// the user (a checkpoint without checksums, read unverified), or "".
std::string export_hugging_face(const std::string& src, const std::string& dst,
                                const ConvertOptions& opt = {});

// A Hugging Face directory (or a loom checkpoint, to gather it into one file) -> the loom
// checkpoint directory `dst`, which must not exist: the weights as f32 in one rank's file, no
// optimizer moments (a resume from it starts AdamW afresh at step 0), state.json at step 0.
// Checked, verified (a loom checkpoint as `src`, unless !verify) and atomic as
// export_hugging_face, and returns its note.
std::string import_hugging_face(const std::string& src, const std::string& dst, bool verify = true);

}  // namespace loom
