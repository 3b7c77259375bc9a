/* y = x W^T for a few rows of fp32 activations against weights kept exactly as the GGUF file stores
 * them: rows of Q8_0 blocks (32 weights) or of the K-quant super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
 * (256 weights), one weight row after the other, no repacking.
 *
 * Why: at one to a few decode rows a matmul is bound by reading its weights, and a K-quant block is
 * 2.6 to 4.9 bits a weight against fp32's 32. The blocks are expanded in registers, 16 weights at a
 * time, and multiplied in fp32; the activations are never quantized.
 *
 * Arithmetic: every format stores, for each run of 16 consecutive weights, small integers u and an
 * affine map w = a u + b that gguf's dequantizer computes in fp32 (Q4_K: a = d sc, b = -dmin m). The
 * products a u are exact in fp32 (fp16 d has 11 significant bits, a scale at most 7, u at most 6),
 * so fma(a, u, b) rounds once, where the reference rounds its single subtraction: each weight here
 * is bit-equal to the reference's fp32 weight, and y differs from fp32 `x @ W.T` only by the order
 * of the sums.
 *
 * Order of the sums (the same on every path, whatever the number of rows or threads): each output
 * keeps 16 lanes; lane l adds w[k] x[k] for k = l mod 16 in increasing k with one fma each; the lanes
 * are then added as a fixed tree (l + 8, then + 4, + 2, + 1). The AVX-512 path holds the 16 lanes
 * in one register, the AVX2 path in two, the scalar path in an array, and all of them use fused
 * multiply-adds only where this order names one, so their results are bit-equal.
 *
 * x [rows, k] fp32; w [n, row_stride] bytes (each row k / block weights blocks); y [rows, n] fp32.
 * Weight rows are split over the caller's OpenMP threads in groups of 4; within a group, rows of x
 * are taken 4 (AVX2: 2) at a time over the whole row, so the group's bytes are re-read from cache.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's type codes, as gguf.GGMLQuantizationType names them. */
enum { GGML_Q8_0 = 8, GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
enum { ISA_BEST = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };
enum { LANES = 16, MAX_ROWS = 16, GROUP = 4 };

static int block_weights(int fmt) { return fmt == GGML_Q8_0 ? 32 : 256; }

static int block_bytes(int fmt) {
    switch (fmt) {
        case GGML_Q8_0: return 34;
        case GGML_Q2_K: return 84;
        case GGML_Q3_K: return 110;
        case GGML_Q4_K: return 144;
        case GGML_Q5_K: return 176;
        case GGML_Q6_K: return 210;
        default: return 0;
    }
}

/* fp16 -> fp32, exact on both branches. */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else {
        float f = (float)man * 5.9604644775390625e-8f; /* subnormal: man * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Runs that share one affine map: Q8_0's block of 2 runs, Q4_K's and Q5_K's sub-blocks of 32. */
static inline int map_of(int fmt, int v) {
    return fmt == GGML_Q8_0 || fmt == GGML_Q4_K || fmt == GGML_Q5_K ? v / 2 : v;
}

/* Q4_K / Q5_K: the 8 six-bit (scale, min) pairs packed in 12 bytes: bytes 0-3 hold the low bits of
 * scales 0-3 and their top 2 bits the high bits of scales 4-7; bytes 4-7 the same for the mins;
 * bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble). */
static inline int scale6(const uint8_t *sc, int j) {
    return j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xF) | (sc[j - 4] >> 6) << 4;
}
static inline int min6(const uint8_t *sc, int j) { return j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | (sc[j] >> 6) << 4; }

/* The affine map (a[m], b[m]) of each map m = map_of(fmt, v) of one block. */
static inline __attribute__((always_inline)) void block_maps(int fmt, const uint8_t *blk, float a[16],
                                                             float b[16]) {
    if (fmt == GGML_Q8_0) {
        a[0] = half(blk);
        b[0] = 0.f;
    } else if (fmt == GGML_Q2_K) { /* scales[16] (low 4 bits: scale, high: min), qs[64], d, dmin */
        const float d = half(blk + 80), dmin = half(blk + 82);
        for (int v = 0; v < 16; v++) a[v] = d * (float)(blk[v] & 0xF), b[v] = -dmin * (float)(blk[v] >> 4);
    } else if (fmt == GGML_Q3_K) { /* hmask[32], qs[64], scales[12] (16 six-bit values, biased by 32), d */
        const uint8_t *sc = blk + 96;
        const float d = half(blk + 108);
        for (int v = 0; v < 16; v++) {
            const int lo = v < 8 ? sc[v] & 0xF : sc[v - 8] >> 4, hi = (sc[8 + v % 4] >> (2 * (v / 4))) & 3;
            a[v] = d * (float)((lo | hi << 4) - 32);
            b[v] = -4.f * a[v]; /* u = q + 4 in 0..7 (see ints16) */
        }
    } else if (fmt == GGML_Q4_K || fmt == GGML_Q5_K) { /* d, dmin, scales[12], ... */
        const float d = half(blk), dmin = half(blk + 2);
        for (int j = 0; j < 8; j++) a[j] = d * (float)scale6(blk + 4, j), b[j] = -dmin * (float)min6(blk + 4, j);
    } else { /* Q6_K: ql[128], qh[64], scales[16] int8, d; u = q + 32 in 0..63 */
        const float d = half(blk + 208);
        for (int v = 0; v < 16; v++) a[v] = d * (float)(int8_t)blk[192 + v], b[v] = -32.f * a[v];
    }
}

/* Where run v of a block keeps its integers: `lo` the bytes holding the low bits (shifted right by
 * `ls`, masked to `lm`), `hi` the bytes holding a high part (shifted right by `hs`, masked to `hm`,
 * moved up by `hu`), or NULL. Lane i of the run is byte i of each. */
typedef struct {
    const uint8_t *lo, *hi;
    int ls, lm, hs, hm, hu;
} Run;

static inline __attribute__((always_inline)) Run run_of(int fmt, const uint8_t *blk, int v) {
    const int half16 = 16 * (v % 2);
    switch (fmt) {
        case GGML_Q8_0: return (Run){blk + 2 + 16 * v, NULL, 0, 0xFF, 0, 0, 0};
        case GGML_Q2_K: /* 2-bit fields: bytes 32h + t hold weights 128h + 32f + t at bits 2f */
            return (Run){blk + 16 + 32 * (v / 8) + half16, NULL, 2 * ((v % 8) / 2), 3, 0, 0, 0};
        case GGML_Q3_K: /* as Q2_K, and bit v/2 of hmask[t] adds 4 */
            return (Run){blk + 32 + 32 * (v / 8) + half16, blk + half16, 2 * ((v % 8) / 2), 3, v / 2, 1, 2};
        case GGML_Q4_K: /* bytes 32c + t hold weights 64c + t (low nibble) and 64c + 32 + t (high) */
            return (Run){blk + 16 + 32 * (v / 4) + half16, NULL, 4 * ((v / 2) % 2), 0xF, 0, 0, 0};
        case GGML_Q5_K: /* as Q4_K, and bit v/2 of qh[t] adds 16 */
            return (Run){blk + 48 + 32 * (v / 4) + half16, blk + 16 + half16, 4 * ((v / 2) % 2), 0xF, v / 2, 1, 4};
        default: /* Q6_K: ql[64h + t] nibbles: weights 128h + 64f + t; qh[32h + t] 2-bit: 128h + 32f + t */
            return (Run){blk + 64 * (v / 8) + 16 * ((v % 8) % 4), blk + 128 + 32 * (v / 8) + half16,
                         4 * ((v % 8) / 4), 0xF, 2 * ((v % 8) / 2), 3, 4};
    }
}

/* The 16 integers u of run v (Q8_0: signed, else unsigned). */
static inline __attribute__((always_inline)) void ints16(int fmt, const uint8_t *blk, int v, int32_t u[16]) {
    const Run r = run_of(fmt, blk, v);
    for (int i = 0; i < 16; i++) {
        u[i] = fmt == GGML_Q8_0 ? (int8_t)r.lo[i] : (r.lo[i] >> r.ls) & r.lm;
        if (r.hi) u[i] |= ((r.hi[i] >> r.hs) & r.hm) << r.hu;
    }
}

/* 16 lanes added as the fixed tree the top of the file names. */
static inline float tree16(const float s[16]) {
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++) t8[l] = s[l] + s[l + 8];
    for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/* Portable path: one weight row at a time against up to MAX_ROWS rows of x. */
static void gemv_scalar(int fmt, const float *x, const uint8_t *w, int64_t stride, float *y, int64_t rows,
                        int64_t k, int64_t n, int nthreads) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float acc[MAX_ROWS][LANES] = {{0.f}}, a[16], b[16], wv[16];
        int32_t u[16];
        for (int64_t blk = 0; blk < k / bw; blk++) {
            const uint8_t *p = w + j * stride + blk * bs;
            block_maps(fmt, p, a, b);
            for (int v = 0; v < bw / 16; v++) {
                ints16(fmt, p, v, u);
                for (int i = 0; i < 16; i++) wv[i] = fmaf(a[map_of(fmt, v)], (float)u[i], b[map_of(fmt, v)]);
                for (int64_t r = 0; r < rows; r++) {
                    const float *xr = x + r * k + blk * bw + 16 * v;
                    for (int i = 0; i < 16; i++) acc[r][i] = fmaf(wv[i], xr[i], acc[r][i]);
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * n + j] = tree16(acc[r]);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Run v's 16 integers as bytes, by byte-wise shifts and masks of 16 loaded bytes (SSE2: shared by
 * the AVX2 and AVX-512 paths). 16-bit shifts move bits across bytes, but each mask keeps only bits
 * that came from the same byte. */
static inline __attribute__((always_inline)) __m128i bytes16(int fmt, const uint8_t *blk, int v) {
    const Run r = run_of(fmt, blk, v);
    __m128i q = _mm_loadu_si128((const __m128i *)r.lo);
    if (fmt == GGML_Q8_0) return q;
    q = _mm_and_si128(_mm_srli_epi16(q, r.ls), _mm_set1_epi8((char)r.lm));
    if (r.hi) {
        const __m128i h = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)r.hi), r.hs),
                                        _mm_set1_epi8((char)r.hm));
        q = _mm_or_si128(q, _mm_slli_epi16(h, r.hu));
    }
    return q;
}

/* block_maps with vector arithmetic for the common formats (the products are exact, so the maps are
 * bit-equal to the scalar ones); Q8_0 and Q3_K keep the scalar code. */
static inline __attribute__((always_inline)) void block_maps_avx2(int fmt, const uint8_t *blk, float a[16],
                                                                  float b[16]) {
    if (fmt == GGML_Q4_K || fmt == GGML_Q5_K) {
        /* Bytes 0-7: the 8 scales, 8-15: the 8 mins, gathered from the 12 packed bytes (see scale6). */
        const __m128i raw = _mm_loadu_si128((const __m128i *)blk); /* d, dmin, scales[12] */
        const __m128i low = _mm_shuffle_epi8(raw, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
        const __m128i top = _mm_shuffle_epi8(raw, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
        const __m128i lo_mask = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0);
        const __m128i nib_mask = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15);
        const __m128i six = _mm_or_si128(
            _mm_or_si128(_mm_and_si128(low, lo_mask), _mm_and_si128(_mm_srli_epi16(low, 4), nib_mask)),
            _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
        const float d = half(blk), dmin = half(blk + 2);
        _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six))));
        _mm256_storeu_ps(b, _mm256_mul_ps(_mm256_set1_ps(-dmin),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(six, 8)))));
    } else if (fmt == GGML_Q6_K || fmt == GGML_Q2_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + (fmt == GGML_Q6_K ? 192 : 0)));
        const float d = half(blk + (fmt == GGML_Q6_K ? 208 : 80));
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(fmt == GGML_Q6_K ? -32.f * d : -half(blk + 82));
        for (int h = 0; h < 2; h++) {
            const __m128i s8 = h ? _mm_srli_si128(sc, 8) : sc;
            const __m256 s = fmt == GGML_Q6_K ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))
                                              : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(s8, _mm_set1_epi8(15))));
            const __m256 m = fmt == GGML_Q6_K ? s : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                        _mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(15))));
            _mm256_storeu_ps(a + 8 * h, _mm256_mul_ps(dv, s));
            _mm256_storeu_ps(b + 8 * h, _mm256_mul_ps(mv, m)); /* Q6_K: -32 d s = -32 a, exact */
        }
    } else {
        block_maps(fmt, blk, a, b);
    }
}

static inline float tree8_avx(__m256 s8) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* One group of 4 weight rows against RB rows of x (AVX2: 16 lanes = two registers). */
static inline __attribute__((always_inline)) void tile_avx2(int fmt, int RB, const float *const xr[], int64_t k,
                                                            const uint8_t *const wr[GROUP], float out[][GROUP]) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    __m256 acc[4][GROUP][2];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < GROUP; c++) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / bw; blk++) {
        float a[GROUP][16], b[GROUP][16];
        for (int c = 0; c < GROUP; c++) block_maps_avx2(fmt, wr[c] + blk * bs, a[c], b[c]);
for (int v4 = 0; v4 < bw / 16; v4 += 4)
        for (int v = v4; v < v4 + (bw < 64 ? bw / 16 : 4); v++) { /* 4 runs unrolled */
            __m256 wv[GROUP][2];
            for (int c = 0; c < GROUP; c++) {
                const __m128i q = bytes16(fmt, wr[c] + blk * bs, v);
                const __m128i q8 = _mm_srli_si128(q, 8);
                const __m256i lo = fmt == GGML_Q8_0 ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
                const __m256i hi = fmt == GGML_Q8_0 ? _mm256_cvtepi8_epi32(q8) : _mm256_cvtepu8_epi32(q8);
                const __m256 av = _mm256_set1_ps(a[c][map_of(fmt, v)]), bv = _mm256_set1_ps(b[c][map_of(fmt, v)]);
                wv[c][0] = _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(lo), bv);
                wv[c][1] = _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(hi), bv);
            }
            for (int r = 0; r < RB; r++) {
                const float *xp = xr[r] + blk * bw + 16 * v;
                const __m256 x0 = _mm256_loadu_ps(xp), x1 = _mm256_loadu_ps(xp + 8);
                for (int c = 0; c < GROUP; c++) {
                    acc[r][c][0] = _mm256_fmadd_ps(wv[c][0], x0, acc[r][c][0]);
                    acc[r][c][1] = _mm256_fmadd_ps(wv[c][1], x1, acc[r][c][1]);
                }
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < GROUP; c++) out[r][c] = tree8_avx(_mm256_add_ps(acc[r][c][0], acc[r][c][1]));
}
#endif

#if defined(__AVX512F__) && defined(__FMA__)
/* Run v's 16 weights fma(a, u, b). Q4_K looks them up instead: a 16-entry table of fma(a, u, b) for
 * u = 0..15 per sub-block, indexed by the nibbles (vpermps reads only the low 4 bits of each index,
 * so the low nibble needs no mask); the same values, from fewer instructions. */
static inline __attribute__((always_inline)) __m512 weights16_avx512(int fmt, const uint8_t *blk, int v, float a,
                                                                     float b) {
    if (fmt == GGML_Q4_K) {
        const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                               12, 13, 14, 15), _mm512_set1_ps(b));
        const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)run_of(fmt, blk, v).lo));
        return _mm512_permutexvar_ps(v / 2 % 2 ? _mm512_srli_epi32(raw, 4) : raw, table);
    }
    const __m128i q = bytes16(fmt, blk, v);
    const __m512i u = fmt == GGML_Q8_0 ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
    return _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_cvtepi32_ps(u), _mm512_set1_ps(b));
}

/* One group of 4 weight rows against RB rows of x (16 lanes = one register). */
static inline __attribute__((always_inline)) void tile_avx512(int fmt, int RB, const float *const xr[], int64_t k,
                                                              const uint8_t *const wr[GROUP], float out[][GROUP]) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    __m512 acc[4][GROUP];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < GROUP; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < k / bw; blk++) {
        float a[GROUP][16], b[GROUP][16];
        for (int c = 0; c < GROUP; c++) block_maps_avx2(fmt, wr[c] + blk * bs, a[c], b[c]);
for (int v4 = 0; v4 < bw / 16; v4 += 4)
        for (int v = v4; v < v4 + (bw < 64 ? bw / 16 : 4); v++) { /* 4 runs unrolled */
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
#define TILE_FMT(TILE, fmt, rb, ...)                                            \
    do {                                                                        \
        switch (fmt) {                                                          \
            case GGML_Q8_0: TILE_RB(TILE, GGML_Q8_0, rb, __VA_ARGS__); break;   \
            case GGML_Q2_K: TILE_RB(TILE, GGML_Q2_K, rb, __VA_ARGS__); break;   \
            case GGML_Q3_K: TILE_RB(TILE, GGML_Q3_K, rb, __VA_ARGS__); break;   \
            case GGML_Q4_K: TILE_RB(TILE, GGML_Q4_K, rb, __VA_ARGS__); break;   \
            case GGML_Q5_K: TILE_RB(TILE, GGML_Q5_K, rb, __VA_ARGS__); break;   \
            default: TILE_RB(TILE, GGML_Q6_K, rb, __VA_ARGS__); break;          \
        }                                                                       \
    } while (0)

/* The vector paths: groups of 4 weight rows over the threads (the last group repeats its last row,
 * whose copies are computed and dropped); rows of x one at a time when one is left, else in tiles of
 * TILE_ROWS (4; AVX2: 2) where a short tile repeats its last row: a repeated row costs one fma a
 * weight, expanding the weights again would cost several. */
static void gemv_vector(int isa, int fmt, const float *x, const uint8_t *w, int64_t stride, float *y,
                        int64_t rows, int64_t k, int64_t n, int nthreads) {
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
#if defined(__AVX512F__) && defined(__FMA__)
#define TILE_ROWS 4
            if (isa == ISA_AVX512) TILE_FMT(tile_avx512, fmt, rb, xr, k, wr, out);
#undef TILE_ROWS
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TILE_ROWS 2
            if (isa == ISA_AVX2) TILE_FMT(tile_avx2, fmt, rb, xr, k, wr, out);
#undef TILE_ROWS
#endif
            for (int r = 0; r < real; r++)
                for (int c = 0; c < GROUP && GROUP * g + c < n; c++) y[(r0 + r) * n + GROUP * g + c] = out[r][c];
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
#if defined(__AVX512F__) && defined(__FMA__)
    isas |= 1 << ISA_AVX512;
#endif
    return isas;
}

/* y [rows, n] = x [rows, k] W^T. `isa`: ISA_BEST or one path. Returns 0, -1 for a format this file
 * lacks or a k / stride that does not fit it, -2 for a path not built. */
int gemv_kquant_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t rows,
                    int64_t k, int64_t n, int isa, int nthreads) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    if (bs == 0 || k <= 0 || k % bw || stride < k / bw * bs || rows < 0 || n < 0) return -1;
    const int isas = gemv_kquant_isas_f32();
    if (isa == ISA_BEST) isa = isas & (1 << ISA_AVX512) ? ISA_AVX512 : isas & (1 << ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
    if (isa < ISA_SCALAR || isa > ISA_AVX512 || !(isas & (1 << isa))) return -2;
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) { /* the scalar path's accumulators hold MAX_ROWS */
        const int64_t mr = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        if (isa == ISA_SCALAR) gemv_scalar(fmt, x + r0 * k, w, stride, y + r0 * n, mr, k, n, nthreads);
        else gemv_vector(isa, fmt, x + r0 * k, w, stride, y + r0 * n, mr, k, n, nthreads);
    }
    return 0;
}
