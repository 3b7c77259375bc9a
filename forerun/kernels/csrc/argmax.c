/* Greedy sampling's argmax over each row of logits, read in the dtype the model wrote them: a bf16
 * model's logits need no float32 copy first (bf16 -> fp32 is exact and keeps the order, so the answer
 * is the copy's). Same answer as torch.argmax and numpy's argmax: the first index of the row's
 * largest value, -0.0 equal to +0.0, and a NaN larger than any number (the first NaN wins).
 * Rows are spread over the caller's OpenMP threads (torch's libgomp, bound by soname).
 */
#include <stdint.h>

#include "vec.h"

/* Lane j of chain c holds the largest value seen at indices = 16c + j (mod 16 CHAINS) and the first
 * index where it was seen (a strict > only moves it on a larger value). Independent chains, since
 * one compare-and-select chain waits on its own latency; NaNs are left to a scalar pass, taken only
 * when the row holds one. */
#define CHAINS 2
#define W (16 * CHAINS)
#define ARGMAX_ROWS(NAME, T, LD, LD16)                                                              \
    void NAME(const T *x, int64_t rows, int64_t n, int64_t *out, int nthreads) {                    \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                          \
        for (int64_t r = 0; r < rows; r++) {                                                        \
            const T *xr = x + r * n;                                                                \
            int64_t i = 0, best = 0;                                                                \
            float top = n ? LD(&xr[0]) : 0.f;                                                       \
            v16i nan = {0};                                                                         \
            if (n >= W) {                                                                           \
                v16f vbest[CHAINS];                                                                 \
                v16i ibest[CHAINS], idx[CHAINS];                                                    \
                for (int c = 0; c < CHAINS; c++) {                                                  \
                    vbest[c] = LD16(xr + 16 * c);                                                   \
                    idx[c] = ibest[c] = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} \
                        + 16 * c;                                                                   \
                    nan |= vbest[c] != vbest[c];                                                    \
                }                                                                                   \
                for (i = W; i + W <= n; i += W)                                                     \
                    for (int c = 0; c < CHAINS; c++) {                                              \
                        const v16f v = LD16(xr + i + 16 * c);                                       \
                        idx[c] += W;                                                                \
                        const v16i gt = v > vbest[c];                                               \
                        nan |= v != v;                                                              \
                        vbest[c] = select16(gt, v, vbest[c]);                                       \
                        ibest[c] = (gt & idx[c]) | (~gt & ibest[c]);                                \
                    }                                                                               \
                for (int c = 0; c < CHAINS; c++)                                                    \
                    for (int j = 0; j < 16; j++)                                                    \
                        if (vbest[c][j] > top || (vbest[c][j] == top && ibest[c][j] < best))        \
                            top = vbest[c][j], best = ibest[c][j];                                  \
            }                                                                                       \
            int any_nan = 0;                                                                        \
            for (int j = 0; j < 16; j++) any_nan |= nan[j];                                         \
            for (; i < n; i++) {                                                                    \
                const float v = LD(&xr[i]);                                                         \
                any_nan |= v != v;                                                                  \
                if (v > top) top = v, best = i;                                                     \
            }                                                                                       \
            if (any_nan)                                                                            \
                for (i = 0; i < n; i++) {                                                           \
                    const float v = LD(&xr[i]);                                                     \
                    if (v != v) { best = i; break; }                                                \
                }                                                                                   \
            out[r] = best;                                                                          \
        }                                                                                           \
    }

ARGMAX_ROWS(argmax_rows_f32, float, ld_f32, load16_f32)
ARGMAX_ROWS(argmax_rows_bf16, uint16_t, ld_bf16, load16_bf16)
