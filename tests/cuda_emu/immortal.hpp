#pragma once
// A function-local static that is never destroyed: the emulation's runtime state, which the
// allocators' blocks are given back to from static destructors at exit (after a plain static
// would be gone).
namespace loom::cuda_emu {

template <class T>
T& immortal() {
  union Holder {
    T value;
    Holder() : value() {}
    ~Holder() {}
  };
  static Holder h;
  return h.value;
}

}  // namespace loom::cuda_emu
