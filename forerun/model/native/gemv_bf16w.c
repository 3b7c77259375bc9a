/* y = x W^T + b for a few rows of fp32 activations against bf16-stored weights.
 *
 * Why: at decode batch sizes of one to a few requests a matmul is bound by reading its weights,
 * and most checkpoints store them in bf16. Upcasting them to fp32 at load doubles the bytes every
 * step reads. Keeping the bf16 copy and widening each weight in registers (a 16-bit shift, exact)
 * halves the traffic while the arithmetic stays fp32: the result is the fp32 matmul's up to the
 * summation order. Larger batches are compute-bound and stay with oneDNN.
 *
 * Layout: x [rows, k] fp32, w [n, k] bf16 (row-major, k a multiple of 8), b [n] fp32 or NULL,
 * y [rows, n] fp32. Output columns are split over the caller's OpenMP threads.
 */
#include <stdint.h>

#include "vec.h"

/* One tile: MR rows of x against NR rows of w, 8 lanes of k at a time. MR and NR are constants
 * at every call site, so the accumulators unroll into registers. */
static inline void tile(const float *x, const uint16_t *w, const float *b, float *y, int64_t k, int64_t n,
                        int64_t m0, int64_t n0, int mr, int nr) {
    v8f acc[4][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = splat8(0.f);
    for (int64_t kk = 0; kk < k; kk += 8) {
        v8f wv[4];
        for (int j = 0; j < nr; j++) wv[j] = load8_bf16(w + (n0 + j) * k + kk);
        for (int i = 0; i < mr; i++) {
            const v8f xv = load8_f32(x + (m0 + i) * k + kk);
            for (int j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) y[(m0 + i) * n + n0 + j] = hsum8(acc[i][j]) + (b ? b[n0 + j] : 0.f);
}

/* Rows of x in groups of up to 4, so each weight row is read from memory once per group. A tile
 * keeps MR x NR accumulators plus NR weight vectors in the 16 ymm registers: groups of 3 or 4 rows
 * take the 4 weight rows as two tiles of 2 (the second pass reads them from L1). */
static inline void rows_of(const float *x, const uint16_t *w, const float *b, float *y, int64_t m, int mr,
                           int64_t k, int64_t n, int64_t n0, int nr) {
    if (nr == 4 && mr >= 3) {
        rows_of(x, w, b, y, m, mr, k, n, n0, 2);
        rows_of(x, w, b, y, m, mr, k, n, n0 + 2, 2);
        return;
    }
    switch (mr * 8 + nr) {
        case 4 * 8 + 2: tile(x, w, b, y, k, n, m, n0, 4, 2); break;
        case 3 * 8 + 2: tile(x, w, b, y, k, n, m, n0, 3, 2); break;
        case 2 * 8 + 4: tile(x, w, b, y, k, n, m, n0, 2, 4); break;
        case 1 * 8 + 4: tile(x, w, b, y, k, n, m, n0, 1, 4); break;
        default: /* the column tail: one weight row at a time */
            for (int i = 0; i < mr; i++) tile(x, w, b, y, k, n, m + i, n0, 1, 1);
    }
}

static inline void columns(const float *x, const uint16_t *w, const float *b, float *y, int64_t rows, int64_t k,
                           int64_t n, int64_t n0, int nr) {
    for (int64_t m = 0; m < rows; m += 4) rows_of(x, w, b, y, m, rows - m < 4 ? (int)(rows - m) : 4, k, n, n0, nr);
}

void gemv_bf16w_f32(const float *x, const uint16_t *w, const float *b, float *y, int64_t rows, int64_t k,
                    int64_t n, int nthreads) {
    const int64_t blocks = n / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        /* Fetch the next block's weights while this one computes: the hardware prefetcher does not
         * cross the page boundaries that wide rows span. */
        if (blk + 1 < blocks) prefetch_row(w + (blk + 1) * 4 * k, 4 * k * (int64_t)sizeof(uint16_t));
        columns(x, w, b, y, rows, k, n, blk * 4, 4);
    }
    for (int64_t j = blocks * 4; j < n; j++) columns(x, w, b, y, rows, k, n, j, 1);
}
