/* How the GEMV over integer activations (gemv_int.c) reads its formats: which it takes, how a
 * block's codes are built and multiplied by x's integer codes into 8 lanes, and, on AVX2, a block of 32
 * weights and a K-quant super-block against a few rows of x. gemv_int.c's comment gives the arithmetic;
 * its row loops, threads and entry points are there. */
#ifndef FORERUN_INT_BLOCKS_H
#define FORERUN_INT_BLOCKS_H
#include <stdlib.h>

#include "gguf_blocks.h"
#include "int_activations.h"
#include "sum_tree.h"

enum { QK = 32, TILE = 4 }; /* weights an x block holds; rows of x a weight row meets at once */

/* The formats gemv_int.c reads: those whose runs of 16 share a map per 32 weights, or have no
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

/* The minimum's sums added to the 16 lanes' tree, as gemv_int.c's comment says (two, or eight for the
 * K-quants). */
static inline float finish(int fmt, float tree, const float ms[8]) {
    if (!has_min(fmt)) return tree;
    return block_weights(fmt) == QK ? tree + (ms[0] + ms[1]) : tree + tree8(ms);
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

/* Super-block sb (x's blocks 8 sb .. 8 sb + 7) of a K-quant weight row against RB rows of x: its blocks
 * into acc, its minimum's 8 terms into msv. */
static inline __attribute__((always_inline)) void superblock_avx2(int fmt, int bits, int RB, const qx_t *qx,
                                                                  const int64_t xr[], int64_t nb, int64_t sb,
                                                                  const uint8_t *blk, __m256 acc[][2], __m256 msv[]) {
    float a[16], bm[16];
    __m256 sv[TILE][2], scale[TILE];
    block_maps_avx2(fmt, blk, a, bm);
    /* Each row's 8 blocks' scales a dx at once (a run's own map: its 16 runs' a against dx
     * repeated), and the minimum's 8 terms, lane j for sub-block j. */
    for (int r = 0; r < RB; r++) {
        const int64_t at = xr[r] * nb + 8 * sb;
        if (map_a_run(fmt)) {
            /* sv[r][h]: the even runs' scales of blocks 4h .. 4h + 3 in the low half, the odd runs' in
             * the high half, so block j's lanes take theirs with one in-lane permute (vpermilps) where
             * a lane-crossing one per block cost more (one thread, 4096 weights in L1, AMD EPYC with
             * AVX2 only: Q6_K 5.4 against 5.6 cycles a block of 32, Q3_K 5.95 against 6.25). */
            const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            for (int h = 0; h < 2; h++)
                sv[r][h] = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(a + 8 * h), split),
                                         _mm256_broadcast_ps((const __m128 *)(qx->dx + at + 4 * h)));
        } else {
            sv[r][0] = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(qx->dx + at));
        }
        if (has_min(fmt)) msv[r] = _mm256_fmadd_ps(_mm256_loadu_ps(bm), _mm256_loadu_ps(qx->sx + at), msv[r]);
    }
    /* With one map a block, block j's scale is element j, broadcast from memory: a load, where a lane
     * permute issues once per 1.3 cycles on an AMD EPYC with AVX2 only (Q4_K one thread, 256 x 8192:
     * 1.18 against 1.25 cycles a 8 weights; same results). */
    float st[TILE][8];
    if (!map_a_run(fmt))
        for (int r = 0; r < RB; r++) _mm256_storeu_ps(st[r], sv[r][0]);
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
        /* block j's lanes: scale j; with a map a run, run 2j's for lanes 0-3 and 2j + 1's for 4-7 */
        for (int r = 0; r < RB; r++)
            scale[r] = map_a_run(fmt) ? _mm256_permute_ps(sv[r][j / 4], (j % 4) * 0x55) : _mm256_broadcast_ss(st[r] + j);
        add_block_avx2(fmt, bits, RB, qx, xr, nb, 8 * sb + j, blk, j, scale, j & 1, acc);
    }
}

#endif  /* AVX2 and FMA */
#endif
