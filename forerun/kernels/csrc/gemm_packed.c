/* y = x W^T + b in fp32 for any number of rows, against a weight packed once at load.
 *
 * Why: at decode batches of tens of rows and at prefill a matmul is bound by arithmetic, and on the
 * AVX2 machines measured here oneDNN's fp32 GEMM reached 40-50% of the cores' FMA peak at the model's
 * shapes (64 rows, k 512-1536). A register-blocked kernel over a weight laid out in the order it is
 * read reaches about 60%: 1.1-1.3x oneDNN at those shapes (forerun.kernels.probe measures both
 * on each machine and keeps the faster).
 *
 * Layout: the weight [n, k] is packed into panels of NR = 16 output columns; panel p holds k lines
 * of 16 floats (columns p*16 .. p*16+15, zero past n). x [rows, k] and y [rows, n] are row-major.
 * A micro-kernel keeps a 6-row x 16-column block of y in 12 vector registers and streams one panel
 * line and 6 values of x per step of k: 12 FMAs per 2 vector loads and 6 broadcasts.
 *
 * Threads: each of the caller's OpenMP threads owns a contiguous range of panels (so each weight
 * byte is read by one core) and walks the rows in blocks of MC, so a block of x stays in its L2.
 * The sum over k runs in order for every output, so the result does not depend on the thread count.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define NR 16
#define MR 6
#define MC 96
/* Panel lines ahead to prefetch: about 1 KiB, what the next few dozen steps of k will read. */
#define PREFETCH_LINES 16

void pack_weight_f32(const float *w, int64_t n, int64_t k, float *packed, int nthreads) {
    const int64_t panels = (n + NR - 1) / NR;
    /* At load every matmul's weight is packed once: the model's whole fp32 size, so all threads. */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                packed[(p * k + i) * NR + j] = col < n ? w[col * k + i] : 0.f;
            }
}

/* c[r][0..16) = b_panel[0..16) + sum_i a[r][i] * panel[i][0..16) for r < ROWS. Each row count gets
 * its own copy so the loops over r unroll and the accumulators live in registers. */
#define DEFINE_KERNEL(ROWS)                                                                            \
    static void kernel_##ROWS(const float *a, int64_t lda, const float *panel, int64_t k,               \
                              const float *bias, float *c, int64_t ldc) {                               \
        v8f lo[ROWS], hi[ROWS];                                                                         \
        const v8f b_lo = bias ? load8_f32(bias) : splat8(0.f), b_hi = bias ? load8_f32(bias + 8) : splat8(0.f); \
        for (int r = 0; r < ROWS; r++) { lo[r] = splat8(0.f); hi[r] = splat8(0.f); }                   \
        for (int64_t i = 0; i < k; i++) {                                                               \
            const float *line = panel + i * NR;                                                         \
            __builtin_prefetch(line + PREFETCH_LINES * NR);                                             \
            const v8f w_lo = load8_f32(line), w_hi = load8_f32(line + 8);                               \
            for (int r = 0; r < ROWS; r++) {                                                            \
                const v8f av = splat8(a[r * lda + i]);                                                  \
                lo[r] += av * w_lo;                                                                     \
                hi[r] += av * w_hi;                                                                     \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < ROWS; r++) {                                                                \
            store8_f32(c + r * ldc, lo[r] + b_lo);                                                      \
            store8_f32(c + r * ldc + 8, hi[r] + b_hi);                                                  \
        }                                                                                               \
    }
DEFINE_KERNEL(1)
DEFINE_KERNEL(2)
DEFINE_KERNEL(3)
DEFINE_KERNEL(4)
DEFINE_KERNEL(5)
DEFINE_KERNEL(6)

static void kernel_rows(int rows, const float *a, int64_t lda, const float *panel, int64_t k, const float *bias,
                        float *c, int64_t ldc) {
    switch (rows) {
        case 1: kernel_1(a, lda, panel, k, bias, c, ldc); break;
        case 2: kernel_2(a, lda, panel, k, bias, c, ldc); break;
        case 3: kernel_3(a, lda, panel, k, bias, c, ldc); break;
        case 4: kernel_4(a, lda, panel, k, bias, c, ldc); break;
        case 5: kernel_5(a, lda, panel, k, bias, c, ldc); break;
        default: kernel_6(a, lda, panel, k, bias, c, ldc); break;
    }
}

/* bias: NULL, or padded to a whole number of panels (n rounded up to 16). */
void gemm_packed_f32(const float *x, int64_t rows, int64_t k, const float *packed, const float *bias, int64_t n,
                     float *y, int nthreads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        float edge[MR * NR]; /* the last panel's block when n is not a multiple of 16 */
        for (int64_t m0 = 0; m0 < rows; m0 += MC) {
            const int64_t m1 = m0 + MC < rows ? m0 + MC : rows;
            for (int64_t p = p0; p < p1; p++) {
                const float *panel = packed + p * k * NR, *pb = bias ? bias + p * NR : NULL;
                const int64_t width = n - p * NR < NR ? n - p * NR : NR;
                for (int64_t m = m0; m < m1; m += MR) {
                    const int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                    if (width == NR) {
                        kernel_rows(mr, x + m * k, k, panel, k, pb, y + m * n + p * NR, n);
                    } else {
                        kernel_rows(mr, x + m * k, k, panel, k, pb, edge, NR);
                        for (int r = 0; r < mr; r++) memcpy(y + (m + r) * n + p * NR, edge + r * NR, width * sizeof(float));
                    }
                }
            }
        }
    }
}
