/* The AVX-512 decoders of GGUF blocks, split from gguf_blocks.h, which includes this file at its end
 * (it is not included on its own): run v's 16 weights in one register, Q2_K and the wide formats' four runs
 * from one set of 512-bit operations, and the bf16 weights of the AVX512_BF16 block matmul. Each gives
 * the values the portable decoders of gguf_blocks.h give. */
#ifndef FORERUN_GGUF_BLOCKS_AVX512_H
#define FORERUN_GGUF_BLOCKS_AVX512_H
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* Run v's 16 weights fma(a, s, b) in one register. The 4-bit formats look them up instead: a table
 * of fma(a, s, b) for the 16 codes, indexed by the nibbles (vpermps reads only the low 4 bits of each
 * index, so the low nibble needs no mask); the same values, from fewer instructions. */
static inline __attribute__((always_inline)) __m512 weights16_avx512(int fmt, const uint8_t *blk, int v, float a,
                                                                     float b) {
    if (fmt == GGML_Q5_0 || fmt == GGML_Q5_1) {
        /* A table of fma(a, s, b) for the 32 five-bit codes (two registers), indexed by the nibble with
         * 16 added where the run's bit of qh is set (vpermt2ps reads the low 5 bits of each index). */
        const __m512i c16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 off = _mm512_set1_ps((float)offset_of(fmt));
        const __m512 lv0 = _mm512_sub_ps(_mm512_cvtepi32_ps(c16), off);
        const __m512 lv1 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c16, _mm512_set1_epi32(16))), off);
        const __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
        const __m512 t0 = _mm512_fmadd_ps(av, lv0, bv), t1 = _mm512_fmadd_ps(av, lv1, bv);
        const Run r = run_of(fmt, blk, v);
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)r.lo));
        const __m512i nib = r.ls ? _mm512_srli_epi32(raw, 4) : _mm512_and_si512(raw, _mm512_set1_epi32(15));
        uint16_t bits;
        memcpy(&bits, r.hi, 2);
        const __m512i idx = _mm512_mask_or_epi32(nib, (__mmask16)bits, nib, _mm512_set1_epi32(16));
        return _mm512_permutex2var_ps(t0, idx, t1);
    }
    if (nibble_format(fmt)) {
        const __m128i codes = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(signed_bytes(fmt, codes)));
        const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(a), levels, _mm512_set1_ps(b));
        const Run r = run_of(fmt, blk, v);
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)r.lo));
        return _mm512_permutexvar_ps(r.ls ? _mm512_srli_epi32(raw, 4) : raw, table);
    }
    const __m512i s = _mm512_cvtepi8_epi32(bytes16(fmt, blk, v));
    return _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_cvtepi32_ps(s), _mm512_set1_ps(b));
}
#endif

#if defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* Whether the GEMV decodes the format with bytes64: Q3_K, Q5_K, Q6_K, whose runs v4..v4 + 3 (v4 a
 * multiple of 4) take their fields from 64 bytes (Q6_K's low bits) or one 32-byte stretch seen twice,
 * each run with its own shifts. bytes64 also decodes Q2_K (same layout, no high part), but there the
 * per-run bytes16 measured faster (about 7 against 5.6 GB/s a thread). */
static inline int wide_format(int fmt) { return fmt == GGML_Q3_K || fmt == GGML_Q5_K || fmt == GGML_Q6_K; }

/* Per-16-byte-lane right shifts of 16-bit words (lane i shifted by n[i]). */
static inline __attribute__((always_inline)) __m512i srl_lanes(__m512i q, int n0, int n1, int n2, int n3) {
    if (n0 == n1 && n0 == n2 && n0 == n3) return n0 ? _mm512_srli_epi16(q, n0) : q;
    const long long k = 0x0001000100010001ll;
    return _mm512_srlv_epi16(q, _mm512_set_epi64(n3 * k, n3 * k, n2 * k, n2 * k, n1 * k, n1 * k, n0 * k, n0 * k));
}

/* Runs v4..v4 + 3 of a Q2_K or wide_format block as 64 unsigned fields (before the offset), 16-byte
 * lane i holding run v4 + i, from one set of 512-bit operations. */
static inline __attribute__((always_inline)) __m512i fields64(int fmt, const uint8_t *blk, int v4) {
    const Run r0 = run_of(fmt, blk, v4), r1 = run_of(fmt, blk, v4 + 1), r2 = run_of(fmt, blk, v4 + 2),
              r3 = run_of(fmt, blk, v4 + 3);
    __m512i q = fmt == GGML_Q6_K ? _mm512_loadu_si512((const void *)r0.lo)
                                 : _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)r0.lo));
    q = _mm512_and_si512(srl_lanes(q, r0.ls, r1.ls, r2.ls, r3.ls), _mm512_set1_epi8((char)r0.lm));
    if (fmt != GGML_Q2_K) {
        const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)r0.hi));
        q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(srl_lanes(h, r0.hs, r1.hs, r2.hs, r3.hs),
                                                                  _mm512_set1_epi8((char)r0.hm)),
                                                 r0.hu));
    }
    return q;
}

/* Runs v4..v4 + 3 as 64 signed bytes: the integers bytes16 gives for each run. */
static inline __attribute__((always_inline)) __m512i bytes64(int fmt, const uint8_t *blk, int v4) {
    const __m512i q = fields64(fmt, blk, v4);
    return offset_of(fmt) ? _mm512_sub_epi8(q, _mm512_set1_epi8((char)offset_of(fmt))) : q;
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* Runs v and v + 1 (v even: one map) of a 4-bit format as 32 bf16 weights, each fma(a, s, b) rounded to
 * nearest even: a table of the 16 codes' weights, rounded once (vcvtneps2bf16), indexed by the 32
 * nibbles (vpermw); the values weights16_avx512 gives, rounded, from one lookup per 32 weights. */
static inline __attribute__((always_inline)) __m512i weights32_bf16(int fmt, const uint8_t *blk, int v, float a,
                                                                    float b) {
    const __m128i codes = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(signed_bytes(fmt, codes)));
    const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(a), levels, _mm512_set1_ps(b)));
    const Run r = run_of(fmt, blk, v);
    __m256i q;
    if (fmt == GGML_Q4_K) { /* runs v, v + 1: one nibble of 32 consecutive bytes */
        q = _mm256_loadu_si256((const __m256i *)r.lo);
        if (r.ls) q = _mm256_srli_epi16(q, 4);
    } else { /* runs v, v + 1: the low, then the high nibbles of the same 16 bytes */
        const __m128i raw = _mm_loadu_si128((const __m128i *)r.lo);
        q = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    }
    q = _mm256_and_si256(q, _mm256_set1_epi8(0x0F));
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), _mm512_castsi256_si512(table));
}

/* Runs v and v + 1 (v even) of any format as 32 bf16 weights, each its exact fp32 weight rounded to
 * nearest even: the 4-bit formats by table lookup (weights32_bf16), the others from two runs of fp32
 * weights (vcvtne2ps2bf16 rounds the same way; no weight is subnormal). The block matmul's tiles and
 * the ordered GEMV both take their bf16 weights from here, so they multiply by the same values. */
static inline __attribute__((always_inline)) __m512i runs32_bf16(int fmt, const uint8_t *blk, int v, const float a[16],
                                                                 const float b[16]) {
    if (nibble_format(fmt)) return weights32_bf16(fmt, blk, v, a[map_of(fmt, v)], b[map_of(fmt, v)]);
    const __m512 w0 = weights16_avx512(fmt, blk, v, a[map_of(fmt, v)], b[map_of(fmt, v)]);
    const __m512 w1 = weights16_avx512(fmt, blk, v + 1, a[map_of(fmt, v + 1)], b[map_of(fmt, v + 1)]);
    return (__m512i)_mm512_cvtne2ps_pbh(w1, w0); /* the low half of the result comes from the second operand */
}
#endif

#endif
