/* Greedy sampling's argmax over each row of logits, read in the dtype the model wrote them: a bf16
 * model's logits need no float32 copy first (bf16 -> fp32 is exact and keeps the order, so the answer
 * is the copy's). Same answer as torch.argmax and numpy's argmax: the first index of the row's
 * largest value, -0.0 equal to +0.0, and a NaN larger than any number (the first NaN wins).
 * Rows are spread over the caller's OpenMP threads (torch's libgomp, bound by soname).
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Lane j of chain c holds the largest value seen at indices = L c + j (mod L CHAINS) and the first
 * index where it was seen (a strict > only moves it on a larger value), L lanes a vector: 16 with
 * AVX-512, else 8, since GCC keeps a 16-wide vector in two AVX2 registers and these chains' seven then
 * left the registers (SmolLM2's 49,152 logits on an AMD EPYC with AVX2 only: 160 us a row, more than a
 * layer's matmuls, against 5.7 us at 8 lanes). Independent chains, since one compare-and-select chain waits on its own
 * latency; NaNs are left to a scalar pass, taken only when the row holds one. The answer does not
 * depend on L: the row's largest value, ties to the first index. */
#if VEC16_NATIVE
#define L 16
typedef v16f vf;
typedef v16i vi;
#define LOADV_F32 load16_f32
#define LOADV_BF16 load16_bf16
#define SELECT select16
#else
#define L 8
typedef v8f vf;
typedef v8i vi;
#define LOADV_F32 load8_f32
#define LOADV_BF16 load8_bf16
#define SELECT select8
#endif
#define CHAINS 2
#define W (L * CHAINS)
static const int32_t IOTA[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#define ARGMAX_ROWS(NAME, T, LD, LDV)                                                               \
    void NAME(const T *x, int64_t rows, int64_t n, int64_t *out, int nthreads) {                    \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                          \
        for (int64_t r = 0; r < rows; r++) {                                                        \
            const T *xr = x + r * n;                                                                \
            int64_t i = 0, best = 0;                                                                \
            float top = n ? LD(&xr[0]) : 0.f;                                                       \
            vi nan = {0};                                                                           \
            if (n >= W) {                                                                           \
                vf vbest[CHAINS];                                                                   \
                vi ibest[CHAINS], idx[CHAINS];                                                      \
                for (int c = 0; c < CHAINS; c++) {                                                  \
                    vbest[c] = LDV(xr + L * c);                                                     \
                    memcpy(&idx[c], IOTA, sizeof idx[c]);                                           \
                    idx[c] += L * c;                                                                \
                    ibest[c] = idx[c];                                                              \
                    nan |= vbest[c] != vbest[c];                                                    \
                }                                                                                   \
                for (i = W; i + W <= n; i += W)                                                     \
                    for (int c = 0; c < CHAINS; c++) {                                              \
                        const vf v = LDV(xr + i + L * c);                                           \
                        idx[c] += W;                                                                \
                        const vi gt = v > vbest[c];                                                 \
                        nan |= v != v;                                                              \
                        vbest[c] = SELECT(gt, v, vbest[c]);                                         \
                        ibest[c] = (gt & idx[c]) | (~gt & ibest[c]);                                \
                    }                                                                               \
                for (int c = 0; c < CHAINS; c++)                                                    \
                    for (int j = 0; j < L; j++)                                                     \
                        if (vbest[c][j] > top || (vbest[c][j] == top && ibest[c][j] < best))        \
                            top = vbest[c][j], best = ibest[c][j];                                  \
            }                                                                                       \
            int any_nan = 0;                                                                        \
            for (int j = 0; j < L; j++) any_nan |= nan[j];                                          \
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

ARGMAX_ROWS(argmax_rows_f32, float, ld_f32, LOADV_F32)
ARGMAX_ROWS(argmax_rows_bf16, uint16_t, ld_bf16, LOADV_BF16)
