/* y [rows, n] = x [rows, k] W^T in fp32 for many rows over GGUF blocks as stored, summed in exactly the
 * order of the block GEMV (gemv_kquant.c), so a row's result is that kernel's bit for bit.
 *
 * Why: a row's result must not depend on how many rows share the call (batch invariance), and one
 * user must not pay for that. The GEMV is the fastest kernel at one row; its order is: each output
 * keeps 16 lanes, lane l adds w[k] x[k] for k = l mod 16 in increasing k with one fma each, and the
 * lanes are added as the fixed tree of sum_tree.h. At many rows the GEMV would expand each block again
 * for every few rows of x, so this kernel expands a tile of weight rows once a call into a
 * cache-resident fp32 buffer (expand_f32.h: gguf's exact values, as the GEMV's registers hold them)
 * and runs that same order over it for every row of x: the GEMV at one row and this kernel at 64 give
 * the same bits.
 *
 * Work split: each of the caller's OpenMP threads owns a contiguous range of output columns (weight
 * rows) in multiples of SPAN; it walks the range in tiles of SPAN to 2 SPAN weight rows (about
 * 192 KiB expanded: L2). Within a tile, NC weight rows at a time (in L1) meet every row of x, RB rows
 * at a time, each output's 16 lanes in one register (AVX2: two) over the whole of k. x is read as
 * given, row-major; rows are taken CHUNK at a time so a chunk of x and the tile share L2.
 *
 * x [rows, k] fp32; w [n, stride] bytes (each row k / block weights blocks); y [rows, n] fp32 (rows ldy
 * apart).
 */
#include <omp.h>
#include <stdlib.h>

#include "expand_f32.h"
#include "gguf_blocks.h"
#include "sum_tree.h"

enum {
    TILE_BYTES = 192 * 1024, /* expanded weights a tile holds */
    SPAN = 48,               /* columns go to threads and tiles in multiples of this (of every NC) */
    CHUNK = 64,              /* rows of x that meet a tile's weight rows before the next rows do */
    NC512 = 6, RB512 = 4,    /* AVX-512 register block: 24 accumulators */
    NC256 = 3, RB256 = 2,    /* AVX2 register block: 12 accumulator pairs */
    NC_MOST = 6, RB_MOST = 4
};
_Static_assert(SPAN % NC512 == 0 && SPAN % NC256 == 0, "a span holds whole register blocks");

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* Weight rows a tile expands: a multiple of SPAN, SPAN .. 2 SPAN. */
static int64_t tile_cols(int64_t k) {
    const int64_t fit = TILE_BYTES / (k * 4) / SPAN * SPAN;
    return fit < SPAN ? SPAN : fit > 2 * SPAN ? 2 * SPAN : fit;
}

/* ---- Register blocks: out[r][c] = x row r . weight row c, in the GEMV's order ---------------------- */

static void block_scalar(int rb, int nc, const float *const xr[], const float *const wt[], int64_t k,
                         float out[RB_MOST][NC_MOST]) {
    for (int r = 0; r < rb; r++)
        for (int c = 0; c < nc; c++) {
            float acc[16] = {0.f};
            for (int64_t i = 0; i < k; i += 16)
                for (int l = 0; l < 16; l++) acc[l] = fmaf(wt[c][i + l], xr[r][i + l], acc[l]);
            out[r][c] = tree16(acc);
        }
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void block_avx2(int RB, const float *const xr[], const float *const wt[],
                                                             int64_t k, float out[RB_MOST][NC_MOST]) {
    __m256 acc[RB256][NC256][2];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC256; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 16)
        for (int h = 0; h < 2; h++) {
            __m256 xv[RB256];
            for (int r = 0; r < RB; r++) xv[r] = _mm256_loadu_ps(xr[r] + i + 8 * h);
            for (int c = 0; c < NC256; c++) {
                const __m256 wv = _mm256_load_ps(wt[c] + i + 8 * h);
                for (int r = 0; r < RB; r++) acc[r][c][h] = _mm256_fmadd_ps(wv, xv[r], acc[r][c][h]);
            }
        }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC256; c++) out[r][c] = tree8_avx(_mm256_add_ps(acc[r][c][0], acc[r][c][1]));
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) void block_avx512(int RB, const float *const xr[], const float *const wt[],
                                                               int64_t k, float out[RB_MOST][NC_MOST]) {
    __m512 acc[RB512][NC512];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC512; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
        __m512 xv[RB512];
        for (int r = 0; r < RB; r++) xv[r] = _mm512_loadu_ps(xr[r] + i);
        for (int c = 0; c < NC512; c++) {
            const __m512 wv = _mm512_load_ps(wt[c] + i);
            for (int r = 0; r < RB; r++) acc[r][c] = _mm512_fmadd_ps(wv, xv[r], acc[r][c]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC512; c++) {
            const __m256 lo = _mm512_castps512_ps256(acc[r][c]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
            out[r][c] = tree8_avx(_mm256_add_ps(lo, hi));
        }
}
#endif

/* One register block of `rb` rows (rb <= the path's RB) by the path's NC weight rows. */
static void run_block(int isa, int rb, const float *const xr[], const float *const wt[], int64_t k,
                      float out[RB_MOST][NC_MOST]) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (isa == ISA_AVX512) {
        switch (rb) { /* the row count as a constant: one unrolled copy each */
            case 1: block_avx512(1, xr, wt, k, out); return;
            case 2: block_avx512(2, xr, wt, k, out); return;
            case 3: block_avx512(3, xr, wt, k, out); return;
            default: block_avx512(RB512, xr, wt, k, out); return;
        }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (isa == ISA_AVX2) {
        if (rb == 1) block_avx2(1, xr, wt, k, out);
        else block_avx2(RB256, xr, wt, k, out);
        return;
    }
#endif
    block_scalar(rb, NC512, xr, wt, k, out);
}

/* ---- The driver ------------------------------------------------------------------------------------ */

/* Columns j0 .. j1 - 1 (clipped to n at the store) of y, tile by tile. */
static void thread_columns(int isa, int fmt, const float *x, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                           int64_t rows, int64_t k, int64_t n, int64_t j0, int64_t j1, int64_t tile_n, float *tile) {
    const int nc = isa == ISA_AVX2 ? NC256 : NC512, most = isa == ISA_AVX2 ? RB256 : RB512;
    for (int64_t t0 = j0; t0 < j1; t0 += tile_n) {
        const int64_t cols = j1 - t0 < tile_n ? j1 - t0 : tile_n;
        for (int64_t c = 0; c < cols; c++) /* rows past n repeat row n - 1; their outputs are dropped */
            WITH_FORMAT(fmt, F, expand_f32(F, w + (t0 + c < n ? t0 + c : n - 1) * stride, k, tile + c * k));
        for (int64_t m0 = 0; m0 < rows; m0 += CHUNK) {
            const int64_t m1 = rows - m0 < CHUNK ? rows : m0 + CHUNK;
            for (int64_t c0 = 0; c0 < cols; c0 += nc) {
                const float *wt[NC_MOST];
                for (int c = 0; c < nc; c++) wt[c] = tile + (c0 + c) * k;
                for (int64_t r0 = m0; r0 < m1; r0 += most) {
                    const int rb = m1 - r0 < most ? (int)(m1 - r0) : most;
                    const float *xr[RB_MOST];
                    float out[RB_MOST][NC_MOST];
                    for (int r = 0; r < rb; r++) xr[r] = x + (r0 + r) * k;
                    run_block(isa, rb, xr, wt, k, out);
                    for (int r = 0; r < rb; r++)
                        for (int c = 0; c < nc && t0 + c0 + c < n; c++) y[(r0 + r) * ldy + t0 + c0 + c] = out[r][c];
                }
            }
        }
    }
}

/* Bit i set when path i (ISA_SCALAR, ISA_AVX2, ISA_AVX512) was built into this library. */
int gemm_lanes_isas_f32(void) {
    int isas = 1 << ISA_SCALAR;
#if defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX2;
#endif
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX512;
#endif
    return isas;
}

/* y [rows, n] (rows ldy apart) = x [rows, k] W^T. `isa`: ISA_BEST or one path. Returns 0; -1 for a format
 * gguf_blocks.h lacks or a k / stride / ldy that does not fit; -2 for a path not built; -3 when memory
 * runs out. */
int gemm_lanes_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t ldy, int64_t rows,
                   int64_t k, int64_t n, int isa, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0 || n < 0 || ldy < n) return -1;
    const int isas = gemm_lanes_isas_f32();
    if (isa == ISA_BEST) isa = isas & (1 << ISA_AVX512) ? ISA_AVX512 : isas & (1 << ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
    if (isa < ISA_SCALAR || isa > ISA_AVX512 || !(isas & (1 << isa))) return -2;
    if (rows == 0 || n == 0) return 0;
    const int64_t units = (n + SPAN - 1) / SPAN, tile_n = tile_cols(k);
    const size_t tile_bytes = (size_t)round_up(tile_n * k * 4, 64);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = (int)units; /* a thread gets SPAN columns at least */
    char *scratch = aligned_alloc(64, tile_bytes * nthreads);
    if (!scratch) return -3;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        thread_columns(isa, fmt, x, w, stride, y, ldy, rows, k, n, units * t / nt * SPAN, units * (t + 1) / nt * SPAN,
                       tile_n, (float *)(scratch + tile_bytes * t));
    }
    free(scratch);
    return 0;
}
