/* y [rows, n] = x [rows, k] W^T in fp32 for a few rows over GGUF blocks as stored, summed in exactly
 * the order of the fp32 block matmul (gemm_blocks.c), so its results are that kernel's bit for bit.
 *
 * Why: batch-invariant mode needs a row's result not to depend on how many rows share the call.
 * The block GEMV (gemv_kquant.c) keeps 16 partial sums over k and adds them as a tree, the block
 * matmul one fma chain over k; each is fixed, but they differ, so a step of 1 row and a step of 64
 * would not agree. This GEMV runs the block matmul's chain: y[r][j] = fma over k = 0..k-1 in
 * increasing order from +0, one rounding a step, over gguf's exact fp32 weights. Where the matmul
 * keeps a row of x in each vector lane, this kernel keeps a weight row in each lane: it expands 16
 * weight rows' runs of 16 weights (as the block GEMV does), transposes them so that register i holds
 * weight k0 + i of the 16 rows, and adds x[r][k0 + i] times it to the 16 outputs. The portable path
 * runs the same chain with scalar fmas.
 *
 * `gemv_ordered_bf16` is the same for the block matmul's bf16 variant (AVX512_BF16 only): x bf16, the
 * weights rounded to bf16 as that kernel's tiles hold them (runs32_bf16), and each output one chain of
 * vdpbf16ps steps over k, a pair of k a step, from +0: the matmul keeps rows of x in the lanes and
 * broadcasts a weight pair, this kernel keeps weight rows in the lanes and broadcasts an x pair, and
 * the instruction's result in a lane does not depend on which operand was broadcast.
 *
 * x [rows, k] fp32 (bf16: as uint16); w [n, stride] bytes; y [rows, n] fp32. Groups of 16 weight rows
 * are spread over the caller's OpenMP threads (the last group repeats its last row; the copies are
 * dropped).
 */
#include "gguf_blocks.h"
#include "transpose16.h"

enum { WROWS = 16, XROWS = 4 };

static void ordered_scalar(int fmt, const float *x, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                           int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < rows; r++) {
            float s = 0.f, a[16], b[16], wv[16];
            for (int64_t blk = 0; blk < k / bw; blk++) {
                const uint8_t *p = w + j * stride + blk * bs;
                block_maps(fmt, p, a, b);
                for (int v = 0; v < bw / 16; v++) {
                    weights16(fmt, p, v, a[map_of(fmt, v)], b[map_of(fmt, v)], wv);
                    const float *xr = x + r * k + blk * bw + 16 * v;
                    for (int i = 0; i < 16; i++) s = fmaf(xr[i], wv[i], s);
                }
            }
            y[r * ldy + j] = s;
        }
}

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* One group of 16 weight rows against RB rows of x. */
static inline __attribute__((always_inline)) void group_avx512(int fmt, int RB, const float *const xr[XROWS],
                                                               int64_t k, const uint8_t *const wr[WROWS],
                                                               __m512 acc[XROWS]) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / bw; blk++) {
        float a[WROWS][16], b[WROWS][16];
        for (int c = 0; c < WROWS; c++) block_maps_avx2(fmt, wr[c] + blk * bs, a[c], b[c]);
        for (int v = 0; v < bw / 16; v++) {
            __m512i t[WROWS];
            for (int c = 0; c < WROWS; c++)
                t[c] = _mm512_castps_si512(
                    weights16_avx512(fmt, wr[c] + blk * bs, v, a[c][map_of(fmt, v)], b[c][map_of(fmt, v)]));
            transpose16(t); /* t[i], lane c: weight 16 v + i of row c */
            const int64_t k0 = blk * bw + 16 * v;
            for (int i = 0; i < 16; i++)
                for (int r = 0; r < RB; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k0 + i]), _mm512_castsi512_ps(t[i]), acc[r]);
        }
    }
}

#define GROUP_RB(F, rb, ...) (rb == 1 ? group_avx512(F, 1, __VA_ARGS__) : group_avx512(F, XROWS, __VA_ARGS__))
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX2__) && \
    defined(__FMA__)
#define BF16_PATH 1
/* One group of 16 weight rows against RB rows of bf16 x. */
static inline __attribute__((always_inline)) void group_bf16(int fmt, int RB, const uint16_t *const xr[XROWS],
                                                             int64_t k, const uint8_t *const wr[WROWS],
                                                             __m512 acc[XROWS]) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / bw; blk++) {
        float a[WROWS][16], b[WROWS][16];
        for (int c = 0; c < WROWS; c++) block_maps_avx2(fmt, wr[c] + blk * bs, a[c], b[c]);
        for (int v = 0; v < bw / 16; v += 2) {
            __m512i t[WROWS];
            for (int c = 0; c < WROWS; c++) t[c] = runs32_bf16(fmt, wr[c] + blk * bs, v, a[c], b[c]);
            transpose16(t); /* t[i], lane c: the pair of weights 16 v + 2 i, + 1 of row c */
            const int64_t k0 = blk * bw + 16 * v;
            for (int i = 0; i < 16; i++)
                for (int r = 0; r < RB; r++) {
                    uint32_t pair;
                    memcpy(&pair, xr[r] + k0 + 2 * i, 4);
                    acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)t[i], (__m512bh)_mm512_set1_epi32((int)pair));
                }
        }
    }
}
#else
#define BF16_PATH 0
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The vector paths: groups of 16 weight rows over the threads (the last group repeats its last row);
 * rows of x one at a time when one is left, else in tiles of XROWS where a short tile repeats its last
 * row. x fp32, or bf16 as uint16 with `bf16` (the caller checked that BF16_PATH was built). */
static void ordered_vector(int bf16, int fmt, const void *x, const uint8_t *w, int64_t stride, float *y,
                           int64_t ldy, int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int64_t groups = (n + WROWS - 1) / WROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wr[WROWS];
        for (int c = 0; c < WROWS; c++) wr[c] = w + (WROWS * g + c < n ? WROWS * g + c : n - 1) * stride;
        const int width = n - WROWS * g < WROWS ? (int)(n - WROWS * g) : WROWS;
        for (int64_t r0 = 0; r0 < rows;) {
            const int rb = rows - r0 == 1 ? 1 : XROWS, real = rows - r0 < rb ? (int)(rows - r0) : rb;
            int64_t at[XROWS]; /* the row of x each tile slot reads */
            for (int r = 0; r < XROWS; r++) at[r] = r0 + (r < real ? r : real - 1);
            __m512 acc[XROWS];
            if (!bf16) {
                const float *xr[XROWS];
                for (int r = 0; r < XROWS; r++) xr[r] = (const float *)x + at[r] * k;
                WITH_FORMAT(fmt, F, GROUP_RB(F, rb, xr, k, wr, acc));
            }
#if BF16_PATH
            if (bf16) {
                const uint16_t *xr[XROWS];
                for (int r = 0; r < XROWS; r++) xr[r] = (const uint16_t *)x + at[r] * k;
                if (rb == 1) WITH_FORMAT(fmt, F, group_bf16(F, 1, xr, k, wr, acc));
                else WITH_FORMAT(fmt, F, group_bf16(F, XROWS, xr, k, wr, acc));
            }
#endif
            for (int r = 0; r < real; r++)
                _mm512_mask_storeu_ps(y + (r0 + r) * ldy + WROWS * g, (__mmask16)((1u << width) - 1), acc[r]);
            r0 += real;
        }
    }
}
#endif

/* y [rows, n] fp32 = x [rows, k] bf16 W^T, in the bf16 block matmul's order. Returns 0, -1 for input
 * that does not fit, -2 where this CPU or build has no AVX512_BF16 path (there is no portable one: the
 * matmul's portable bf16 path sums in another order). */
int gemv_ordered_bf16(const uint16_t *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t rows,
                      int64_t k, int64_t n, int isa, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0 || n < 0) return -1;
    if (!BF16_PATH || (isa != ISA_BEST && isa != ISA_AVX512)) return -2;
    if (rows == 0 || n == 0) return 0;
#if BF16_PATH
    ordered_vector(1, fmt, x, w, stride, y, n, rows, k, n, nthreads);
#endif
    (void)x, (void)w, (void)y, (void)nthreads;
    return 0;
}

/* Bit i set when path i (ISA_SCALAR, ISA_AVX512) was built into this library. */
int gemv_ordered_isas_f32(void) {
    int isas = 1 << ISA_SCALAR;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX512;
#endif
    return isas;
}

/* y [rows, n] (rows ldy apart: one part of a wider output, as in the fused decode step) = x W^T.
 * Returns 0, -1 for a format gguf_blocks.h lacks or a k / stride / ldy that does not fit it, -2 for a
 * path not built. `isa`: ISA_BEST or one path. */
int gemv_ordered_strided_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t ldy,
                             int64_t rows, int64_t k, int64_t n, int isa, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0 || n < 0 || ldy < n) return -1;
    isa = path_of(isa, gemv_ordered_isas_f32());
    if (isa < 0) return -2;
    if (rows == 0 || n == 0) return 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (isa == ISA_AVX512) {
        ordered_vector(0, fmt, x, w, stride, y, ldy, rows, k, n, nthreads);
        return 0;
    }
#endif
    ordered_scalar(fmt, x, w, stride, y, ldy, rows, k, n, nthreads);
    return 0;
}

/* y [rows, n] contiguous (gemv_ordered_strided_f32 with ldy = n). */
int gemv_ordered_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t rows, int64_t k,
                     int64_t n, int isa, int nthreads) {
    return gemv_ordered_strided_f32(x, w, stride, fmt, y, n, rows, k, n, isa, nthreads);
}
