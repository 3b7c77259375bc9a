/* Activations rounded to 8-bit integers per block of 32, for the GEMVs over 8-bit activations
 * (gemv_q8.c): dx = max|x| / 127 and q = x * (1 / dx) rounded to the nearest integer, ties to even
 * (dx = 0: q = 0). The AVX2 form and the portable one compute the same integers and floats (max, one
 * division, one product and one rounding a value, all exact or rounded once alike), so every GEMV path
 * sees the same quantized x.
 *
 * Why a vector form: the GEMV itself costs about one cycle a 8 weights, and the portable loop about
 * 20 a value (fmaxf is a libm call without -ffast-math); at one decode row over SmolLM2's 576 inputs
 * the rounding took as long as the GEMV of 64 outputs.
 */
#ifndef FORERUN_Q8_ACTIVATIONS_H
#define FORERUN_Q8_ACTIVATIONS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { Q8_BLOCK = 32 };

/* One block: its 32 codes into q, its scale dx into *d; returns the sum of the codes. lane[l] (l < 8)
 * gets the sum of codes 4l..4l+3. */
static inline int q8_block_scalar(const float *x, int8_t *q, float *d, int32_t lane[8]) {
    float amax = 0.f;
    for (int i = 0; i < Q8_BLOCK; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float dx = amax / 127.f, id = dx > 0.f ? 1.f / dx : 0.f;
    int sum = 0;
    for (int i = 0; i < Q8_BLOCK; i++) {
        const float v = nearbyintf(x[i] * id); /* the default rounding mode: ties to even */
        q[i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    }
    for (int l = 0; l < 8; l++) {
        lane[l] = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
        sum += lane[l];
    }
    *d = dx;
    return sum;
}

#if defined(__AVX2__)
static inline int q8_block_avx2(const float *x, int8_t *q, float *d, int32_t lane[8]) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m); /* a NaN is skipped, as the scalar compare skips it */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float dx = _mm_cvtss_f32(h) / 127.f, id = dx > 0.f ? 1.f / dx : 0.f;
    const __m256 scale = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[i] = _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, r)));
    }
    /* 32-bit lanes to bytes: the packs interleave 128-bit halves; the permute puts them back in order. */
    const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i bytes = _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
    _mm256_storeu_si256((__m256i *)lane, lanes);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    *d = dx;
    return _mm_cvtsi128_si32(s);
}
#define q8_block q8_block_avx2
#else
#define q8_block q8_block_scalar
#endif

/* x quantized, one row after the other: q [k] codes; per block: dx and sx = dx * (float)(sum of its q);
 * per lane of 4: ol = offset * (sum of the lane's q) (what unsigned codes add to P on the VNNI path). */
typedef struct {
    int8_t *q;
    float *dx, *sx;
    int32_t *ol;
} qx_t;

static void free_x(qx_t *qx) {
    free(qx->q);
    free(qx->dx);
    free(qx->sx);
    free(qx->ol);
}

/* x [rows, k] quantized into `out` (free_x frees it; -1 when memory runs out). `offset`: the format's
 * code offset, for ol. `portable`: round with the portable code (the GEMV's portable path does, so that
 * the paths' bit-equality test covers the rounding too). */
static int quantize_x(const float *x, int64_t rows, int64_t k, int offset, int portable, qx_t *out) {
    const int64_t blocks = rows * k / Q8_BLOCK;
    out->q = malloc((size_t)(rows * k));
    out->dx = malloc(sizeof(float) * (size_t)blocks);
    out->sx = malloc(sizeof(float) * (size_t)blocks);
    out->ol = malloc(sizeof(int32_t) * (size_t)blocks * 8);
    if (!out->q || !out->dx || !out->sx || !out->ol) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        int32_t *lane = out->ol + b * 8;
        const int sum = portable ? q8_block_scalar(x + b * Q8_BLOCK, out->q + b * Q8_BLOCK, &out->dx[b], lane)
                                          : q8_block(x + b * Q8_BLOCK, out->q + b * Q8_BLOCK, &out->dx[b], lane);
        for (int l = 0; l < 8; l++) lane[l] *= offset;
        out->sx[b] = out->dx[b] * (float)sum;
    }
    return 0;
}
#endif
