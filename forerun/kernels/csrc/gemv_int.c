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
 * x [rows, k] fp32; w [n, stride] bytes (rows of blocks of 32 or 256 weights); y [rows, n], rows
 * ldy apart. Weight rows are split over the caller's OpenMP threads; each weight row is decoded once
 * for up to 4 rows of x. The vector path works on 256-bit vectors: 32 weights are one register, and at
 * 256 bits these CPUs issue integer and shuffle work on three ports, at 512 on two.
 */
#include <stdlib.h>

#include "gguf_blocks.h"
#include "int_activations.h"
#include "sum_tree.h"

enum { QK = 32, LANES = 16, TILE = 4, WROWS = 3, WROWS_MAX_K = 2048 };
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif

/* The formats this file reads: those whose runs of 16 share a map per 32 weights, or have no
 * minimum (Q2_K's minimum changes every 16 weights, and IQ4_XS's runs of one sub-block decode with
 * different shifts). */
static inline int int_format(int fmt) {
    return fmt == GGML_Q4_0 || fmt == GGML_Q4_1 || fmt == GGML_Q5_0 || fmt == GGML_Q5_1 || fmt == GGML_Q8_0 ||
           fmt == GGML_IQ4_NL || fmt == GGML_Q3_K || fmt == GGML_Q4_K || fmt == GGML_Q5_K || fmt == GGML_Q6_K;
}

/* The formats whose codes_avx2 codes are the signed integers s themselves (the others': unsigned). */
static inline int signed_codes(int fmt) { return fmt == GGML_Q8_0 || fmt == GGML_IQ4_NL; }

/* What the unsigned code u the vector paths build exceeds s by: u = s + offset, 0 <= u < 256 (the
 * signed formats' codes move by 128; the others' by what the reference subtracts, gguf_blocks.h). */
static inline int code_offset(int fmt) { return signed_codes(fmt) ? 128 : offset_of(fmt); }

/* The formats whose runs of 16 widen to 16 bits in place (one byte or nibble a weight, no high part,
 * no table): their 16-bit activations take int_activations.h's natural layout, the others' the
 * unpacked one. */
static inline int natural16(int fmt) {
    return fmt == GGML_Q4_0 || fmt == GGML_Q4_1 || fmt == GGML_Q4_K || fmt == GGML_Q8_0;
}

static inline int has_min(int fmt) {
    return fmt == GGML_Q4_1 || fmt == GGML_Q5_1 || fmt == GGML_Q4_K || fmt == GGML_Q5_K;
}

/* Whether the two runs of 16 in a block of 32 have maps of their own (Q3_K, Q6_K). */
static inline int map_a_run(int fmt) { return map_of(fmt, 0) != map_of(fmt, 1); }

/* Where a block's 16 bytes of nibbles (Q8_0: 32 bytes of codes) start, and its 32 high bits (Q5_*). */
static inline int qs_at(int fmt) {
    switch (fmt) {
        case GGML_Q4_1: return 4;
        case GGML_Q5_0: return 6;
        case GGML_Q5_1: return 8;
        default: return 2;
    }
}
static inline int qh_at(int fmt) { return fmt == GGML_Q5_1 ? 4 : 2; }

/* The minimum's sums added to the 16 lanes' tree, as the file's comment says (two, or eight for the K-quants). */
static inline float finish(int fmt, float tree, const float ms[8]) {
    if (!has_min(fmt)) return tree;
    return block_weights(fmt) == QK ? tree + (ms[0] + ms[1]) : tree + tree8(ms);
}

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
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#endif

/* The 32 codes of weights 32j .. 32j + 31 of a block in weight order: unsigned u = s + code_offset for
 * the nibble and K formats, signed s for Q8_0 and IQ4_NL. */
static inline __attribute__((always_inline)) __m256i codes_avx2(int fmt, const uint8_t *blk, int j) {
    if (block_weights(fmt) == 256) /* runs 2j and 2j + 1 lie in 32 consecutive bytes, with one shift */
        return byte_fields(run_of(fmt, blk, 2 * j), 1);
    const uint8_t *qs = blk + qs_at(fmt);
    if (fmt == GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)qs);
    /* The 16 bytes in both halves (a load), the high half shifted by 4: low nibbles then high ones. */
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    __m256i u = _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0xF));
    if (fmt == GGML_IQ4_NL) {
        const __m128i levels = _mm_loadu_si128((const __m128i *)IQ4_LEVELS);
        return _mm256_shuffle_epi8(_mm256_set_m128i(levels, levels), u);
    }
    if (fmt == GGML_Q5_0 || fmt == GGML_Q5_1) { /* bit i of qh into byte i's bit 4 */
        uint32_t qh;
        memcpy(&qh, blk + qh_at(fmt), 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                                   _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                                     0x0101010101010101LL, 0));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return u;
}

/* 8 lanes of P = sum of s q over 4 weights, for 8-bit q. `c` as codes_avx2 gives it; `ol` the lanes'
 * offset terms. The unsigned codes (u < 64: the nibble and K formats) multiply q directly (pairs of u q fit
 * vpmaddubsw's 16 bits), and the offset's term is taken off after: three instructions where the signed
 * form's sign juggling takes five. The signed codes go through |s| and q given s's sign (|s| <= 128, |q| <= 127). */
static inline __attribute__((always_inline)) __m256i lane_dots8(int fmt, __m256i c, __m256i q, const int32_t *ol) {
#if defined(HAVE_VNNI)
    if (signed_codes(fmt))
        return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, q);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (signed_codes(fmt))
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c)), ones);
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), ones);
#endif
    return code_offset(fmt) ? _mm256_sub_epi32(p, _mm256_loadu_si256((const __m256i *)ol)) : p;
}

/* Run v's 16 codes widened to 16 bits in place, for the formats natural16 names: 16 bytes zero-extended
 * (Q8_0: sign-extended), a nibble shifted down and, for the low one, masked. Two of these replace a
 * 32-byte register's build and two unpacks: one thread, cycles a 8 weights, 64 x 2048 in cache /
 * 8192 x 2048 on two threads, Q4_0 1.44 against 1.54 / -, Q4_1 1.59 against 1.65 / 1.35 against 1.45,
 * Q4_K 1.53 against 1.60 / 1.27 against 1.36-1.47, Q8_0 1.27 against 1.38 / 1.05 against 1.14 (AMD
 * EPYC, AVX2 only). */
static inline __attribute__((always_inline)) __m256i run16_avx2(int fmt, const uint8_t *blk, int v) {
    const Run r = run_of(fmt, blk, v);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)r.lo);
    if (fmt == GGML_Q8_0) return _mm256_cvtepi8_epi16(bytes);
    const __m256i w = _mm256_srli_epi16(_mm256_cvtepu8_epi16(bytes), r.ls);
    return r.ls == 4 ? w : _mm256_and_si256(w, _mm256_set1_epi16(0xF));
}

/* The 32 codes of weights 32j .. 32j + 31 of a block as two registers of 16-bit codes, in the order
 * of the format's 16-bit layout: in place (natural16), or codes_avx2's bytes unpacked within each
 * 128-bit half (zero-extended, or sign-extended for the signed formats). */
static inline __attribute__((always_inline)) void codes16_avx2(int fmt, const uint8_t *blk, int j, __m256i w[2]) {
    if (natural16(fmt)) {
        w[0] = run16_avx2(fmt, blk, 2 * j);
        w[1] = run16_avx2(fmt, blk, 2 * j + 1);
        return;
    }
    const __m256i c = codes_avx2(fmt, blk, j);
    const __m256i ext = signed_codes(fmt) ? _mm256_cmpgt_epi8(_mm256_setzero_si256(), c) : _mm256_setzero_si256();
    w[0] = _mm256_unpacklo_epi8(c, ext);
    w[1] = _mm256_unpackhi_epi8(c, ext);
}

/* 8 lanes of P for 16-bit q: two vpmaddwd and one add over codes16_avx2's registers. Pairs of s q and
 * their sums fit 32 bits (4 |s| |q| <= 4 * 255 * 32767). */
static inline __attribute__((always_inline)) __m256i lane_dots16(int fmt, const __m256i w[2], const int16_t *q,
                                                                  const int32_t *ol) {
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)q)),
                                       _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)q + 1)));
    return signed_codes(fmt) || !code_offset(fmt) ? p : _mm256_sub_epi32(p, _mm256_loadu_si256((const __m256i *)ol));
}

/* x's block xb (of each of the RB rows) against weights 32j .. 32j + 31 of the weight block at blk,
 * each row's lanes scaled by scale[r], into chain h. */
static inline __attribute__((always_inline)) void add_block_avx2(int fmt, int bits, int RB, const qx_t *qx, const int64_t xr[],
                                                                 int64_t nb, int64_t xb, const uint8_t *blk, int j,
                                                                 const __m256 scale[], int h, __m256 acc[][2]) {
    __m256i c = _mm256_setzero_si256(), w[2];
    if (bits == 8) c = codes_avx2(fmt, blk, j);
    else codes16_avx2(fmt, blk, j, w);
    for (int r = 0; r < RB; r++) {
        const int64_t at = xr[r] * nb + xb;
        const __m256i p = bits == 8 ? lane_dots8(fmt, c, _mm256_loadu_si256((const __m256i *)((const int8_t *)qx->q + at * QK)),
                                                 qx->ol + at * 8)
                                    : lane_dots16(fmt, w, (const int16_t *)qx->q + at * QK, qx->ol + at * 8);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale[r], acc[r][h]);
    }
}

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
        float a[16], bm[16];
        __m256 msv[TILE], sv[TILE][2];
        for (int r = 0; r < RB; r++) msv[r] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb / 8; sb++) { /* super-blocks of 256: x's blocks 8 sb .. 8 sb + 7 */
            const uint8_t *blk = wrow + sb * bs;
            for (int o = 0; o < bs; o += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + o, _MM_HINT_T0);
            block_maps_avx2(fmt, blk, a, bm);
            /* Each row's 8 blocks' scales a dx at once (a run's own map: its 16 runs' a against dx
             * repeated), and the minimum's 8 terms, lane j for sub-block j. */
            for (int r = 0; r < RB; r++) {
                const int64_t at = xr[r] * nb + 8 * sb;
                const __m256 dx = _mm256_loadu_ps(qx->dx + at);
                if (map_a_run(fmt)) {
                    const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
                    sv[r][0] = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_permutevar8x32_ps(dx, lo));
                    sv[r][1] = _mm256_mul_ps(_mm256_loadu_ps(a + 8),
                                             _mm256_permutevar8x32_ps(dx, _mm256_add_epi32(lo, _mm256_set1_epi32(4))));
                } else {
                    sv[r][0] = _mm256_mul_ps(_mm256_loadu_ps(a), dx);
                }
                if (has_min(fmt)) msv[r] = _mm256_fmadd_ps(_mm256_loadu_ps(bm), _mm256_loadu_ps(qx->sx + at), msv[r]);
            }
            /* With one map a block, block j's scale is element j, broadcast from memory: a load, where a
             * lane permute issues once per 1.3 cycles on an AMD EPYC with AVX2 only (Q4_K one thread,
             * 256 x 8192: 1.18 against 1.25 cycles a 8 weights; same results). */
            float st[TILE][8];
            if (!map_a_run(fmt))
                for (int r = 0; r < RB; r++) _mm256_storeu_ps(st[r], sv[r][0]);
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
                /* block j's lanes: scale j; with a map a run, run 2j's for lanes 0-3 and 2j + 1's for 4-7 */
                const int e = 2 * (j % 4);
                const __m256i pick = _mm256_setr_epi32(e, e, e, e, e + 1, e + 1, e + 1, e + 1);
                for (int r = 0; r < RB; r++)
                    scale[r] = map_a_run(fmt) ? _mm256_permutevar8x32_ps(sv[r][j / 4], pick)
                                              : _mm256_broadcast_ss(st[r] + j);
                add_block_avx2(fmt, bits, RB, qx, xr, nb, 8 * sb + j, blk, j, scale, j & 1, acc);
            }
        }
        for (int r = 0; r < RB; r++) _mm256_storeu_ps(ms[r], msv[r]);
    }
    for (int r = 0; r < RB; r++) out[r] = finish(fmt, tree8_avx(_mm256_add_ps(acc[r][0], acc[r][1])), ms[r]);
}

/* One row of x against WR adjacent weight rows (stride apart) of 32 weights a block: each output's
 * arithmetic is row_avx2's with one row of x. Why: over short rows (SmolLM2's 576 inputs: 18 blocks) a
 * weight row's setup and final sum cost ~25 cycles its blocks did not hide; three rows interleave them
 * and share x's loads (one thread, 3072 x 576 in cache, cycles a 8 weights, AMD EPYC with AVX2: Q4_1
 * 1.64 -> 1.37, Q8_0 1.35 -> 0.98, Q5_0 2.07 -> 1.80, Q4_0 1.50 -> 1.17; 256 x 8192 unchanged). Their
 * bytes are one run, fetched ahead as one stream (a prefetch a row was slower from memory). */
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
    for (int64_t b = 0; b < nb; b += 2) {
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

/* wrows_avx2 for the formats of 32 weights a block, WR a compile-time constant. */
#define WROWS_FMT(bits, WR, fmt, ...)                                                                   \
    do {                                                                                             \
        switch (fmt) {                                                                               \
            case GGML_Q4_0: wrows_avx2(GGML_Q4_0, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q4_1: wrows_avx2(GGML_Q4_1, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q5_0: wrows_avx2(GGML_Q5_0, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q5_1: wrows_avx2(GGML_Q5_1, bits, WR, __VA_ARGS__); break;                     \
            case GGML_Q8_0: wrows_avx2(GGML_Q8_0, bits, WR, __VA_ARGS__); break;                     \
            default: wrows_avx2(GGML_IQ4_NL, bits, WR, __VA_ARGS__); break;                          \
        }                                                                                            \
    } while (0)

/* One row of x over a format of 32 weights a block: weight rows WROWS at a time over the threads (rows of
 * up to WROWS_MAX_K weights: over longer ones from memory, 2048 x 8192 Q8_0, the one stream lost). */
static void gemv_one_row(int fmt, int bits, const qx_t *qx, const uint8_t *w, int64_t stride, float *y, int64_t k,
                         int64_t n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j += WROWS) {
        if (j + WROWS <= n && bits == 8) WROWS_FMT(8, WROWS, fmt, qx, w + j * stride, stride, k, y + j);
        else if (j + WROWS <= n) WROWS_FMT(16, WROWS, fmt, qx, w + j * stride, stride, k, y + j);
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
    if (rows == 1 && block_weights(fmt) == QK && k <= WROWS_MAX_K) {
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

/* Bit i set when path i (ISA_SCALAR, ISA_AVX2) was built; the AVX2 path uses AVX-512 VNNI's 256-bit
 * dot product for 8-bit activations where the CPU has it. */
int gemv_int_isas_f32(void) {
    int isas = 1 << ISA_SCALAR;
#if defined(__AVX2__) && defined(__FMA__)
    isas |= 1 << ISA_AVX2;
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
    if (quantize_x(x, rows, k, bits, natural16(fmt), code_offset(fmt), isa == ISA_SCALAR, &qx) != 0) {
        free_x(&qx);
        return -3;
    }
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
