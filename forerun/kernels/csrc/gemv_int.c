/* y = x W^T for a few rows, with x rounded to 8- or 16-bit integers per block of 32, against GGUF
 * blocks as the file stores them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and the K-quants Q3_K, Q4_K,
 * Q5_K, Q6_K. This is the engine's `activation_bits` setting (16 or 8; 32 runs gemv_kquant.c).
 *
 * Why: at one decode row the fp32 block GEMV (gemv_kquant.c) is bound by expanding each weight to
 * fp32, not by reading it. Here the weight's small integer codes multiply x's codes in integers, and
 * floats appear once per 4 weights. 8 bits is llama.cpp's choice (AVX-512 VNNI's vpdpbusd: 64 products
 * an instruction; AVX2's vpmaddubsw): y is within about 2^-8 of fp32 `x @ W.T`, relative to the sizes
 * of the terms, which changes a small model's answers. 16 bits (vpmaddwd over the codes widened to 16
 * bits) is within about 2^-16, far closer than bf16 activations, and costs the widening and an add
 * more per 32 weights.
 *
 * Arithmetic, the same on both paths (portable; AVX2, with AVX-512 VNNI's dot product for 8 bits where
 * the CPU has it), so the paths are bit-equal:
 * - x, per block of 32: dx = max|x| / top (127 or 32767), q = x * (1 / dx) rounded to the nearest
 *   integer, ties to even (dx = 0: q = 0) (int_activations.h).
 * - The 32 weights x's block meets are two runs of 16 (gguf_blocks.h), each with its map w = a s + b,
 *   s the weight's signed integer; they are 8 lanes of 4 weights (8 bits: 4 consecutive ones; 16 bits:
 *   as int_activations.h lays them out, the natural layout for the formats natural16 names, whose map
 *   covers all 32 weights, and the unpacked one elsewhere, whose lanes 0-3 are the first run and 4-7
 *   the second, as with 8 bits), and a lane's integer P = sum of s q over its 4 weights is exact.
 * - Each output keeps 16 fp32 lanes: x's block b goes to lanes 0-7 when b is even, 8-15 when odd
 *   (two chains, so consecutive blocks do not wait on each other's add). A lane adds
 *   fma((float)P, a * dx, acc), a its run's scale. The 16 lanes are added as sum_tree.h's fixed tree.
 * - The formats with a minimum (Q4_1, Q5_1, Q4_K, Q5_K: one b for the 32 weights) also add
 *   b * dx * (sum of the block's 32 q), each as fma(b, dx * (float)sum, s) in block order into one of
 *   several fp32 sums. Q4_1 / Q5_1: two sums, even and odd blocks; y = tree + (s_even + s_odd).
 *   Q4_K / Q5_K: eight, one per sub-block of the super-block (the AVX2 path adds a super-block's 8
 *   terms with one vector fma); y = tree + the 8 sums added as sum_tree.h's tree8.
 * The order depends on nothing but k, so a row's result does not depend on the other rows.
 *
 * How each format's blocks decode and meet x's codes is int_blocks.h; the row loops and threads are here.
 *
 * x [rows, k] fp32; w [n, stride] bytes (rows of blocks of 32 or 256 weights); y [rows, n], rows
 * ldy apart. Weight rows are split over the caller's OpenMP threads; each weight row is decoded once
 * for up to 4 rows of x. The AVX2 path works on 256-bit vectors: 32 weights are one register. Where
 * the CPU has AVX-512 BW and VNNI, a 512-bit path takes two blocks a register with the same
 * arithmetic (int_blocks_avx512.h).
 */
#include "int_blocks_avx512.h"

enum { LANES = 16, WROWS = 3, WROWS_MAX_K = 2048 };
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif

/* Portable path: one weight row against every row of x. */
static void gemv_scalar(int fmt, int bits, const qx_t *qx, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                        int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int bs = block_bytes(fmt), per = block_weights(fmt) / QK, nb = (int)(k / QK);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < rows; r++) {
            float acc[LANES] = {0.f}, ms[8] = {0.f}, a[16], bm[16];
            for (int b = 0; b < nb; b++) { /* x's block b: weights 32 (b % per) .. of weight block b / per */
                const uint8_t *blk = w + j * stride + (int64_t)(b / per) * bs;
                const int v = 2 * (b % per);
                const int64_t at = (r * k + (int64_t)b * QK) * (bits / 8);
                const int8_t *q8 = (const int8_t *)((const char *)qx->q + at);
                const int16_t *q16 = (const int16_t *)((const char *)qx->q + at);
                const float dx = qx->dx[r * nb + b];
                int32_t c[32];
                if (b % per == 0) block_maps(fmt, blk, a, bm); /* once a weight block */
                ints16(fmt, blk, v, c);
                ints16(fmt, blk, v + 1, c + 16);
                int32_t lp[8] = {0};
                for (int i = 0; i < 32; i++) {
                    if (bits == 8) lp[i / 4] += c[i] * q8[i];
                    else lp[q16_lane(natural16(fmt), i)] += c[i] * q16[q16_pos(natural16(fmt), i)];
                }
                for (int l = 0; l < 8; l++) {
                    const int32_t p = lp[l];
                    const float scale = a[map_of(fmt, v + l / 4)] * dx;
                    acc[8 * (b & 1) + l] = fmaf((float)p, scale, acc[8 * (b & 1) + l]);
                }
                const int chain = per == 1 ? b & 1 : b % per;
                if (has_min(fmt)) ms[chain] = fmaf(bm[map_of(fmt, v)], qx->sx[r * nb + b], ms[chain]);
            }
            y[r * ldy + j] = finish(fmt, tree16(acc), ms);
        }
}

#if defined(__AVX2__) && defined(__FMA__)
/* One weight row against RB rows of x; out[r] its output. */
static inline __attribute__((always_inline)) void row_avx2(int fmt, int bits, int RB, const qx_t *qx, const int64_t xr[],
                                                           const uint8_t *wrow, int64_t k, float out[]) {
    const int bs = block_bytes(fmt);
    const int64_t nb = k / QK;
    __m256 acc[TILE][2], scale[TILE];
    float ms[TILE][8];
    for (int r = 0; r < RB; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int l = 0; l < 8; l++) ms[r][l] = 0.f;
    }
    if (block_weights(fmt) == QK) {
        /* Even and odd blocks in turn, so that each names its chain at compile time (a chain picked at
         * run time is kept in memory, and every add then waits on a store). */
        for (int64_t b = 0; b < nb; b += 2) {
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                if (b + h >= nb) break;
                const uint8_t *blk = wrow + (b + h) * bs;
                /* Weights stream from memory: ask for them PREFETCH_AHEAD bytes early (past the row's end
                 * this is the next row, which this thread takes next; a prefetch never faults). */
                _mm_prefetch((const char *)blk + PREFETCH_AHEAD, _MM_HINT_T0);
                const float d = half(blk);
                for (int r = 0; r < RB; r++) {
                    const int64_t at = xr[r] * nb + b + h;
                    scale[r] = _mm256_set1_ps(d * qx->dx[at]);
                    if (has_min(fmt)) ms[r][h] = fmaf(half(blk + 2), qx->sx[at], ms[r][h]);
                }
                add_block_avx2(fmt, bits, RB, qx, xr, nb, b + h, blk, 0, scale, h, acc);
            }
        }
    } else {
        __m256 msv[TILE];
        for (int r = 0; r < RB; r++) msv[r] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb / 8; sb++) { /* super-blocks of 256: x's blocks 8 sb .. 8 sb + 7 */
            const uint8_t *blk = wrow + sb * bs;
            for (int o = 0; o < bs; o += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + o, _MM_HINT_T0);
            superblock_avx2(fmt, bits, RB, qx, xr, nb, sb, blk, acc, msv);
        }
        for (int r = 0; r < RB; r++) _mm256_storeu_ps(ms[r], msv[r]);
    }
    for (int r = 0; r < RB; r++) out[r] = finish(fmt, tree8_avx(_mm256_add_ps(acc[r][0], acc[r][1])), ms[r]);
}

/* One row of x against WR adjacent weight rows (stride apart): each output's arithmetic is row_avx2's
 * with one row of x. Why: over short rows (SmolLM2's 576 inputs: 18 blocks) a weight row's setup and
 * final sum cost ~25 cycles its blocks did not hide; three rows of 32-weight blocks interleave them and
 * share x's loads (one thread, 3072 x 576 in cache, cycles a 8 weights, AMD EPYC with AVX2: Q4_1 1.64
 * -> 1.37, Q8_0 1.35 -> 0.98, Q5_0 2.07 -> 1.80, Q4_0 1.50 -> 1.17; 256 x 8192 unchanged). Their bytes
 * are one run, fetched ahead as one stream (a prefetch a row was slower from memory). The K-quants take
 * one row (two or three ran out of registers: Q4_K 2048 x 2048 1.30 and 1.23 against 1.19), which, x's
 * row a constant, still beats row_avx2 (1.14-1.18 against 1.20-1.25). */
static inline __attribute__((always_inline)) void wrows_avx2(int fmt, int bits, int WR, const qx_t *qx,
                                                             const uint8_t *w0, int64_t stride, int64_t k,
                                                             float out[]) {
    const int bs = block_bytes(fmt);
    const int64_t nb = k / QK, xr[1] = {0};
    __m256 acc[WROWS][2];
    float ms[WROWS][8];
    for (int r = 0; r < WR; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int l = 0; l < 8; l++) ms[r][l] = 0.f;
    }
    if (block_weights(fmt) != QK) {
        __m256 msv[WROWS];
        for (int r = 0; r < WR; r++) msv[r] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            for (int o = 0; o < WR * bs; o += 64)
                _mm_prefetch((const char *)w0 + PREFETCH_AHEAD + sb * WR * bs + o, _MM_HINT_T0);
            for (int r = 0; r < WR; r++)
                superblock_avx2(fmt, bits, 1, qx, xr, nb, sb, w0 + r * stride + sb * bs, acc + r, msv + r);
        }
        for (int r = 0; r < WR; r++) _mm256_storeu_ps(ms[r], msv[r]);
    } else for (int64_t b = 0; b < nb; b += 2) {
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) { /* chains named at compile time, as in row_avx2 */
            const int64_t at = b + h;
            if (at >= nb) break;
            for (int o = 0; o < WR * bs; o += 64)
                _mm_prefetch((const char *)w0 + PREFETCH_AHEAD + at * WR * bs + o, _MM_HINT_T0);
            for (int r = 0; r < WR; r++) {
                const uint8_t *blk = w0 + r * stride + at * bs;
                const __m256 scale = _mm256_set1_ps(half(blk) * qx->dx[at]);
                if (has_min(fmt)) ms[r][h] = fmaf(half(blk + 2), qx->sx[at], ms[r][h]);
                add_block_avx2(fmt, bits, 1, qx, xr, nb, at, blk, 0, &scale, h, acc + r);
            }
        }
    }
    for (int r = 0; r < WR; r++) out[r] = finish(fmt, tree8_avx(_mm256_add_ps(acc[r][0], acc[r][1])), ms[r]);
}
#endif

/* Calls ROW with the format and the tile's row count as compile-time constants (one specialized copy
 * of the inner loop each). Only this file's formats reach it. */
#define ROW_RB(ROW, F, rb, ...) \
    (rb == 1 ? ROW(F, 1, __VA_ARGS__) : rb == 2 ? ROW(F, 2, __VA_ARGS__) : rb == 3 ? ROW(F, 3, __VA_ARGS__) \
             : ROW(F, 4, __VA_ARGS__))
#define ROW_FMT(ROW, fmt, rb, ...)                                                              \
    do {                                                                                        \
        switch (fmt) {                                                                          \
            case GGML_Q4_0: { enum { F = GGML_Q4_0 }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q4_1: { enum { F = GGML_Q4_1 }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q5_0: { enum { F = GGML_Q5_0 }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q5_1: { enum { F = GGML_Q5_1 }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q8_0: { enum { F = GGML_Q8_0 }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_IQ4_NL: { enum { F = GGML_IQ4_NL }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q3_K: { enum { F = GGML_Q3_K }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q4_K: { enum { F = GGML_Q4_K }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            case GGML_Q5_K: { enum { F = GGML_Q5_K }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break; \
            default: { enum { F = GGML_Q6_K }; ROW_RB(ROW, F, rb, __VA_ARGS__); } break;        \
        }                                                                                       \
    } while (0)

#if defined(__AVX2__) && defined(__FMA__)
/* row_avx2 with the activations' width a compile-time constant too. */
#define row8_avx2(F, RB, ...) row_avx2(F, 8, RB, __VA_ARGS__)
#define row16_avx2(F, RB, ...) row_avx2(F, 16, RB, __VA_ARGS__)

/* wrows_avx2 with WR a compile-time constant for the formats of 32 weights a block, one for the K-quants. */
#define WROWS_FMT(bits, WR, fmt, ...)                                                                   \
    do {                                                                                             \
        switch (fmt) {                                                                               \
            case GGML_Q4_0: wrows_avx2(GGML_Q4_0, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q4_1: wrows_avx2(GGML_Q4_1, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q5_0: wrows_avx2(GGML_Q5_0, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q5_1: wrows_avx2(GGML_Q5_1, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q8_0: wrows_avx2(GGML_Q8_0, bits, WR, __VA_ARGS__); break;                     \
            case GGML_IQ4_NL: wrows_avx2(GGML_IQ4_NL, bits, WR, __VA_ARGS__); break;                 \
            case GGML_Q3_K: wrows_avx2(GGML_Q3_K, bits, 1, __VA_ARGS__); break;                      \
            case GGML_Q4_K: wrows_avx2(GGML_Q4_K, bits, 1, __VA_ARGS__); break;                      \
            case GGML_Q5_K: wrows_avx2(GGML_Q5_K, bits, 1, __VA_ARGS__); break;                      \
            default: wrows_avx2(GGML_Q6_K, bits, 1, __VA_ARGS__); break;                             \
        }                                                                                            \
    } while (0)

/* One row of x: weight rows WROWS at a time (K-quants: one) over the threads. For rows of up to
 * WROWS_MAX_K weights: over longer ones from memory (2048 x 8192 Q8_0) the one stream lost. */
static void gemv_one_row(int fmt, int bits, const qx_t *qx, const uint8_t *w, int64_t stride, float *y, int64_t k,
                         int64_t n, int nthreads) {
    const int64_t wr = block_weights(fmt) == QK ? WROWS : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j += wr) {
        if (j + wr <= n && bits == 8) WROWS_FMT(8, WROWS, fmt, qx, w + j * stride, stride, k, y + j);
        else if (j + wr <= n) WROWS_FMT(16, WROWS, fmt, qx, w + j * stride, stride, k, y + j);
        else
            for (int64_t r = j; r < n; r++) { /* the last rows, one at a time */
                if (bits == 8) WROWS_FMT(8, 1, fmt, qx, w + r * stride, stride, k, y + r);
                else WROWS_FMT(16, 1, fmt, qx, w + r * stride, stride, k, y + r);
            }
    }
}

/* The vector path: weight rows over the threads, each against the rows of x TILE at a time. */
static void gemv_vector(int fmt, int bits, const qx_t *qx, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                        int64_t rows, int64_t k, int64_t n, int nthreads) {
    if (rows == 1 && k <= WROWS_MAX_K) {
        gemv_one_row(fmt, bits, qx, w, stride, y, k, n, nthreads);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int rb = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            int64_t xr[TILE] = {0};
            float out[TILE] = {0.f};
            for (int r = 0; r < rb; r++) xr[r] = r0 + r;
            if (bits == 8) ROW_FMT(row8_avx2, fmt, rb, qx, xr, w + j * stride, k, out);
            else ROW_FMT(row16_avx2, fmt, rb, qx, xr, w + j * stride, k, out);
            for (int r = 0; r < rb; r++) y[(r0 + r) * ldy + j] = out[r];
        }
}
#endif

#if defined(HAVE_INT512)
/* WR adjacent weight rows (stride apart) against RB rows of x: out[w * RB + r]. Each output's
 * arithmetic is row_avx2's. WR > 1 with RB = 1 over short rows of 32-weight blocks (wrows_avx2's
 * reason); RB > 1 with WR = 1 for a few rows of x. */
static inline __attribute__((always_inline)) void tile_avx512(int fmt, int bits, int WR, int RB, const qx_t *qx,
                                                              const int64_t xr[], const uint8_t *w0, int64_t stride,
                                                              int64_t k, float out[]) {
    const int bs = block_bytes(fmt);
    const int64_t nb = k / QK;
    __m512 acc[WROWS * TILE];
    float ms[WROWS * TILE][8];
    for (int i = 0; i < WR * RB; i++) {
        acc[i] = _mm512_setzero_ps();
        for (int l = 0; l < 8; l++) ms[i][l] = 0.f;
    }
    if (block_weights(fmt) != QK) {
        __m256 msv[WROWS * TILE];
        for (int i = 0; i < WR * RB; i++) msv[i] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb / 8; sb++)
            for (int w = 0; w < WR; w++) {
                const uint8_t *blk = w0 + w * stride + sb * bs;
                for (int o = 0; o < bs; o += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + o, _MM_HINT_T0);
                superblock_avx512(fmt, bits, RB, qx, xr, nb, sb, blk, acc + w * RB, msv + w * RB);
            }
        for (int i = 0; i < WR * RB; i++) _mm256_storeu_ps(ms[i], msv[i]);
    } else {
        for (int64_t b = 0; b + 1 < nb; b += 2) {
            /* the WR rows' bytes as one stream, as wrows_avx2 fetches them */
            for (int o = 0; o < 2 * WR * bs; o += 64)
                _mm_prefetch((const char *)w0 + PREFETCH_AHEAD + b * WR * bs + o, _MM_HINT_T0);
            for (int w = 0; w < WR; w++) {
                const uint8_t *b0 = w0 + w * stride + b * bs, *b1 = b0 + bs;
                const float d0 = half(b0), d1 = half(b1);
                __m512 scale[TILE];
                for (int r = 0; r < RB; r++) {
                    const int64_t at = xr[r] * nb + b;
                    scale[r] = _mm512_insertf32x8(_mm512_set1_ps(d0 * qx->dx[at]), _mm256_set1_ps(d1 * qx->dx[at + 1]), 1);
                    if (has_min(fmt)) {
                        float *m = ms[w * RB + r];
                        m[0] = fmaf(half(b0 + 2), qx->sx[at], m[0]);
                        m[1] = fmaf(half(b1 + 2), qx->sx[at + 1], m[1]);
                    }
                }
                add_pair_avx512(fmt, bits, RB, qx, xr, nb, b, b0, b1, 0, scale, acc + w * RB);
            }
        }
        if (nb % 2) /* the last block (even: chain 0) alone, on the AVX2 code */
            for (int w = 0; w < WR; w++) {
                const uint8_t *blk = w0 + w * stride + (nb - 1) * bs;
                for (int r = 0; r < RB; r++) {
                    const int64_t at = xr[r] * nb + nb - 1;
                    const __m256 scale = _mm256_set1_ps(half(blk) * qx->dx[at]);
                    float *m = ms[w * RB + r];
                    if (has_min(fmt)) m[0] = fmaf(half(blk + 2), qx->sx[at], m[0]);
                    __m256 halves[1][2] = {{_mm512_castps512_ps256(acc[w * RB + r]), _mm512_extractf32x8_ps(acc[w * RB + r], 1)}};
                    add_block_avx2(fmt, bits, 1, qx, xr + r, nb, nb - 1, blk, 0, &scale, 0, halves);
                    acc[w * RB + r] = _mm512_insertf32x8(_mm512_castps256_ps512(halves[0][0]), halves[0][1], 1);
                }
            }
    }
    for (int i = 0; i < WR * RB; i++)
        out[i] = finish(fmt, tree8_avx(_mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1))),
                        ms[i]);
}

/* tile_avx512 with the format, the activations' width and the tile's shape compile-time constants. */
#define TILE512(F, RB, bits, ...) tile_avx512(F, bits, 1, RB, __VA_ARGS__)
#define WROWS512(F, WR, bits, ...) tile_avx512(F, bits, WR, 1, __VA_ARGS__)
#define BITS512(TILE_OF, fmt, n, bits, ...)                                                  \
    do {                                                                                     \
        if (bits == 8) ROW_FMT(TILE_OF, fmt, n, 8, __VA_ARGS__);                             \
        else ROW_FMT(TILE_OF, fmt, n, 16, __VA_ARGS__);                                      \
    } while (0)

/* The 512-bit path: as gemv_vector, one row of x over rows of up to WROWS_MAX_K weights taking WROWS
 * weight rows at a time (K-quants: one; two to four measured the same, one thread with the row in L2
 * and two from memory, Q4_K 2048 x 256 and 2048 x 8192, AMD EPYC with avx512_bf16). */
static void gemv_avx512(int fmt, int bits, const qx_t *qx, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                        int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int64_t wr = rows == 1 && k <= WROWS_MAX_K && block_weights(fmt) == QK ? WROWS : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j += wr) {
        if (wr > 1) {
            const int64_t xr[1] = {0};
            if (j + wr <= n) BITS512(WROWS512, fmt, wr, bits, qx, xr, w + j * stride, stride, k, y + j);
            else
                for (int64_t r = j; r < n; r++) BITS512(WROWS512, fmt, 1, bits, qx, xr, w + r * stride, stride, k, y + r);
            continue;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int rb = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            int64_t xr[TILE] = {0};
            float out[TILE] = {0.f};
            for (int r = 0; r < rb; r++) xr[r] = r0 + r;
            BITS512(TILE512, fmt, rb, bits, qx, xr, w + j * stride, stride, k, out);
            for (int r = 0; r < rb; r++) y[(r0 + r) * ldy + j] = out[r];
        }
    }
}
#endif

/* Bit i set when path i (ISA_SCALAR, ISA_AVX2, ISA_AVX512) was built; the AVX2 path uses AVX-512
 * VNNI's 256-bit dot product for 8-bit activations where the CPU has it. */
int gemv_int_isas_f32(void) {
    int isas = 1 << ISA_SCALAR;
#if defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX2;
#endif
#if defined(HAVE_INT512)
    isas |= 1 << ISA_AVX512;
#endif
    return isas;
}

/* y [rows, n] (rows ldy apart) = x [rows, k], rounded to `bits` (8 or 16) a value, W^T. `isa`:
 * ISA_BEST or one path. Returns 0; -1 for a format this file lacks, bits not 8 or 16, or a k / stride /
 * ldy that does not fit; -2 for a path not built; -3 when memory for quantized x runs out. */
int gemv_int_strided_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, int bits, float *y, int64_t ldy,
                         int64_t rows, int64_t k, int64_t n, int isa, int nthreads) {
    if (!int_format(fmt) || (bits != 8 && bits != 16) || !rows_fit(fmt, k, stride) || rows < 0 || n < 0 || ldy < n)
        return -1;
    isa = path_of(isa, gemv_int_isas_f32());
    if (isa < 0) return -2;
    if (rows == 0 || n == 0) return 0;
    qx_t qx;
    if (quantize_x(x, rows, k, bits, natural16(fmt), code_offset(fmt), isa == ISA_SCALAR, isa == ISA_AVX512, &qx) != 0) {
        free_x(&qx);
        return -3;
    }
#if defined(HAVE_INT512)
    if (isa == ISA_AVX512) gemv_avx512(fmt, bits, &qx, w, stride, y, ldy, rows, k, n, nthreads);
    else
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (isa == ISA_AVX2) gemv_vector(fmt, bits, &qx, w, stride, y, ldy, rows, k, n, nthreads);
    else
#endif
        gemv_scalar(fmt, bits, &qx, w, stride, y, ldy, rows, k, n, nthreads);
    free_x(&qx);
    return 0;
}

/* y [rows, n] = x [rows, k] rounded to `bits`, W^T, y contiguous. */
int gemv_int_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, int bits, float *y, int64_t rows,
                 int64_t k, int64_t n, int isa, int nthreads) {
    return gemv_int_strided_f32(x, w, stride, fmt, bits, y, n, rows, k, n, isa, nthreads);
}
