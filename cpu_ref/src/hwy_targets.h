// The one per-target mechanism of cpu_ref's Highway code. A file compiled once per target
// (write_hwy.cc, attention_hwy.cc: HWY_TARGET_INCLUDE + foreach_target.h) defines a table
// maker `Fn` inside HWY_NAMESPACE; in its HWY_ONCE part,
//   KVQ_HWY_PER_TARGET(target, Fn)
// returns N_<TARGET>::Fn() for the Highway target bit `target`, and falls through for a target
// the file was not compiled for. Both files list the same targets because both include this
// header first (HWY_WANT_AVX3_DL) and cpu_ref builds with HWY_COMPILE_ALL_ATTAINABLE.
#pragma once

// AVX3_DL (Ice Lake and later) is compiled only on request; this machine class has it.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL
#endif

#include <hwy/targets.h>


#define KVQ_HWY_CASE(TARGET, Fn) \
  case HWY_##TARGET:             \
    return N_##TARGET::Fn();

#if HWY_TARGETS & HWY_AVX3_DL
#define KVQ_HWY_CASE_AVX3_DL(Fn) KVQ_HWY_CASE(AVX3_DL, Fn)
#else
#define KVQ_HWY_CASE_AVX3_DL(Fn)
#endif
#if HWY_TARGETS & HWY_AVX3
#define KVQ_HWY_CASE_AVX3(Fn) KVQ_HWY_CASE(AVX3, Fn)
#else
#define KVQ_HWY_CASE_AVX3(Fn)
#endif
#if HWY_TARGETS & HWY_AVX2
#define KVQ_HWY_CASE_AVX2(Fn) KVQ_HWY_CASE(AVX2, Fn)
#else
#define KVQ_HWY_CASE_AVX2(Fn)
#endif
#if HWY_TARGETS & HWY_SSE4
#define KVQ_HWY_CASE_SSE4(Fn) KVQ_HWY_CASE(SSE4, Fn)
#else
#define KVQ_HWY_CASE_SSE4(Fn)
#endif
#if HWY_TARGETS & HWY_SSSE3
#define KVQ_HWY_CASE_SSSE3(Fn) KVQ_HWY_CASE(SSSE3, Fn)
#else
#define KVQ_HWY_CASE_SSSE3(Fn)
#endif
#if HWY_TARGETS & HWY_EMU128
#define KVQ_HWY_CASE_EMU128(Fn) KVQ_HWY_CASE(EMU128, Fn)
#else
#define KVQ_HWY_CASE_EMU128(Fn)
#endif
#if HWY_TARGETS & HWY_SCALAR
#define KVQ_HWY_CASE_SCALAR(Fn) KVQ_HWY_CASE(SCALAR, Fn)
#else
#define KVQ_HWY_CASE_SCALAR(Fn)
#endif

#define KVQ_HWY_PER_TARGET(target, Fn) \
  switch (target) {                    \
    KVQ_HWY_CASE_AVX3_DL(Fn)           \
    KVQ_HWY_CASE_AVX3(Fn)              \
    KVQ_HWY_CASE_AVX2(Fn)              \
    KVQ_HWY_CASE_SSE4(Fn)              \
    KVQ_HWY_CASE_SSSE3(Fn)             \
    KVQ_HWY_CASE_EMU128(Fn)            \
    KVQ_HWY_CASE_SCALAR(Fn)            \
    default:                           \
      break;                           \
  }
