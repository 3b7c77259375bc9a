/* y = x W^T + b for a few rows of fp32 activations against weights stored compactly: bf16, or the
 * GGUF block formats Q8_0, Q4_0 and Q4_1.
 *
 * Why: at decode batch sizes of one to a few requests a matmul is bound by reading its weights.
 * An fp32 model upcasts bf16 checkpoints at load (2x the bytes) and de-quantizes GGUF files (6x
 * for Q4_1). When the fp32 weights are exactly what the compact form expands to, reading the
 * compact form and expanding each weight row in registers gives the fp32 matmul's result (up to
 * summation order) from a fraction of the bytes. Larger batches are compute-bound: oneDNN keeps them.
 *
 * Exactness of the expansion (checked again at load against the fp32 weights): fp16 -> fp32 and
 * small integers -> fp32 are exact; d * q needs at most 11 + 8 significant bits, so it is exact
 * too, and Q4_1's d * q + m is rounded once whether or not the compiler fuses it into an FMA.
 *
 * Layout: x [rows, k] fp32; w [n, row_bytes] (one weight row per line, blocks of 32 along k for the
 * GGUF formats); b [n] fp32 or NULL; y [rows, n] fp32. Weight rows are split over the caller's
 * OpenMP threads; each block of a row is expanded in registers and used by up to 4 rows of x at once.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

enum { FMT_BF16 = 0, FMT_Q8_0 = 1, FMT_Q4_0 = 2, FMT_Q4_1 = 3 };


static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign; /* zero */
    } else { /* subnormal: value = man * 2^-24, exact in fp32 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Bytes to floats. GCC's generic vector conversion widens bytes one lane at a time, so x86 gets the
 * widening instructions by name; other CPUs a plain loop. */
#if defined(__AVX2__)
/* The 32 nibbles of a Q4 block's 16 bytes: low nibbles are elements 0-15, high ones 16-31. */
static inline void q4_f(const uint8_t *qs, v8f w[4]) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
    w[0] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
    w[2] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = (v8f)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
}
static inline v8f s8x8_f(const uint8_t *p) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline void q4_f(const uint8_t *qs, v8f w[4]) {
    for (int i = 0; i < 16; i++) {
        w[i / 8][i % 8] = (float)(qs[i] & 0x0F);
        w[2 + i / 8][i % 8] = (float)(qs[i] >> 4);
    }
}
static inline v8f s8x8_f(const uint8_t *p) {
    v8f v;
    for (int i = 0; i < 8; i++) v[i] = (float)(int8_t)p[i];
    return v;
}
#endif

/* Weights blk*32 .. blk*32+31 of one row, expanded into four vectors of 8. */
static inline void expand_block(const uint8_t *row, int fmt, int64_t blk, v8f w[4]) {
    if (fmt == FMT_BF16) {
        const uint16_t *p = (const uint16_t *)row + blk * 32;
        for (int j = 0; j < 4; j++) w[j] = load8_bf16(p + 8 * j);
    } else if (fmt == FMT_Q8_0) { /* fp16 d, 32 x int8: q * d */
        const uint8_t *p = row + blk * 34;
        const v8f d = splat8(fp16_to_f32(p));
        for (int j = 0; j < 4; j++) w[j] = s8x8_f(p + 2 + 8 * j) * d;
    } else { /* Q4_0: fp16 d, 16 bytes, (q - 8) * d;  Q4_1: fp16 d, fp16 m, 16 bytes, q * d + m.
              * Element j is the low nibble of byte j, element 16 + j the high nibble. */
        const int q41 = fmt == FMT_Q4_1;
        const uint8_t *p = row + blk * (q41 ? 20 : 18);
        const v8f d = splat8(fp16_to_f32(p));
        q4_f(p + (q41 ? 4 : 2), w);
        if (q41) {
            const v8f m = splat8(fp16_to_f32(p + 2));
            for (int j = 0; j < 4; j++) w[j] = w[j] * d + m;
        } else {
            for (int j = 0; j < 4; j++) w[j] = (w[j] - splat8(8.f)) * d;
        }
    }
}

/* y[r, j] for up to 4 rows r of x and one weight row j: each block is expanded once, in registers,
 * and used by every row. */
static inline void rows_dot(const float *x, const uint8_t *wrow, int fmt, const float *b, float *y, int64_t m0,
                            int mr, int64_t k, int64_t n, int64_t j) {
    v8f acc[4][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = splat8(0.f);
    const int64_t blocks = k / 32;
    for (int64_t blk = 0; blk < blocks; blk++) {
        v8f w[4];
        expand_block(wrow, fmt, blk, w);
        for (int r = 0; r < mr; r++) {
            const float *xr = x + (m0 + r) * k + blk * 32;
            acc[r][0] += load8_f32(xr) * w[0] + load8_f32(xr + 16) * w[2];
            acc[r][1] += load8_f32(xr + 8) * w[1] + load8_f32(xr + 24) * w[3];
        }
    }
    for (int r = 0; r < mr; r++) {
        float s = hsum8(acc[r][0] + acc[r][1]);
        if (fmt == FMT_BF16) /* bf16 rows need only be a multiple of 8 long */
            for (int64_t i = blocks * 32; i < k; i++) s += x[(m0 + r) * k + i] * ld_bf16((const uint16_t *)wrow + i);
        y[(m0 + r) * n + j] = s + (b ? b[j] : 0.f);
    }
}

void gemv_compact_f32(const float *x, const uint8_t *w, int64_t row_bytes, int fmt, const float *b, float *y,
                      int64_t rows, int64_t k, int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *src = w + j * row_bytes;
        /* The next row is read while this one is used: the hardware prefetcher does not cross the
         * page boundaries that long rows span. */
        if (j + 1 < n) prefetch_row(src + row_bytes, row_bytes);
        for (int64_t m = 0; m < rows; m += 4) {
            switch (rows - m < 4 ? rows - m : 4) {
                case 1: rows_dot(x, src, fmt, b, y, m, 1, k, n, j); break;
                case 2: rows_dot(x, src, fmt, b, y, m, 2, k, n, j); break;
                case 3: rows_dot(x, src, fmt, b, y, m, 3, k, n, j); break;
                default: rows_dot(x, src, fmt, b, y, m, 4, k, n, j); break;
            }
        }
    }
}
