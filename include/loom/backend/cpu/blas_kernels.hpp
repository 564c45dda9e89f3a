// Which of OpenBLAS's kernels the CPU backend's GEMMs run on. OpenBLAS picks
// them for the CPU model it sees when it loads, and runs its Prescott (SSE3)
// kernels on a model it does not know, whatever the CPU offers: Debian 12's
// 0.3.21 does so on Intel's 5th-generation Xeon, where CPU training then
// takes 1.6 to 3 times as long. The choice is made before main() runs and
// only the environment variable OPENBLAS_CORETYPE changes it, so loom can
// only say what to set: blas_kernels_note(). scripts/lib.sh's
// loom_tune_openblas sets it for loom's scripts by the same rule; a unit
// test checks that both choose alike where the script replaced kernels.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <string>
#include <string_view>

#include "../../core/linkage.hpp"

namespace loom::cpu {

// OpenBLAS's name for the kernels it runs ("Haswell", "Prescott", ...).
inline std::string blas_kernels() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "unknown";
}

// Defined below; compiled once under LOOM_SEPARATE_COMPILATION (core/linkage.hpp).
LOOM_DECL std::string better_blas_kernels(std::string_view chosen, std::string_view flags);
LOOM_DECL std::string cpu_flags();
LOOM_DECL std::string blas_kernels_note();

#if LOOM_IMPLEMENT
// The kernels OpenBLAS should run instead of `chosen` on a CPU with these
// /proc/cpuinfo flags (space-separated), or "" when `chosen` is fine: only
// Prescott-class kernels (OpenBLAS's fallback) are replaced, by the best
// that the flags allow.
LOOM_DECL std::string better_blas_kernels(std::string_view chosen, std::string_view flags) {
  constexpr std::string_view old_kernels[] = {"Prescott", "Core2",     "Penryn",     "Dunnington",
                                              "Nehalem",  "Atom",      "Sandybridge"};
  bool old = false;
  for (const auto name : old_kernels) old = old || chosen == name;
  if (!old) return {};
  // A whole flag: "avx2" is not "avx512f"'s prefix.
  const auto has = [&](std::string_view name) {
    for (auto at = flags.find(name); at != std::string_view::npos; at = flags.find(name, at + 1)) {
      const auto end = at + name.size();
      if ((at == 0 || flags[at - 1] == ' ') && (end == flags.size() || flags[end] == ' '))
        return true;
    }
    return false;
  };
  const auto has_all = [&](std::initializer_list<std::string_view> names) {
    return std::ranges::all_of(names, has);
  };
  const bool avx512 = has_all({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"});
  if (avx512 && has_all({"avx512_bf16"})) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (has_all({"avx2", "fma"})) return "Haswell";
  return {};
}

// This CPU's flags (the first "flags" line of /proc/cpuinfo; "" elsewhere).
LOOM_DECL std::string cpu_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.starts_with("flags")) {
      const auto colon = line.find(':');
      return colon == std::string::npos ? std::string() : line.substr(colon + 1);
    }
  return {};
}

// What to do when OpenBLAS runs older kernels than this CPU can ("" when it
// does not, or when OPENBLAS_CORETYPE chose them).
LOOM_DECL std::string blas_kernels_note() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return {};
  const std::string chosen = blas_kernels();
  const std::string better = better_blas_kernels(chosen, cpu_flags());
  if (better.empty()) return {};
  return "OpenBLAS runs its " + chosen + " kernels on this CPU, which can run its " + better +
         " kernels: start with OPENBLAS_CORETYPE=" + better +
         " set (scripts/run does): CPU training 1.6 to 3 times as fast on a 5th-generation Xeon";
}

#endif  // LOOM_IMPLEMENT

}  // namespace loom::cpu
