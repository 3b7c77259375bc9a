/* Activations rounded to integers per block of 32, for the GEMV over integer activations (gemv_int.c):
 * 8 bits (llama.cpp's rounding) or 16. With top = 127 or 32767: dx = max|x| / top and
 * q = x * (1 / dx) rounded to the nearest integer, ties to even (dx = 0: q = 0). The AVX2 form and the
 * portable one compute the same integers and floats (max, one division, one product and one rounding
 * a value, all exact or rounded once alike), so every GEMV path sees the same quantized x.
 *
 * Layout. 8 bits: a block's 32 codes in order, and lane l (l < 8) of its P sums are weights 4l..4l+3.
 * 16 bits, two layouts, as the GEMV widens the weights' codes (q16_pos, q16_lane):
 * - unpacked: the order vpunpck{l,h}bw give 32 weight bytes (they work within each 128-bit half):
 *   x0..7, x16..23, then x8..15, x24..31, so lane l < 4 sums weights 2l, 2l+1, 8+2l, 9+2l and lane 4+l
 *   the same 16 on (lanes 0-3 in the first run of 16, 4-7 in the second);
 * - natural: x0..31 in order (16 weights' bytes widened in place), so lane l sums weights 2l, 2l+1,
 *   16+2l, 17+2l (both runs; for formats with one map per 32 weights).
 * A lane's sum is an exact integer, so which weights share a lane changes nothing but the lane's
 * float, and both paths use the same grouping.
 *
 * Why a vector form: the GEMV itself costs about one cycle a 8 weights, and the portable loop about
 * 20 a value (fmaxf is a libm call without -ffast-math); at one decode row over SmolLM2's 576 inputs
 * the rounding took as long as the GEMV of 64 outputs.
 */
#ifndef FORERUN_INT_ACTIVATIONS_H
#define FORERUN_INT_ACTIVATIONS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

enum { ACT_BLOCK = 32 };

/* Where weight i of a block of 32 sits in a 16-bit layout, and which of the 8 lanes sums it. */
static inline int q16_pos(int natural, int i) {
    return natural ? i : (i & 7) + 8 * ((i >> 4) & 1) + 16 * ((i >> 3) & 1);
}
static inline int q16_lane(int natural, int i) { return (q16_pos(natural, i) & 15) / 2; }

/* One block: its 32 codes into q (int8_t or int16_t, laid out as above; `natural` picks the 16-bit
 * layout), its scale dx into *d; returns the sum of the codes. lane[l] gets the sum of lane l's 4 codes. */
static inline int int_block_scalar(int bits, int natural, const float *x, void *q, float *d, int32_t lane[8]) {
    const float top = bits == 8 ? 127.f : 32767.f;
    float amax = 0.f;
    for (int i = 0; i < ACT_BLOCK; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float dx = amax / top, id = dx > 0.f ? 1.f / dx : 0.f;
    int sum = 0;
    for (int l = 0; l < 8; l++) lane[l] = 0;
    for (int i = 0; i < ACT_BLOCK; i++) {
        const float v = nearbyintf(x[i] * id); /* the default rounding mode: ties to even */
        const int c = (int)(v > top ? top : v < -top ? -top : v);
        if (bits == 8) {
            ((int8_t *)q)[i] = (int8_t)c;
            lane[i / 4] += c;
        } else {
            ((int16_t *)q)[q16_pos(natural, i)] = (int16_t)c;
            lane[q16_lane(natural, i)] += c;
        }
        sum += c;
    }
    *d = dx;
    return sum;
}

#if defined(__AVX2__)
static inline int int_block_avx2(int bits, int natural, const float *x, void *q, float *d, int32_t lane[8]) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m); /* a NaN is skipped, as the scalar compare skips it */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float top = bits == 8 ? 127.f : 32767.f;
    const float dx = _mm_cvtss_f32(h) / top, id = dx > 0.f ? 1.f / dx : 0.f;
    const __m256 scale = _mm256_set1_ps(id), hi = _mm256_set1_ps(top), lo = _mm256_set1_ps(-top);
    __m256i c[4];
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c[i] = _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, r)));
    }
    __m256i lanes;
    if (bits == 8) {
        /* 32-bit lanes to bytes: the packs interleave 128-bit halves; the permute puts them back in order. */
        const __m256i w16 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        const __m256i bytes = _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, bytes);
        lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
    } else {
        /* packs of x0..7 and x16..23 give x0..3, x16..19 | x4..7, x20..23; the permute makes it x0..7,
         * x16..23 (unpacked); of x0..7 and x8..15, x0..15 (natural). */
        const int second = natural ? 1 : 2;
        const __m256i r0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[second]), 0xD8);
        const __m256i r1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[3 - second], c[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)q, r0);
        _mm256_storeu_si256((__m256i *)q + 1, r1);
        const __m256i ones = _mm256_set1_epi16(1);
        lanes = _mm256_add_epi32(_mm256_madd_epi16(r0, ones), _mm256_madd_epi16(r1, ones));
    }
    _mm256_storeu_si256((__m256i *)lane, lanes);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    *d = dx;
    return _mm_cvtsi128_si32(s);
}
#define int_block int_block_avx2
#else
#define int_block int_block_scalar
#endif

/* x quantized, one row after the other: q [k] codes (int8_t or int16_t); per block: dx and
 * sx = dx * (float)(sum of its q); per lane of 4: ol = offset * (sum of the lane's q) (what unsigned
 * codes add to P). */
typedef struct {
    void *q;
    float *dx, *sx;
    int32_t *ol;
} qx_t;

static void free_x(qx_t *qx) {
    free(qx->q);
    free(qx->dx);
    free(qx->sx);
    free(qx->ol);
}

/* x [rows, k] quantized to `bits` (8 or 16; `natural`: the 16-bit layout) into `out` (free_x frees it;
 * -1 when memory runs out). `offset`: the format's code offset, for ol. `portable`: round with the
 * portable code (the GEMV's portable path does, so that the paths' bit-equality test covers the
 * rounding too). `paired` (16 bits): each row's blocks b, b + 1 (b even) laid out as the 512-bit path
 * reads them, codes 0-15 of b, of b + 1, then 16-31 of b, of b + 1 (int_blocks_avx512.h). */
static int quantize_x(const float *x, int64_t rows, int64_t k, int bits, int natural, int offset, int portable,
                      int paired, qx_t *out) {
    const int64_t blocks = rows * k / ACT_BLOCK;
    /* On 64 bytes: the GEMV loads x's codes 32 bytes at a time, and malloc's 16-byte alignment made
     * half of those loads cross a cache line (16-bit Q4_K, one thread, in L1: 4.1 against 4.25 cycles a
     * block of 32, AMD EPYC with AVX2 only). */
    const size_t qbytes = (size_t)(rows * k) * (size_t)(bits / 8);
    out->q = aligned_alloc(64, (qbytes + 63) / 64 * 64);
    out->dx = malloc(sizeof(float) * (size_t)blocks);
    out->sx = malloc(sizeof(float) * (size_t)blocks);
    out->ol = malloc(sizeof(int32_t) * (size_t)blocks * 8);
    if (!out->q || !out->dx || !out->sx || !out->ol) return -1;
    for (int64_t b = 0; b < blocks; b++) {
        int32_t *lane = out->ol + b * 8;
        void *q = (char *)out->q + b * ACT_BLOCK * (bits / 8);
        const int sum = portable ? int_block_scalar(bits, natural, x + b * ACT_BLOCK, q, &out->dx[b], lane)
                                 : int_block(bits, natural, x + b * ACT_BLOCK, q, &out->dx[b], lane);
        for (int l = 0; l < 8; l++) lane[l] *= offset;
        out->sx[b] = out->dx[b] * (float)sum;
    }
    if (paired && bits == 16)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b + 1 < k / ACT_BLOCK; b += 2) { /* swap b's codes 16-31 and b + 1's 0-15 */
                int16_t *q = (int16_t *)out->q + r * k + b * ACT_BLOCK, t[16];
                memcpy(t, q + 16, sizeof t);
                memcpy(q + 16, q + 32, sizeof t);
                memcpy(q + 32, t, sizeof t);
            }
    return 0;
}
#endif
