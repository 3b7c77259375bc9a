/* y [rows, n] = x [rows, k] W^T in fp32 for many rows over GGUF blocks as stored, summed in exactly the
 * order of the block GEMV (gemv_kquant.c), so a row's result is that kernel's bit for bit.
 *
 * Why: a row's result must not depend on how many rows share the call (batch invariance), and one
 * user must not pay for that. The GEMV is the fastest kernel at one row; its order is: each output
 * keeps 16 lanes, lane l adds w[k] x[k] for k = l mod 16 in increasing k with one fma each, and the
 * lanes are added as the fixed tree of sum_tree.h. At many rows the GEMV would expand each block again
 * for every few rows of x, so this kernel expands a tile of weight rows once a call into a
 * cache-resident fp32 buffer (expand_f32.h: gguf's exact values, as the GEMV's registers hold them)
 * and runs that same order over it for every row of x.
 *
 * AVX-512 path: lane l's chain is an fma chain over the k = l mod 16 alone, so the 16 chains of an
 * output can be run one after the other. x is packed in groups of 16 rows with a row in each vector
 * lane, and both x and the tile are stored with k in residue order (k' = (k mod 16) k/16 + k / 16), so
 * each residue's chain is a contiguous run that the block matmul's micro-kernel (gemm_micro.h: one
 * lane per row of x, a broadcast weight per step) runs as it runs any chain; the 16 chains' sums are
 * parked and added as the tree, all rows at once. Runs of a residue longer than KC steps are cut, the
 * partial sums parked as exact fp32 values, so the chain runs as if uncut.
 * AVX2 and portable paths: each output's 16 lanes in registers (AVX2: two), over the whole of k, NC
 * weight rows by RB rows of x at a time.
 *
 * Work split: each of the caller's OpenMP threads owns a contiguous range of output columns (weight
 * rows) in multiples of SPAN; it walks the range in tiles of SPAN to 2 SPAN weight rows (about
 * 192 KiB expanded: L2).
 *
 * x [rows, k] fp32; w [n, stride] bytes (each row k / block weights blocks); y [rows, n] fp32 (rows ldy
 * apart).
 */
#include <omp.h>
#include <stdlib.h>

#include "expand_f32.h"
#include "gemm_store.h"
#include "gguf_blocks.h"
#include "sum_tree.h"
#include "transpose16.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define F32_PATH 1
#else
#define F32_PATH 0
#endif
#define BF16_PATH 0

enum {
    TILE_BYTES = 192 * 1024, /* expanded weights a tile holds */
    SPAN = 48,               /* columns go to threads and tiles in multiples of this (of every NC) */
    CHUNK = 64,              /* rows of x that meet a tile's weight rows before the next rows do */
    NC512 = 6, RB512 = 4,    /* AVX-512 register block: 24 accumulators */
    NC256 = 3, RB256 = 2,    /* AVX2 register block: 12 accumulator pairs */
    NC_MOST = 6, RB_MOST = 4,
    LANES = 16, NC = NC512, RV = RB512, /* gemm_micro.h's register block (the AVX-512 path) */
    KC = 128                            /* steps a micro-kernel call runs: 4 groups of x in 32 KiB, L1 */
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

/* One register block of `rb` rows (rb <= the path's RB) by the path's NC weight rows (AVX2, portable). */
static void run_block(int isa, int rb, const float *const xr[], const float *const wt[], int64_t k,
                      float out[RB_MOST][NC_MOST]) {
#if defined(__AVX2__) && defined(__FMA__)
    if (isa == ISA_AVX2) {
        if (rb == 1) block_avx2(1, xr, wt, k, out);
        else block_avx2(RB256, xr, wt, k, out);
        return;
    }
#endif
    block_scalar(rb, NC512, xr, wt, k, out);
}

/* ---- The AVX-512 path: the 16 chains of every output in residue order ------------------------------ */

#include "gemm_micro.h"

#if F32_PATH
/* Groups g0 .. g1 - 1 of 16 rows of x into xp [groups][k][16], k in residue order; rows past `rows` are 0. */
static void pack_residues(const float *x, int64_t rows, int64_t k, int64_t g0, int64_t g1, float *xp) {
    const int64_t runs = k / 16;
    for (int64_t g = g0; g < g1; g++) {
        float *dst = xp + g * k * LANES;
        for (int64_t j = 0; j < runs; j++) {
            __m512i r[16];
            for (int l = 0; l < LANES; l++) {
                const int64_t row = g * LANES + l;
                r[l] = row < rows ? _mm512_loadu_si512(x + row * k + 16 * j) : _mm512_setzero_si512();
            }
            transpose16(r); /* r[i]: weight index 16 j + i of the 16 rows */
            for (int i = 0; i < 16; i++) _mm512_store_si512(dst + (i * runs + j) * LANES, r[i]);
        }
    }
}

/* One weight row expanded straight into residue order: out[i k/16 + j] = weight 16 j + i (gguf's value).
 * Runs of 16 weights are made 16 at a time (256 weights: one K-quant block or 8 legacy ones) in
 * registers and transposed there; the runs past the last whole 256 go through `spare` (k floats). */
static inline __attribute__((always_inline)) void expand_residues(int fmt, const uint8_t *row, int64_t k, float *out,
                                                                  float *spare) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    const int64_t runs = k / 16;
    int64_t j0 = 0;
    for (; j0 + 16 <= runs; j0 += 16) {
        __m512i r[16];
        for (int b = 0; b < 256 / bw; b++) {
            const uint8_t *p = row + (16 * j0 / bw + b) * bs;
            float a[16], c[16];
            block_maps_avx2(fmt, p, a, c);
            UNROLL_RUNS
            for (int v = 0; v < bw / 16; v++)
                r[b * (bw / 16) + v] = _mm512_castps_si512(weights16_avx512(fmt, p, v, a[map_of(fmt, v)], c[map_of(fmt, v)]));
        }
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(out + i * runs + j0, r[i]);
    }
    if (j0 == runs) return;
    expand_f32(fmt, row + 16 * j0 / bw * bs, k - 16 * j0, spare);
    for (int64_t j = j0; j < runs; j++)
        for (int i = 0; i < 16; i++) out[i * runs + j] = spare[16 * (j - j0) + i];
}

/* park[at .. at + 16) = the tree of the 16 residues' sums park[l * step + at ..] (one group's 16 rows of
 * one output column), in sum_tree.h's order. */
static void add_residues(float *park, int64_t step, int64_t at) {
    __m512 s[16];
    for (int l = 0; l < 16; l++) s[l] = _mm512_load_ps(park + l * step + at);
    for (int l = 0; l < 8; l++) s[l] = _mm512_add_ps(s[l], s[l + 8]);
    for (int l = 0; l < 4; l++) s[l] = _mm512_add_ps(s[l], s[l + 4]);
    _mm512_store_ps(park + at, _mm512_add_ps(_mm512_add_ps(s[0], s[2]), _mm512_add_ps(s[1], s[3])));
}

#define MICRO_RB(rb, ...)                                              \
    do {                                                               \
        switch (rb) { /* the group count as a constant: one copy each */ \
            case 1: micro_f32_avx512(1, __VA_ARGS__); break;           \
            case 2: micro_f32_avx512(2, __VA_ARGS__); break;           \
            case 3: micro_f32_avx512(3, __VA_ARGS__); break;           \
            default: micro_f32_avx512(RV, __VA_ARGS__); break;         \
        }                                                              \
    } while (0)

/* Columns j0 .. j1 - 1 of y (clipped to n at the store): per tile, expand it in residue order; per
 * CHUNK rows, per residue, per run of at most KC steps, per NC tile rows, the micro-kernel over the
 * chunk's groups; then the tree over residues and the write-back. */
static void residue_columns(int fmt, const float *xp, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                            int64_t rows, int64_t k, int64_t n, int64_t j0, int64_t j1, int64_t tile_n, float *tile,
                            float *row, float *park) {
    const int64_t runs = k / 16, groups = (rows + LANES - 1) / LANES;
    const int64_t cuts = (runs + KC - 1) / KC, kc = (runs + cuts - 1) / cuts;
    for (int64_t t0 = j0; t0 < j1; t0 += tile_n) {
        const int64_t cols = j1 - t0 < tile_n ? j1 - t0 : tile_n, step = cols * CHUNK;
        for (int64_t c = 0; c < cols; c++) { /* rows past n repeat row n - 1; their outputs are dropped */
            WITH_FORMAT(fmt, F, expand_residues(F, w + (t0 + c < n ? t0 + c : n - 1) * stride, k, tile + c * k, row));
        }
        for (int64_t m0 = 0; m0 < groups * LANES; m0 += CHUNK) {
            const int64_t mg = (groups * LANES - m0 < CHUNK ? groups * LANES - m0 : CHUNK) / LANES;
            for (int l = 0; l < 16; l++)
                for (int64_t jb = 0; jb < runs; jb += kc) {
                    const int64_t len = runs - jb < kc ? runs - jb : kc;
                    for (int64_t g = 0; g < mg; g += RV) {
                        const int rb = mg - g < RV ? (int)(mg - g) : RV;
                        const float *xg = xp + ((m0 / LANES + g) * k + l * runs + jb) * LANES;
                        for (int64_t c0 = 0; c0 < cols; c0 += NC) {
                            const float *wt[NC];
                            for (int c = 0; c < NC; c++) wt[c] = tile + (c0 + c) * k + l * runs + jb;
                            MICRO_RB(rb, xg, k * LANES, wt, len, jb == 0, park + l * step + c0 * CHUNK + g * LANES,
                                     CHUNK);
                        }
                    }
                }
            for (int64_t c = 0; c < cols; c++)
                for (int64_t g = 0; g < mg; g++) add_residues(park, step, c * CHUNK + g * LANES);
            const int64_t nr = rows - m0 < CHUNK ? rows - m0 : CHUNK, nc = n - t0 < cols ? n - t0 : cols;
            store_y(park, CHUNK, nr, nc, y, 0, ldy, m0, t0);
        }
    }
}

/* The AVX-512 path over all columns: x packed once, shared; then each thread its columns. */
static int residue_path(int fmt, const float *x, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                        int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int64_t groups = (rows + LANES - 1) / LANES, units = (n + SPAN - 1) / SPAN, tile_n = tile_cols(k);
    const size_t tile_bytes = (size_t)round_up(tile_n * k * 4, 64), row_bytes = (size_t)round_up(k * 4, 64);
    const size_t park_bytes = (size_t)16 * tile_n * CHUNK * 4, mine = tile_bytes + row_bytes + park_bytes;
    if (nthreads > units) nthreads = (int)units; /* a thread gets SPAN columns at least */
    float *xp = aligned_alloc(64, (size_t)round_up(groups * LANES * k * 4, 64));
    char *scratch = aligned_alloc(64, mine * nthreads);
    if (!xp || !scratch) {
        free(xp);
        free(scratch);
        return -3;
    }
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        pack_residues(x, rows, k, groups * t / nt, groups * (t + 1) / nt, xp);
#pragma omp barrier
        char *own = scratch + mine * t;
        residue_columns(fmt, xp, w, stride, y, ldy, rows, k, n, units * t / nt * SPAN, units * (t + 1) / nt * SPAN,
                        tile_n, (float *)own, (float *)(own + tile_bytes), (float *)(own + tile_bytes + row_bytes));
    }
    free(xp);
    free(scratch);
    return 0;
}
#endif

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

/* Bit i set when path i (ISA_SCALAR, ISA_AVX2, ISA_AVX512) was built into this library: the block GEMV's
 * paths, under the same build conditions (gemv_kquant.c). */
int gemv_kquant_isas_f32(void);
int gemm_lanes_isas_f32(void) { return gemv_kquant_isas_f32(); }

/* y [rows, n] (rows ldy apart) = x [rows, k] W^T. `isa`: ISA_BEST or one path. Returns 0; -1 for a format
 * gguf_blocks.h lacks or a k / stride / ldy that does not fit; -2 for a path not built; -3 when memory
 * runs out. */
int gemm_lanes_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t ldy, int64_t rows,
                   int64_t k, int64_t n, int isa, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0 || n < 0 || ldy < n) return -1;
    isa = path_of(isa, gemm_lanes_isas_f32());
    if (isa < 0) return -2;
    if (rows == 0 || n == 0) return 0;
    if (nthreads < 1) nthreads = 1;
#if F32_PATH
    if (isa == ISA_AVX512) return residue_path(fmt, x, w, stride, y, ldy, rows, k, n, nthreads);
#endif
    const int64_t units = (n + SPAN - 1) / SPAN, tile_n = tile_cols(k);
    const size_t tile_bytes = (size_t)round_up(tile_n * k * 4, 64);
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
