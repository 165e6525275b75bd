// Shared by the C++ shims (graph.cpp, ops.cpp, rtc.cpp): C++ exceptions never cross the C ABI.
// A shim function runs its body through `guarded`, which returns NULL on success or the
// exception's message in memory from malloc, freed by the caller through the shim's free
// function.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace vnfarm_shim {

inline char* message(const std::string& what) {
  char* out = static_cast<char*>(std::malloc(what.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, what.c_str(), what.size() + 1);
  }
  return out;
}

template <typename F>
char* guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    return message(e.what());
  } catch (...) {
    return message("unknown C++ exception");
  }
}

}  // namespace vnfarm_shim
