/* y = x W^T for a few rows of fp32 activations against weights kept exactly as the GGUF file stores
 * them: rows of blocks of any format gguf_blocks.h decodes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
 * Q2_K..Q6_K, IQ4_XS), one weight row after the other, no repacking.
 *
 * Why: at one to a few decode rows a matmul is bound by reading its weights, and a block is 2.6 to
 * 8.5 bits a weight against fp32's 32. The blocks are expanded in registers, 16 weights at a time,
 * and multiplied in fp32; the activations are never quantized.
 *
 * Arithmetic: each weight is expanded by gguf_blocks.h to fma(a, s, b), bit-equal to the reference's
 * fp32 weight (the argument is at the top of that file), so y differs from fp32 `x @ W.T` only by
 * the order of the sums.
 *
 * Order of the sums (the same on every path, whatever the number of rows or threads): each output
 * keeps 16 lanes; lane l adds w[k] x[k] for k = l mod 16 in increasing k with one fma each; the lanes
 * are then added as a fixed tree (l + 8, then + 4, + 2, + 1). The AVX-512 path holds the 16 lanes
 * in one register, the AVX2 path in two, the scalar path in an array, and all of them use fused
 * multiply-adds only where this order names one, so their results are bit-equal.
 *
 * x [rows, k] fp32; w [n, row_stride] bytes (each row k / block weights blocks); y [rows, n] fp32, rows
 * ldy apart (ldy > n: one part of a wider output, as the fused decode step's q/k/v in several formats).
 * Weight rows are split over the caller's OpenMP threads in groups of 4; within a group, rows of x
 * are taken 4 (AVX2: 2) at a time over the whole row, so the group's bytes are re-read from cache.
 */
#include "gguf_blocks.h"
#include "sum_tree.h"

enum { LANES = 16, MAX_ROWS = 16, GROUP = 4 };
/* Bytes each weight row is fetched ahead. A model's weights stream from DRAM at one request (a decode
 * step reads more than the last-level cache keeps), and 8 KiB covers its latency where 1 KiB did not:
 * SmolLM2 Q4_1, one request, 141-149 against 133-144 tok/s; its layers' GEMVs in sequence 3.7 against
 * 3.9 ms and its Q8_0 head 0.74-0.76 against 0.83-0.98 ms (Intel Xeon, 2 threads). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8192
#endif

/* Put after a block's maps are stored in a[] and b[]: the compiler then reads each map back from memory
 * where it is used (a broadcast load, on a load port) instead of keeping the vectors block_maps_avx2
 * built and taking each value out with shuffles, on the ports the weights' expansion itself needs.
 * The 1B shape's Q4_K matmuls, one row, ran at 36.6-37.3 against 31.4-32.5 GB/s (AMD EPYC, 2 threads);
 * with the maps' decode skipped altogether, at 43-46. The AVX2 path (built with -mno-avx512f on the
 * same CPU) timed the same either way, so it is left as it was. */
#define MAPS_IN_MEMORY() __asm__ volatile("" ::: "memory")

/* Portable path: one weight row at a time against up to MAX_ROWS rows of x. */
static void gemv_scalar(int fmt, const float *x, const uint8_t *w, int64_t stride, float *y, int64_t ldy,
                        int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float acc[MAX_ROWS][LANES] = {{0.f}}, a[16], b[16], wv[16];
        for (int64_t blk = 0; blk < k / bw; blk++) {
            const uint8_t *p = w + j * stride + blk * bs;
            block_maps(fmt, p, a, b);
            for (int v = 0; v < bw / 16; v++) {
                weights16(fmt, p, v, a[map_of(fmt, v)], b[map_of(fmt, v)], wv);
                for (int64_t r = 0; r < rows; r++) {
                    const float *xr = x + r * k + blk * bw + 16 * v;
                    for (int i = 0; i < 16; i++) acc[r][i] = fmaf(wv[i], xr[i], acc[r][i]);
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * ldy + j] = tree16(acc[r]);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Each row's bytes PREFETCH_AHEAD on; past the row's end, as far on in the rows `next` bytes further
 * (those this thread reads next: the group's other rows, or the next group's, its groups being
 * contiguous under the static schedule; a prefetch never faults). Without it the GEMV waits on its
 * first loads of every block. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *const wr[], int rows, int64_t blk,
                                                                 int bs, int bw, int64_t k, int64_t next) {
    const int64_t t = blk * bs + PREFETCH_AHEAD, row = k / bw * bs;
    const int64_t at = t < row ? t : next + t - row;
    for (int c = 0; c < rows; c++)
        for (int o = 0; o < (bs + 63) / 64; o++) _mm_prefetch((const char *)wr[c] + at + 64 * o, _MM_HINT_T0);
}

/* One group of 4 weight rows against RB rows of x (AVX2: 16 lanes = two registers), in two passes of
 * 2 weight rows. Why passes: AVX2 has 16 vector registers. All 4 rows at once kept 8 (one row of x)
 * or 16 (two) accumulators beside each row's broadcast maps, and the compiler spilled accumulators,
 * storing and reloading one with every few multiply-adds; 2 rows a pass fit (SmolLM2's Q4_1 matmuls
 * in cache: one row of x 9.2-9.3 against 7.5-8.7 GB/s, two rows 8.0 against 4.7-7.0; one request
 * on SmolLM2 Q4_1 decoded at 90-94 against 82-86 tok/s; AMD EPYC with AVX2 only, 2 threads). One
 * weight row a pass was no faster. The order of each output's sums is unchanged. */
static inline __attribute__((always_inline)) void tile_avx2(int fmt, int RB, const float *const xr[], int64_t k,
                                                            const uint8_t *const wr[GROUP], float out[][GROUP],
                                                            int64_t stride) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt), CB = GROUP / 2;
    for (int c0 = 0; c0 < GROUP; c0 += CB) {
        const uint8_t *const *w = wr + c0;
        __m256 acc[2][GROUP][2];
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < k / bw; blk++) {
            float a[GROUP][16], b[GROUP][16];
            prefetch_ahead(w, CB, blk, bs, bw, k, CB * stride);
            for (int c = 0; c < CB; c++) block_maps_avx2(fmt, w[c] + blk * bs, a[c], b[c]);
            UNROLL_RUNS for (int v = 0; v < bw / 16; v++)
                for (int c = 0; c < CB; c++) {
                    __m256 wv[2];
                    expand16_avx2(fmt, w[c] + blk * bs, v, a[c][map_of(fmt, v)], b[c][map_of(fmt, v)],
                                  folded_format(fmt), wv);
                    for (int r = 0; r < RB; r++) {
                        const float *xp = xr[r] + blk * bw + 16 * v;
                        acc[r][c][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xp), acc[r][c][0]);
                        acc[r][c][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xp + 8), acc[r][c][1]);
                    }
                }
        }
        for (int r = 0; r < RB; r++)
            for (int c = 0; c < CB; c++) out[r][c0 + c] = tree8_avx(_mm256_add_ps(acc[r][c][0], acc[r][c][1]));
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The maps of blocks blk0 .. blk0 + 15 (those before the row's end) of a group's rows, for the 32-weight
 * formats, whose block starts with d (Q4_1, Q5_1: then m): one gather of the 16 blocks' first 4 bytes
 * a row, converted as 32 fp16 halves, so that ab[c][2 i] is block blk0 + i's d and ab[c][2 i + 1] its m
 * (for the formats without m, the first two bytes after d: not read). Why: decoding each block's maps
 * alone (a scalar conversion and two register broadcasts a block) took as many vector instructions as
 * expanding its weights; converting the halves as they lie skips two narrowing moves a row (Q4_1, one
 * row of x, one thread: 12.2-12.6 against 11.7-12.0 GB/s). The values are half()'s, so the weights
 * stay bit-equal. */
static inline __attribute__((always_inline)) void maps16_avx512(int fmt, const uint8_t *const wr[GROUP], int64_t blk0,
                                                                int64_t left, float ab[GROUP][32]) {
    const int bs = block_bytes(fmt);
    const __mmask16 live = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(bs));
    for (int c = 0; c < GROUP; c++) {
        const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, wr[c] + blk0 * bs, 1);
        _mm512_storeu_ps(ab[c], _mm512_cvtph_ps(_mm512_castsi512_si256(head)));
        _mm512_storeu_ps(ab[c] + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(head, 1)));
    }
}

/* One group of 4 weight rows against RB rows of x (16 lanes = one register). */
static inline __attribute__((always_inline)) void tile_avx512(int fmt, int RB, const float *const xr[], int64_t k,
                                                              const uint8_t *const wr[GROUP], float out[][GROUP],
                                                              int64_t stride) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    __m512 acc[4][GROUP];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < GROUP; c++) acc[r][c] = _mm512_setzero_ps();
    float lab[GROUP][32];
    for (int64_t blk = 0; blk < k / bw; blk++) {
        float a[GROUP][16], b[GROUP][16];
        prefetch_ahead(wr, GROUP, blk, bs, bw, k, GROUP * stride);
        if (bw == 32) {
            if (blk % 16 == 0) maps16_avx512(fmt, wr, blk, k / bw - blk, lab);
            const int has_min = fmt == GGML_Q4_1 || fmt == GGML_Q5_1, at = 2 * (int)(blk % 16);
            for (int c = 0; c < GROUP; c++) a[c][0] = lab[c][at], b[c][0] = has_min ? lab[c][at + 1] : -0.f;
        } else {
            for (int c = 0; c < GROUP; c++) block_maps_avx2(fmt, wr[c] + blk * bs, a[c], b[c]);
            MAPS_IN_MEMORY();
        }
#if defined(__AVX512BW__)
        if (wide_format(fmt)) { /* 4 runs decoded at once (bytes64), run v4 + i from 16-byte lane i */
            _Pragma("GCC unroll 4") for (int v4 = 0; v4 < bw / 16; v4 += 4) {
                __m512i q64[GROUP];
                for (int c = 0; c < GROUP; c++) q64[c] = bytes64(fmt, wr[c] + blk * bs, v4);
#define WIDE_RUN(i, LANE)                                                                                  \
    do {                                                                                                   \
        const int v = v4 + i;                                                                              \
        __m512 wv[GROUP];                                                                                  \
        for (int c = 0; c < GROUP; c++)                                                                    \
            wv[c] = _mm512_fmadd_ps(_mm512_set1_ps(a[c][map_of(fmt, v)]),                                  \
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(LANE)),                        \
                                    _mm512_set1_ps(b[c][map_of(fmt, v)]));                                 \
        for (int r = 0; r < RB; r++) {                                                                     \
            const __m512 xv = _mm512_loadu_ps(xr[r] + blk * bw + 16 * v);                                  \
            for (int c = 0; c < GROUP; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);             \
        }                                                                                                  \
    } while (0)
                WIDE_RUN(0, _mm512_castsi512_si128(q64[c]));
                WIDE_RUN(1, _mm512_extracti32x4_epi32(q64[c], 1));
                WIDE_RUN(2, _mm512_extracti32x4_epi32(q64[c], 2));
                WIDE_RUN(3, _mm512_extracti32x4_epi32(q64[c], 3));
#undef WIDE_RUN
            }
            continue;
        }
#endif
        /* Unrolled whole, each run's offsets are constants and the runs of a map share its broadcasts:
         * the 1B shape's Q4_K matmuls, one row, ran at 30.5-31.1 against 28.0-28.2 GB/s (AMD EPYC,
         * 2 threads), where the loop kept 4 runs a turn with their index arithmetic. */
        UNROLL_RUNS for (int v = 0; v < bw / 16; v++) {
            __m512 wv[GROUP];
            for (int c = 0; c < GROUP; c++) {
                wv[c] = weights16_avx512(fmt, wr[c] + blk * bs, v, a[c][map_of(fmt, v)], b[c][map_of(fmt, v)]);
            }
            for (int r = 0; r < RB; r++) {
                const __m512 xv = _mm512_loadu_ps(xr[r] + blk * bw + 16 * v);
                for (int c = 0; c < GROUP; c++) acc[r][c] = _mm512_fmadd_ps(wv[c], xv, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < GROUP; c++) {
            const __m256 lo = _mm512_castps512_ps256(acc[r][c]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
            out[r][c] = tree8_avx(_mm256_add_ps(lo, hi));
        }
}
#endif

/* Calls TILE with the format and the row count as compile-time constants: one specialized copy of
 * the inner loop each, with no branch per block. */
#define TILE_RB(TILE, F, rb, ...) (rb == 1 ? TILE(F, 1, __VA_ARGS__) : TILE(F, TILE_ROWS, __VA_ARGS__))
#define TILE_FMT(TILE, fmt, rb, ...) WITH_FORMAT(fmt, F, TILE_RB(TILE, F, rb, __VA_ARGS__))

/* The vector paths: groups of 4 weight rows over the threads (the last group repeats its last row,
 * whose copies are computed and dropped); rows of x one at a time when one is left, else in tiles of
 * TILE_ROWS (4; AVX2: 2) where a short tile repeats its last row: a repeated row costs one fma a
 * weight, expanding the weights again would cost several. */
static void gemv_vector(int isa, int fmt, const float *x, const uint8_t *w, int64_t stride, float *y,
                        int64_t ldy, int64_t rows, int64_t k, int64_t n, int nthreads) {
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const int most = isa == ISA_AVX512 ? 4 : 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wr[GROUP];
        for (int c = 0; c < GROUP; c++) wr[c] = w + (GROUP * g + c < n ? GROUP * g + c : n - 1) * stride;
        for (int64_t r0 = 0; r0 < rows;) {
            const int rb = rows - r0 == 1 ? 1 : most, real = rows - r0 < rb ? (int)(rows - r0) : rb;
            const float *xr[4];
            float out[4][GROUP];
            for (int r = 0; r < 4; r++) xr[r] = x + (r0 + (r < real ? r : real - 1)) * k;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TILE_ROWS 4
            if (isa == ISA_AVX512) TILE_FMT(tile_avx512, fmt, rb, xr, k, wr, out, stride);
#undef TILE_ROWS
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TILE_ROWS 2
            if (isa == ISA_AVX2) TILE_FMT(tile_avx2, fmt, rb, xr, k, wr, out, stride);
#undef TILE_ROWS
#endif
            for (int r = 0; r < real; r++)
                for (int c = 0; c < GROUP && GROUP * g + c < n; c++) y[(r0 + r) * ldy + GROUP * g + c] = out[r][c];
            r0 += real;
        }
    }
}

/* Bit i set when path i (ISA_SCALAR, ISA_AVX2, ISA_AVX512) was built into this library. */
int gemv_kquant_isas_f32(void) {
    int isas = 1 << ISA_SCALAR;
#if defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX2;
#endif
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX512;
#endif
    return isas;
}

/* y [rows, n] (rows ldy apart) = x [rows, k] W^T. `isa`: ISA_BEST or one path. Returns 0, -1 for a
 * format this file lacks or a k / stride / ldy that does not fit it, -2 for a path not built. */
int gemv_kquant_strided_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t ldy,
                            int64_t rows, int64_t k, int64_t n, int isa, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0 || n < 0 || ldy < n) return -1;
    isa = path_of(isa, gemv_kquant_isas_f32());
    if (isa < 0) return -2;
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) { /* the scalar path's accumulators hold MAX_ROWS */
        const int64_t mr = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        if (isa == ISA_SCALAR) gemv_scalar(fmt, x + r0 * k, w, stride, y + r0 * ldy, ldy, mr, k, n, nthreads);
        else gemv_vector(isa, fmt, x + r0 * k, w, stride, y + r0 * ldy, ldy, mr, k, n, nthreads);
    }
    return 0;
}

/* y [rows, n] = x [rows, k] W^T, y contiguous (gemv_kquant_strided_f32 with ldy = n). */
int gemv_kquant_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t rows,
                    int64_t k, int64_t n, int isa, int nthreads) {
    return gemv_kquant_strided_f32(x, w, stride, fmt, y, n, rows, k, n, isa, nthreads);
}
