/* 8- and 16-wide float vectors (GCC vector extensions: AVX2/AVX-512 on x86, NEON on ARM under
 * -march=native), bf16 conversions, and an exp that vectorises (glibc's vector expf needs -ffast-math,
 * which would also relax every other operation). A 16-wide vector is one 512-bit register where the
 * CPU has AVX-512 and two 256-bit ones elsewhere: where a loop is bound by its vector instructions, as
 * an exp is, it does twice the work per instruction on AVX-512. Each lane's operations are the same at
 * either width, so both give the same bits. */
#ifndef FORERUN_VEC_H
#define FORERUN_VEC_H
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* Scalar loads and stores; bf16 rounds to nearest even, as torch does. */
static inline float ld_f32(const float *p) { return *p; }
static inline void st_f32(float *p, float v) { *p = v; }

static inline float ld_bf16(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void st_bf16(uint16_t *p, float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1);
    *p = (uint16_t)(u >> 16);
}

static inline v8f splat8(float v) { return (v8f){v, v, v, v, v, v, v, v}; }
static inline v16f splat16(float v) { return (v16f){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

/* loadN_f32/storeN_f32/loadN_bf16/storeN_bf16, roundN_bf16 (to the nearest bf16 value, kept in
 * fp32) and selectN for N-wide vectors; bf16 rounds to nearest even, as torch does. */
#define VEC_LOAD_STORE(N, VF, VI, VU, VH)                                                           \
    static inline VF load##N##_f32(const float *p) {                                                \
        VF v;                                                                                       \
        memcpy(&v, p, sizeof v);                                                                    \
        return v;                                                                                   \
    }                                                                                               \
    static inline void store##N##_f32(float *p, VF v) { memcpy(p, &v, sizeof v); }                  \
    static inline VF load##N##_bf16(const uint16_t *p) {                                            \
        VH h;                                                                                       \
        memcpy(&h, p, sizeof h);                                                                    \
        return (VF)(__builtin_convertvector(h, VU) << 16);                                          \
    }                                                                                               \
    static inline VU bf16_bits##N(VF v) {                                                           \
        const VU u = (VU)v;                                                                         \
        return (u + 0x7FFF + ((u >> 16) & 1)) >> 16;                                               \
    }                                                                                               \
    static inline VF round##N##_bf16(VF v) { return (VF)(bf16_bits##N(v) << 16); }                 \
    static inline void store##N##_bf16(uint16_t *p, VF v) {                                         \
        VH h = __builtin_convertvector(bf16_bits##N(v), VH);                                        \
        memcpy(p, &h, sizeof h);                                                                    \
    }                                                                                               \
    static inline VF select##N(VI mask, VF a, VF b) { return (VF)((mask & (VI)a) | (~mask & (VI)b)); }

VEC_LOAD_STORE(8, v8f, v8i, v8u, v8h)
VEC_LOAD_STORE(16, v16f, v16i, v16u, v16h)

/* The 8 lanes added as ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)). Spelled with shuffles where the
 * compiler has them: written lane by lane, GCC 12 took each lane out on its own and added them in a
 * chain of scalar adds, and the decode attention (one sum a position and query head) ran 10-14% slower
 * on one thread (Intel Xeon, context 192-768). Same adds, same order, so the same bits. */
static inline float hsum8(v8f v) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
    typedef float v4f_ __attribute__((vector_size(16)));
    const v4f_ s = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    const v4f_ t = s + __builtin_shufflevector(s, s, 1, 0, 3, 2); /* s0 + s1, -, s2 + s3, - */
    return t[0] + t[2];
#else
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#endif
}

/* Ask for every cache line of a row that will be read soon. */
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)row + o);
}

/* exp(x) to about 2 ulp (Cephes' expf): 2^n * p(r) with r = x - n ln2, |r| <= ln2 / 2. One body for
 * every vector width, so each lane gets the same bits at any width. */
#define VEC_EXP(NAME, VF, VI, SPLAT, SELECT)                                                        \
    static inline VF NAME(VF x) {                                                                   \
        x = SELECT(x > SPLAT(88.3762626647949f), SPLAT(88.3762626647949f), x);                     \
        x = SELECT(x < SPLAT(-87.3365447504f), SPLAT(-87.3365447504f), x);                         \
        VF fx = x * SPLAT(1.44269504088896341f) + SPLAT(0.5f);                                      \
        VI n = __builtin_convertvector(fx, VI);                                                     \
        VF t = __builtin_convertvector(n, VF);                                                      \
        n -= (VI)(t > fx) & 1; /* truncation rounds toward zero: floor for negatives */             \
        t = __builtin_convertvector(n, VF);                                                         \
        x = x - t * SPLAT(0.693359375f) - t * SPLAT(-2.12194440e-4f);                               \
        VF y = SPLAT(1.9875691500e-4f);                                                             \
        y = y * x + SPLAT(1.3981999507e-3f);                                                        \
        y = y * x + SPLAT(8.3334519073e-3f);                                                        \
        y = y * x + SPLAT(4.1665795894e-2f);                                                        \
        y = y * x + SPLAT(1.6666665459e-1f);                                                        \
        y = y * x + SPLAT(5.0000001201e-1f);                                                        \
        y = y * x * x + x + SPLAT(1.0f);                                                            \
        return y * (VF)((n + 127) << 23);                                                           \
    }

VEC_EXP(exp8, v8f, v8i, splat8, select8)
VEC_EXP(exp16, v16f, v16i, splat16, select16)

#endif
