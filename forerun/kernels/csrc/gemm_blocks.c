/* y [rows, n] = x [rows, k] W^T for many rows (prefill, batches of 16-256), with W [n, k] given as rows of
 * GGUF blocks as the file stores them (any format gguf_blocks.h decodes).
 *
 * Why: at tens of rows a matmul is bound by arithmetic, not by reading its weights, so expanding the
 * blocks in registers for every few rows of x (the GEMV's way) would cost more than the products.
 * Here each weight is expanded once a call into a small cache-resident tile and then used by every
 * row of x, so the expansion is amortised over the rows.
 *
 * Work split: each of the caller's OpenMP threads owns a contiguous range of output columns (weight
 * rows), in multiples of SPAN = 48. It walks its range in tiles of 48-96 weight rows: it expands a
 * tile once into a thread-local buffer, [tile][k] (about 192 KiB: it stays in L2), while asking the
 * next tile's blocks into L2, then multiplies every row of x by it. Before that, the threads pack x
 * once, shared: in groups of 16 rows with a row in each lane, [rows / 16][k][16] (fp32) or
 * [rows / 16][k / 2][16][2] (bf16 pairs), rows past `rows` zero. Per tile, rows are taken 128 at a
 * time and k in equal blocks of at most 128 (fp32) or 256 (bf16), so that the packed x of 64 rows for
 * one block (32 KiB) stays in L1 while the micro-kernel sweeps the tile's weight rows over it; the
 * outputs are staged per tile and written back row by row in whole cache lines.
 *
 * The micro-kernel keeps NC = 6 weight rows x RV = 4 groups of 16 rows of y in 24 vector registers;
 * per step of k it loads the 4 x vectors and broadcasts one weight of each of the 6 weight rows. Each
 * output is one vector lane, and no lane ever meets another. (AVX2: one group at a time, two registers
 * a group, 12 accumulators.)
 *
 * Two arithmetic variants:
 *   fp32: x fp32, weights exactly gguf's fp32 values (gguf_blocks.h); y[r][j] = fma over k = 0..k-1
 *         in increasing order, one rounding a step, from +0. The AVX-512, AVX2 and portable paths
 *         perform that same chain, so they are bit-equal.
 *   bf16: x bf16, weights rounded to bf16 (to nearest even, from their exact fp32 value); products are
 *         exact in fp32 and accumulated in fp32 over k in increasing order, a pair of k at a time
 *         (AVX512_BF16 vdpbf16ps: the pair's two products are added into the lane, with the rounding
 *         the instruction does). The portable path adds each product with its own fma: the same
 *         values up to the rounding of the sums.
 * Either way the order of each output's sum is fixed by k alone: the blocks of k depend on k only,
 * and between two blocks a partial sum is parked in memory as the exact fp32 value it is, so the
 * chain runs as if uncut. It does not depend on the number of rows of x, on where a row sits among
 * them, nor on the thread count, so a row's result is bit-identical however it is batched.
 *
 * x [rows, k] (fp32 or bf16 as uint16), w [n, stride] bytes, y [rows, n] fp32 or, on request, bf16 (the
 * fp32 result rounded once to nearest even, as torch rounds), all row-major.
 */
#include <omp.h>
#include <stdlib.h>

#include "expand_f32.h"
#include "gguf_blocks.h"
#include "gemm_store.h"
#include "transpose16.h"
#include "vec.h"

/* The vector paths built: AVX-512 for fp32 (and the transposes); AVX512_BF16 for bf16. */
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define F32_PATH 1
#else
#define F32_PATH 0
#endif
#if F32_PATH && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_PATH 1
#else
#define BF16_PATH 0
#endif
/* AVX2 for fp32 (the only vector path of an AVX2-only CPU; built on AVX-512 ones too, to test it). */
#if defined(__AVX2__) && defined(__FMA__)
#define F32_AVX2_PATH 1
#else
#define F32_AVX2_PATH 0
#endif

enum {
    LANES = 16,              /* fp32 lanes of a vector: rows of x a group holds */
    NC = 6,                  /* weight rows a micro-kernel call runs */
    RV = 4,                  /* groups of 16 rows of x a micro-kernel call runs (MICRO_RB names 1..4) */
    TILE_BYTES = 192 * 1024, /* expanded weights a tile holds: with x's block and the staged outputs, in L2 */
    KC_BYTES = 32 * 1024,    /* packed x a micro-kernel call reads: in L1 */
    CHUNK = 128,             /* rows of x whose outputs a thread stages at a time */
    /* Columns go to threads and tiles in multiples of SPAN (of NC and of 16), so each tile's outputs
     * start on a 64-byte boundary of a row of y (when y's rows do) and go back in whole cache lines. */
    SPAN = 48
};
_Static_assert(SPAN % NC == 0 && SPAN % LANES == 0, "a span holds whole micro-kernel calls and vectors");
_Static_assert(RV == 4, "MICRO_RB instantiates 1, 2, 3 and RV groups");
/* What gemm_blocks_f32's `mode` asks for: x's type (and so the arithmetic variant) and y's. */
enum { MODE_F32 = 0, MODE_BF16 = 1, MODE_BF16_OUT = 2 };

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* Weight rows a tile expands: a multiple of SPAN, SPAN .. 2 SPAN. */
static int64_t tile_cols(int64_t k, int elem_bytes) {
    const int64_t fit = TILE_BYTES / (k * elem_bytes) / SPAN * SPAN;
    return fit < SPAN ? SPAN : fit > 2 * SPAN ? 2 * SPAN : fit;
}

/* Weights of k a micro-kernel call runs: the fewest blocks whose packed x (RV groups of 16 rows)
 * fits KC_BYTES, made equal and rounded up to 32 (a short last block would pay the partial sums'
 * loads and stores for few products). */
static int64_t k_block(int64_t k, int elem_bytes) {
    int64_t most = KC_BYTES / (RV * LANES * elem_bytes) / 32 * 32;
    if (most < 32) most = 32;
    const int64_t blocks = (k + most - 1) / most;
    return round_up((k + blocks - 1) / blocks, 32);
}

/* Bit i set when path i (ISA_SCALAR, ISA_AVX2: fp32 only, ISA_AVX512) of the variant (bf16 or fp32)
 * was built. */
int gemm_blocks_isas_f32(int bf16) {
    int isas = 1 << ISA_SCALAR;
#if F32_AVX2_PATH
    if (!bf16) isas |= 1 << ISA_AVX2;
#endif
#if F32_PATH
    if (!bf16) isas |= 1 << ISA_AVX512;
#endif
#if BF16_PATH
    if (bf16) isas |= 1 << ISA_AVX512;
#endif
    return isas;
}

/* ---- Expanding weights into a tile ------------------------------------------------------------- */

/* One weight row into out[0..k) bf16, each the fp32 weight rounded to nearest even. vcvtne2ps2bf16
 * rounds the same way; it would flush a subnormal, but no weight is one (every weight is a multiple
 * of 2^-24, fp16's quantum, or a product of such). */
static inline __attribute__((always_inline)) void expand_bf16(int fmt, const uint8_t *row, int64_t k, uint16_t *out) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    for (int64_t blk = 0; blk < k / bw; blk++) {
        const uint8_t *p = row + blk * bs;
        float a[16], b[16];
        uint16_t *o = out + blk * bw;
#if BF16_PATH
        block_maps_avx2(fmt, p, a, b);
        UNROLL_RUNS
        for (int v = 0; v < bw / 16; v += 2) _mm512_store_si512(o + 16 * v, runs32_bf16(fmt, p, v, a, b));
#else
        float w[16];
        block_maps(fmt, p, a, b);
        for (int v = 0; v < bw / 16; v++) {
            weights16(fmt, p, v, a[map_of(fmt, v)], b[map_of(fmt, v)], w);
            for (int i = 0; i < 16; i++) st_bf16(o + 16 * v + i, w[i]);
        }
#endif
    }
}

/* Weight rows j0 .. j0 + cols - 1 into the tile, [cols][k]; rows past n repeat row n - 1 (their
 * outputs are computed and dropped). */
static void expand_tile(int fmt, int bf16, const uint8_t *w, int64_t stride, int64_t n, int64_t k, int64_t j0,
                        int64_t cols, void *tile) {
    for (int64_t c = 0; c < cols; c++) {
        const uint8_t *row = w + (j0 + c < n ? j0 + c : n - 1) * stride;
        if (bf16) WITH_FORMAT(fmt, F, expand_bf16(F, row, k, (uint16_t *)tile + c * k));
        else WITH_FORMAT(fmt, F, expand_f32(F, row, k, (float *)tile + c * k));
    }
}

/* ---- Transposes: packing x, writing y ------------------------------------------------------------- */


/* Groups g0 .. g1 - 1 of 16 rows of x into xp [groups][m][16], where a row of x is m 32-bit values
 * (fp32: m = k; bf16: m = k / 2 pairs); rows past `rows` are zero. */
static void pack_x(const uint32_t *x, int64_t rows, int64_t m, int64_t g0, int64_t g1, uint32_t *xp) {
    for (int64_t g = g0; g < g1; g++) {
        uint32_t *dst = xp + g * m * LANES;
#if F32_PATH
        for (int64_t i = 0; i < m; i += LANES) { /* m is a multiple of 16: k of 32 weights a block at least */
            __m512i r[16];
            for (int l = 0; l < LANES; l++) {
                const int64_t row = g * LANES + l;
                r[l] = row < rows ? _mm512_loadu_si512(x + row * m + i) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int j = 0; j < LANES; j++) _mm512_store_si512(dst + (i + j) * LANES, r[j]);
        }
#else
        for (int l = 0; l < LANES; l++) {
            const int64_t row = g * LANES + l;
            for (int64_t i = 0; i < m; i++) { /* x is fp32 or bf16 pairs: copied as bytes */
                uint32_t v = 0;
                if (row < rows) memcpy(&v, x + row * m + i, 4);
                dst[i * LANES + l] = v;
            }
        }
#endif
    }
}

#include "gemm_micro.h"

#define MICRO_RB(MICRO, rb, ...)                               \
    do {                                                       \
        switch (rb) {                                          \
            case 1: MICRO(1, __VA_ARGS__); break;              \
            case 2: MICRO(2, __VA_ARGS__); break;              \
            case 3: MICRO(3, __VA_ARGS__); break;              \
            default: MICRO(RV, __VA_ARGS__); break;            \
        }                                                      \
    } while (0)

/* The fixed blocking of one call (the same on every thread and path). */
typedef struct {
    int isa, bf16, ybf16, fmt; /* bf16: x bf16 (the bf16 variant); ybf16: y bf16 */
    int64_t rows, k, n, stride;
    int64_t tile;   /* weight rows a tile expands (a multiple of SPAN) */
    int64_t kc;     /* weights of k a micro-kernel call runs (a multiple of 32) */
    int64_t chunk;  /* rows of x staged at a time (a multiple of 16) */
} Plan;

/* One micro-kernel call: row groups g .. g + rb - 1 (xg: the first one's packed values at step kb)
 * against tile rows c0 .. c0 + NC - 1, k from kb, partial sums in acc. */
static void micro(const Plan *p, int rb, const void *xg, const void *tile, int64_t c0, int64_t kb, float *acc,
                  int64_t ld) {
    const int64_t xs = p->k * LANES, len = p->k - kb < p->kc ? p->k - kb : p->kc; /* xs: between two groups */
    const int first = kb == 0;
    if (p->bf16) {
        const uint16_t *wt[NC];
        for (int c = 0; c < NC; c++) wt[c] = (const uint16_t *)tile + (c0 + c) * p->k + kb;
#if BF16_PATH
        if (p->isa == ISA_AVX512) {
            MICRO_RB(micro_bf16_avx512, rb, xg, xs, wt, len, first, acc, ld);
            return;
        }
#endif
        MICRO_RB(micro_bf16_scalar, rb, xg, xs, wt, len, first, acc, ld);
    } else {
        const float *wt[NC];
        for (int c = 0; c < NC; c++) wt[c] = (const float *)tile + (c0 + c) * p->k + kb;
#if F32_PATH
        if (p->isa == ISA_AVX512) {
            MICRO_RB(micro_f32_avx512, rb, xg, xs, wt, len, first, acc, ld);
            return;
        }
#endif
#if F32_AVX2_PATH
        if (p->isa == ISA_AVX2) {
            MICRO_RB(micro_f32_avx2, rb, xg, xs, wt, len, first, acc, ld);
            return;
        }
#endif
        MICRO_RB(micro_f32_scalar, rb, xg, xs, wt, len, first, acc, ld);
    }
}

/* ---- The driver ------------------------------------------------------------------------------------ */

/* The next tile's blocks, asked into L2 a few cache lines at each micro-kernel call of this tile, so
 * that expanding them reads cache, not memory: at tens of rows and large n, expansion otherwise
 * waits on memory for a quarter of the time. Spread out, the requests stay off the kernel's way. */
typedef struct {
    const char *at, *end;
    int64_t step; /* lines a call */
} Ahead;

static Ahead ahead_of(const Plan *p, const uint8_t *w, int64_t j0, int64_t j1, int64_t calls) {
    const int64_t lo = j0 < p->n ? j0 : p->n, hi = j1 < p->n ? j1 : p->n;
    const Ahead a = {(const char *)w + lo * p->stride, (const char *)w + hi * p->stride,
                     ((hi - lo) * p->stride / 64 + calls - 1) / (calls > 0 ? calls : 1) + 1};
    return a;
}

static inline void ahead_step(Ahead *a) {
    for (int64_t q = 0; q < a->step && a->at < a->end; q++, a->at += 64) __builtin_prefetch(a->at, 0, 2);
}

/* Columns j0 .. j1 - 1 of y (a multiple of SPAN wide, clipped to n at the store): for each tile, expand
 * it, then for each chunk of rows, for each block of k, for each RV groups of 16 rows (their packed x
 * for this block of k stays in L1), run the micro-kernel over the tile's weight rows, NC at a time,
 * and write the chunk's outputs back. */
static void thread_columns(const Plan *p, const void *xp, const uint8_t *w, int64_t j0, int64_t j1, void *tile,
                           float *acc, void *y) {
    const int64_t groups = (p->rows + LANES - 1) / LANES, eb = p->bf16 ? 2 : 4;
    const int64_t row_blocks = (groups + RV - 1) / RV + (groups * LANES + p->chunk - 1) / p->chunk; /* at most */
    for (int64_t t0 = j0; t0 < j1; t0 += p->tile) {
        const int64_t cols = j1 - t0 < p->tile ? j1 - t0 : p->tile;
        expand_tile(p->fmt, p->bf16, w, p->stride, p->n, p->k, t0, cols, tile);
        Ahead next = ahead_of(p, w, t0 + cols, t0 + cols + p->tile < j1 ? t0 + cols + p->tile : j1,
                              row_blocks * ((p->k + p->kc - 1) / p->kc) * (cols / NC));
        for (int64_t m0 = 0; m0 < groups * LANES; m0 += p->chunk) {
            const int64_t ld = p->chunk, mg = (groups * LANES - m0 < ld ? groups * LANES - m0 : ld) / LANES;
            for (int64_t kb = 0; kb < p->k; kb += p->kc)
                for (int64_t g = 0; g < mg; g += RV) {
                    const int rb = mg - g < RV ? (int)(mg - g) : RV;
                    const char *xg = (const char *)xp + ((m0 / LANES + g) * p->k + kb) * LANES * eb;
                    for (int64_t c0 = 0; c0 < cols; c0 += NC) {
                        ahead_step(&next);
                        micro(p, rb, xg, tile, c0, kb, acc + c0 * ld + g * LANES, ld);
                    }
                }
            const int64_t nr = p->rows - m0 < ld ? p->rows - m0 : ld, nc = p->n - t0 < cols ? p->n - t0 : cols;
            store_y(acc, ld, nr, nc, y, p->ybf16, p->n, m0, t0);
        }
    }
}

/* y [rows, n] = x [rows, k] W^T. `mode`: MODE_F32 (x and y fp32, the fp32 variant), MODE_BF16 (x bf16 as
 * uint16, the bf16 variant, y fp32) or MODE_BF16_OUT (the same, y rounded to bf16). `isa`: ISA_BEST,
 * ISA_SCALAR, ISA_AVX2 (fp32) or ISA_AVX512. Returns 0; -1 for a format gguf_blocks.h lacks, a mode it
 * does not know or a k / stride / count that does not fit; -2 for a path not built; -3 when memory runs
 * out. */
int gemm_blocks_f32(const void *x, int mode, const uint8_t *w, int64_t stride, int fmt, void *y, int64_t rows,
                    int64_t k, int64_t n, int isa, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0 || n < 0) return -1;
    if (mode != MODE_F32 && mode != MODE_BF16 && mode != MODE_BF16_OUT) return -1;
    const int bf16 = mode != MODE_F32;
    isa = path_of(isa, gemm_blocks_isas_f32(bf16));
    if (isa < 0) return -2;
    if (rows == 0 || n == 0) return 0;
    const int eb = bf16 ? 2 : 4;
    const int64_t groups = (rows + LANES - 1) / LANES, units = (n + SPAN - 1) / SPAN;
    const Plan plan = {isa, bf16, mode == MODE_BF16_OUT, fmt, rows, k, n, stride, tile_cols(k, eb), k_block(k, eb),
                       groups * LANES < CHUNK ? groups * LANES : CHUNK};
    const size_t tile_bytes = (size_t)round_up(plan.tile * k * eb, 64);
    const size_t acc_bytes = (size_t)round_up(plan.tile * plan.chunk * 4, 64);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > units) nthreads = (int)units; /* a thread gets SPAN columns at least */
    void *xp = aligned_alloc(64, (size_t)round_up(groups * LANES * k * eb, 64));
    char *scratch = aligned_alloc(64, (tile_bytes + acc_bytes) * nthreads);
    if (!xp || !scratch) {
        free(xp);
        free(scratch);
        return -3;
    }
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        pack_x(x, rows, k * eb / 4, groups * t / nt, groups * (t + 1) / nt, xp);
#pragma omp barrier
        char *mine = scratch + (tile_bytes + acc_bytes) * t;
        thread_columns(&plan, xp, w, units * t / nt * SPAN, units * (t + 1) / nt * SPAN, mine,
                       (float *)(mine + tile_bytes), y);
    }
    free(xp);
    free(scratch);
    return 0;
}
