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

/* Whether a 16-wide vector is one register. Elsewhere (AVX2: two) a loop that holds many of them runs
 * out of registers, and GCC builds each splat16 through the stack: the decode attention's pv, 16 wide
 * on an AMD EPYC with AVX2 only, stored every score 16 times and spilled its accumulators. */
#if defined(__AVX512F__)
#define VEC16_NATIVE 1
#else
#define VEC16_NATIVE 0
#endif

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

/* Whether the compiler has __builtin_shufflevector (clang, GCC 12 on): the vector forms of the sums
 * below need it; without it they add lane by lane, as slowly as hsum8 a vector. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define VEC_SHUFFLES 1
#else
#define VEC_SHUFFLES 0
#endif

/* The 8 lanes added as ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)). Spelled with shuffles where the
 * compiler has them: written lane by lane, GCC 12 took each lane out on its own and added them in a
 * chain of scalar adds, and the decode attention (one sum a position and query head) ran 10-14% slower
 * on one thread (Intel Xeon, context 192-768). Same adds, same order, so the same bits. */
static inline float hsum8(v8f v) {
#if VEC_SHUFFLES
    typedef float v4f_ __attribute__((vector_size(16)));
    const v4f_ s = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    const v4f_ t = s + __builtin_shufflevector(s, s, 1, 0, 3, 2); /* s0 + s1, -, s2 + s3, - */
    return t[0] + t[2];
#else
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#endif
}

/* hsum8 of eight vectors at once, in two steps with the same adds in the same order: hsum8_pair(a, b)
 * adds each vector's lane l and l + 4 (a's sums in lanes 0-3, b's in 4-7), and hsum8_pairs of four
 * such pairs (of vectors 0-1, 2-3, 4-5, 6-7) finishes them: lane p is hsum8 of vector p. Why: one
 * sum a position leaves most of a vector idle; eight share its shuffles. Callers use them only where
 * VEC_SHUFFLES is 1: the lane-by-lane forms are there to compile everywhere. */
static inline v8f hsum8_pair(v8f a, v8f b) {
#if VEC_SHUFFLES
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
#else
    return (v8f){a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7],
                 b[0] + b[4], b[1] + b[5], b[2] + b[6], b[3] + b[7]};
#endif
}

static inline v8f hsum8_pairs(const v8f s[4]) {
#if VEC_SHUFFLES
    /* [s0 s2 | s1 s3] sums (lanes 0-1, then 2-3, of each 4): t = [p0 q0 p2 q2 | p1 q1 p3 q3] */
    const v8f t0 = __builtin_shufflevector(s[0], s[1], 0, 2, 8, 10, 4, 6, 12, 14) +
                   __builtin_shufflevector(s[0], s[1], 1, 3, 9, 11, 5, 7, 13, 15);
    const v8f t1 = __builtin_shufflevector(s[2], s[3], 0, 2, 8, 10, 4, 6, 12, 14) +
                   __builtin_shufflevector(s[2], s[3], 1, 3, 9, 11, 5, 7, 13, 15);
    /* r = p + q: [r0 r2 r4 r6 | r1 r3 r5 r7], then in order */
    const v8f r = __builtin_shufflevector(t0, t1, 0, 2, 8, 10, 4, 6, 12, 14) +
                  __builtin_shufflevector(t0, t1, 1, 3, 9, 11, 5, 7, 13, 15);
    return __builtin_shufflevector(r, r, 0, 4, 1, 5, 2, 6, 3, 7);
#else
    v8f out;
    for (int p = 0; p < 8; p++) {
        const v8f v = s[p / 2];
        const int o = 4 * (p % 2);
        out[p] = (v[o] + v[o + 1]) + (v[o + 2] + v[o + 3]);
    }
    return out;
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
