// Which instruction-set level this build is, and which levels this CPU can run: what
// pallas_kernels/cpu/library.py asks the always-safe base build (scalar on x86, generic elsewhere)
// before it loads a wider one, so that a build made on one machine never stops another with an
// illegal instruction.
//
// setup.py compiles the same sources once per level with -DSTRATA_LEVEL="<level>" and that level's
// -march flags. A build without the macro (a test's own compile of other flags) says "custom".
#include <cstring>

#ifndef STRATA_LEVEL
#define STRATA_LEVEL "custom"
#endif

namespace {

constexpr bool same(const char* a, const char* b) { return *a == *b && (*a == '\0' || same(a + 1, b + 1)); }

// A level's name must match the flags it was compiled with: a mislabelled build would pass the
// cpuid check for the label and then run wider instructions than the CPU has.
#if defined(__x86_64__) || defined(__i386__)
constexpr bool kV3 =
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__BMI2__)
    true;
#else
    false;
#endif
constexpr bool kV4 =
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
    true;
#else
    false;
#endif
constexpr bool kAvxVnni =
#if defined(__AVXVNNI__)
    true;
#else
    false;
#endif
constexpr bool kAvx512VnniVbmi =
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    true;
#else
    false;
#endif
constexpr bool kAvx =
#if defined(__AVX__)
    true;
#else
    false;
#endif
static_assert(!same(STRATA_LEVEL, "scalar") || !kAvx, "the scalar level must be built without AVX (-march=x86-64)");
static_assert(!same(STRATA_LEVEL, "avx2") || (kV3 && !kV4), "the avx2 level needs -march=x86-64-v3");
static_assert(!same(STRATA_LEVEL, "avxvnni") || (kV3 && kAvxVnni && !kV4), "avxvnni needs -march=x86-64-v3 -mavxvnni");
static_assert(!same(STRATA_LEVEL, "avx512") || kV4, "the avx512 level needs -march=x86-64-v4");
static_assert(!same(STRATA_LEVEL, "avx512vnni") || (kV4 && kAvx512VnniVbmi),
              "avx512vnni needs -march=x86-64-v4 -mavx512vnni -mavx512vbmi");
#endif

}  // namespace

#define STRATA_EXPORT extern "C" __attribute__((visibility("default")))

STRATA_EXPORT const char* strata_cpu_level() { return STRATA_LEVEL; }

// 1: this CPU (and its OS: __builtin_cpu_supports checks that XSAVE enables the AVX / AVX-512
// register state) runs `level`'s instructions; 0: it does not; -1: `level` is not a level of this
// architecture. Only cpuid is executed here, so the scalar build may answer on any x86-64 CPU.
STRATA_EXPORT int strata_cpu_supports(const char* level) {
  if (level == nullptr) return -1;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // x86-64-v3: AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE (and XSAVE'd YMM state);
  // x86-64-v4: v3 plus AVX512F, BW, CD, DQ, VL (and XSAVE'd ZMM and opmask state).
  const bool v3 = __builtin_cpu_supports("x86-64-v3") && __builtin_cpu_supports("avx2") &&
                  __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("bmi2");
  const bool v4 = v3 && __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512f") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (std::strcmp(level, "scalar") == 0) return 1;
  if (std::strcmp(level, "avx2") == 0) return v3;
  if (std::strcmp(level, "avxvnni") == 0) return v3 && __builtin_cpu_supports("avxvnni");
  if (std::strcmp(level, "avx512") == 0) return v4;
  if (std::strcmp(level, "avx512vnni") == 0)
    return v4 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  return -1;
#else
  return std::strcmp(level, "generic") == 0 ? 1 : -1;
#endif
}
