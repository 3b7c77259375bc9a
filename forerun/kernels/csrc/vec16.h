/* 16-wide float vectors: one 512-bit register where the CPU has AVX-512, two 256-bit ones elsewhere
 * (GCC lowers them to what -march=native has). Where a loop is bound by its vector instructions,
 * as an exp is, they do twice the work of vec.h's 8-wide ones per instruction on AVX-512. The same
 * operations per lane as vec.h's, so either width gives the same bits. */
#ifndef FORERUN_VEC16_H
#define FORERUN_VEC16_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f splat16(float v) { return (v16f){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

static inline v16f load16_f32(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16_f32(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline v16f load16_bf16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

static inline void store16_bf16(uint16_t *p, v16f v) {
    v16u u = (v16u)v;
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even, as torch does */
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, sizeof h);
}

static inline v16f select16(v16i mask, v16f a, v16f b) { return (v16f)((mask & (v16i)a) | (~mask & (v16i)b)); }

VEC_EXP(exp16, v16f, v16i, splat16, select16)

#endif
