#pragma once
// The CUDA emulation's flash primitives: this folder comes before the source root on the emulated
// backend's include path, so kernels/cuda/flash_attention.cu takes the host primitives of
// tests/kernels/flash_emulation.hpp (the PTX ISA's fragment layouts) in place of the inline PTX of
// the real kernels/cuda/flash_primitives.cuh.
#include "tests/kernels/flash_emulation.hpp"
