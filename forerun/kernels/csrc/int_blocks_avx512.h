/* The GEMV over integer activations (gemv_int.c) at 512 bits: two of x's blocks of 32 a register.
 *
 * Why: on the AVX2 path a block of 32 weights takes about a dozen 256-bit operations (its codes widened
 * in two halves, two vpmaddwd and an add, a conversion and an fma), and at one decode row that, not
 * memory, bounds the Q4_K GEMV (about 30 GB/s on an AMD EPYC with avx512_bf16, whose memory gives
 * more). Here blocks b and b + 1 (b even) meet in one register: their codes are built by 512-bit
 * operations, AVX-512 VNNI's vpdpwssd (vpdpbusd for 8 bits) multiplies and adds in one instruction, and
 * one conversion and one fma serve both blocks.
 *
 * The arithmetic is gemv_int.c's, bit for bit. The 16 fp32 lanes of an output are one register: block
 * b's 8 lanes in the low half (chain 0: b even) and b + 1's in the high half (chain 1), each lane's
 * integer P the same 4 weights' exact sum, scaled by the same product a * dx. For 16 bits, the pair's
 * activations are laid out so that two vpdpwssd give each lane its 4 products: x's codes 0-15 of b and
 * of b + 1, then 16-31 of each (quantize_x's `paired`); the weights' two registers hold, in the same
 * order, what codes16_avx2's two give for each block. 8 bits keep the plain layout (a lane's 4 codes are
 * consecutive, so one vpdpbusd over the pair's 64 codes gives both blocks' P).
 *
 * A row of an odd number of 32-weight blocks ends with one block alone, added with the AVX2 code.
 */
#ifndef FORERUN_INT_BLOCKS_AVX512_H
#define FORERUN_INT_BLOCKS_AVX512_H
#include "int_blocks.h"

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX2__) && defined(__FMA__)
#define HAVE_INT512 1

/* Two 16-byte loads as one 256-bit register (lo in the low half). */
static inline __attribute__((always_inline)) __m256i load2x16(const uint8_t *lo, const uint8_t *hi) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)lo)),
                                   _mm_loadu_si128((const __m128i *)hi), 1);
}

/* The 64 codes of a pair in weight order, as codes_avx2 gives each block's 32 (block b's in the low
 * half): b0, b1 the two weight blocks (j = 0), or for the K-quants one super-block twice and j the
 * pair's first block in it (even). */
static inline __attribute__((always_inline)) __m512i codes64_avx512(int fmt, const uint8_t *b0, const uint8_t *b1,
                                                                    int j) {
    if (fmt == GGML_Q4_K) { /* both blocks: the low, then the high nibbles of the same 32 bytes */
        const Run r = run_of(fmt, b0, 2 * j);
        const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)r.lo));
        return _mm512_and_si512(srl_lanes(both, 0, 0, 4, 4), _mm512_set1_epi8(0xF));
    }
    if (block_weights(fmt) == 256) { /* runs 2j .. 2j + 3: bytes64's unsigned fields */
        return fields64(fmt, b0, 2 * j);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(codes_avx2(fmt, b0, 0)), codes_avx2(fmt, b1, 0), 1);
}

/* The pair's 16-bit codes: z[0] multiplies x's codes 0-15 of b and of b + 1, z[1] codes 16-31, in the
 * order codes16_avx2 gives them (the formats natural16 names: in place; the others: the pair's bytes
 * unpacked within each 128-bit lane, which puts b's weights 0-7, 16-23 then b + 1's in z[0]). */
static inline __attribute__((always_inline)) void codes32x2_avx512(int fmt, const uint8_t *b0, const uint8_t *b1,
                                                                   int j, __m512i z[2]) {
    const __m512i nib = _mm512_set1_epi16(0xF);
    if (fmt == GGML_Q4_K) { /* runs 2j, 2j + 2 (low, high nibbles of 16 bytes), then 2j + 1, 2j + 3 */
        const uint8_t *lo = run_of(fmt, b0, 2 * j).lo;
        for (int h = 0; h < 2; h++) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(lo + 16 * h))));
            z[h] = _mm512_and_si512(srl_lanes(w, 0, 0, 4, 4), nib);
        }
        return;
    }
    if (fmt == GGML_Q8_0) {
        for (int h = 0; h < 2; h++) z[h] = _mm512_cvtepi8_epi16(load2x16(b0 + 2 + 16 * h, b1 + 2 + 16 * h));
        return;
    }
    if (fmt == GGML_Q4_0 || fmt == GGML_Q4_1) { /* run 0: the low nibbles of 16 bytes, run 1 the high */
        const __m512i w = _mm512_cvtepu8_epi16(load2x16(b0 + qs_at(fmt), b1 + qs_at(fmt)));
        z[0] = _mm512_and_si512(w, nib);
        z[1] = _mm512_srli_epi16(w, 4);
        return;
    }
    const __m512i c = codes64_avx512(fmt, b0, b1, j);
    const __m512i ext = signed_codes(fmt) ? _mm512_movm_epi8(_mm512_movepi8_mask(c)) : _mm512_setzero_si512();
    z[0] = _mm512_unpacklo_epi8(c, ext);
    z[1] = _mm512_unpackhi_epi8(c, ext);
}

/* The pair's P (block b's 8 lanes, then b + 1's) against one row of x's codes at pair `at` (x's block
 * index of b), given the weights' codes: for 8 bits c (codes64_avx512), for 16 bits z. */
static inline __attribute__((always_inline)) __m512i pair_dots(int fmt, int bits, __m512i c, const __m512i z[2],
                                                              const qx_t *qx, int64_t at) {
    __m512i p;
    if (bits == 8) {
        const __m512i q = _mm512_loadu_si512((const int8_t *)qx->q + at * QK);
        if (signed_codes(fmt)) /* |s| times q given s's sign (|q| <= 127: the negation fits) */
            return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(c),
                                       _mm512_mask_sub_epi8(q, _mm512_movepi8_mask(c), _mm512_setzero_si512(), q));
        p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, q);
    } else {
        const int16_t *q = (const int16_t *)qx->q + at * QK;
        p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), z[0], _mm512_loadu_si512(q)), z[1],
                                _mm512_loadu_si512(q + 32));
        if (signed_codes(fmt)) return p;
    }
    return code_offset(fmt) ? _mm512_sub_epi32(p, _mm512_loadu_si512(qx->ol + at * 8)) : p;
}

/* Weight blocks b0, b1 (or a super-block's blocks j, j + 1) against RB rows of x at pair index `at`
 * (row r's at xr[r] * nb + at), each row's lanes scaled by scale[r], into acc[r]. */
static inline __attribute__((always_inline)) void add_pair_avx512(int fmt, int bits, int RB, const qx_t *qx,
                                                                  const int64_t xr[], int64_t nb, int64_t at,
                                                                  const uint8_t *b0, const uint8_t *b1, int j,
                                                                  const __m512 scale[], __m512 acc[]) {
    __m512i c = _mm512_setzero_si512(), z[2];
    if (bits == 8) c = codes64_avx512(fmt, b0, b1, j);
    else codes32x2_avx512(fmt, b0, b1, j, z);
    for (int r = 0; r < RB; r++) {
        const __m512i p = pair_dots(fmt, bits, c, z, qx, xr[r] * nb + at);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale[r], acc[r]);
    }
}

/* Super-block sb of a K-quant weight row against RB rows of x: its 4 pairs into acc, its minimum's 8
 * terms into msv (superblock_avx2's scales and terms, 16 lanes a pair). */
static inline __attribute__((always_inline)) void superblock_avx512(int fmt, int bits, int RB, const qx_t *qx,
                                                                    const int64_t xr[], int64_t nb, int64_t sb,
                                                                    const uint8_t *blk, __m512 acc[], __m256 msv[]) {
    float a[16], bm[16];
    __m512 sv[TILE];
    block_maps_avx2(fmt, blk, a, bm);
    for (int r = 0; r < RB; r++) {
        const int64_t at = xr[r] * nb + 8 * sb;
        const __m256 dx = _mm256_loadu_ps(qx->dx + at);
        if (map_a_run(fmt)) { /* run v's a times dx of its block v / 2 */
            /* a's halves loaded as block_maps_avx2 stored them: one 512-bit load of two 256-bit stores
             * waits for both to reach the cache (Q6_K, one weight row in L2: 53 against 34 ps a weight) */
            const __m512 av = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(a + 8), 1);
            sv[r] = _mm512_mul_ps(av, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                                            _mm512_castps256_ps512(dx)));
        } else {
            sv[r] = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_loadu_ps(a), dx));
        }
        if (has_min(fmt)) msv[r] = _mm256_fmadd_ps(_mm256_loadu_ps(bm), _mm256_loadu_ps(qx->sx + at), msv[r]);
    }
    _Pragma("GCC unroll 4") for (int j = 0; j < 8; j += 2) {
        /* lanes 0-7 take block j's scale, 8-15 block j + 1's; with a map a run, each half's two runs */
        const __m512i pick = map_a_run(fmt)
                                 ? _mm512_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                     2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 2, 2 * j + 3, 2 * j + 3,
                                                     2 * j + 3, 2 * j + 3)
                                 : _mm512_setr_epi32(j, j, j, j, j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1,
                                                     j + 1, j + 1);
        __m512 scale[TILE];
        for (int r = 0; r < RB; r++) scale[r] = _mm512_permutexvar_ps(pick, sv[r]);
        add_pair_avx512(fmt, bits, RB, qx, xr, nb, 8 * sb + j, blk, blk, j, scale, acc);
    }
}

#endif
#endif
