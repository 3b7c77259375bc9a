/* y = x W^T + b for a few rows of fp32 activations against weights stored compactly: bf16, or the
 * GGUF block formats Q8_0, Q4_0 and Q4_1.
 *
 * Why: at decode batch sizes of one to a few requests a matmul is bound by reading its weights.
 * An fp32 model upcasts bf16 checkpoints at load (2x the bytes) and de-quantizes GGUF files (6x
 * for Q4_1). When the fp32 weights are exactly what the compact form expands to, reading the
 * compact form and expanding it in registers gives the fp32 matmul's result, up to the order and
 * grouping of the sums, from a fraction of the bytes. Larger batches are compute-bound: the GEMM
 * keeps them.
 *
 * Arithmetic: a GGUF weight is q * d + m with a small integer q and a block of 32 weights sharing
 * d and m (Q8_0: m = 0; Q4_0 stores q + 8, so m = -8 d). The block's share of a dot product is
 * computed as d * sum(q x) + m * sum(x): one multiply-add per weight instead of two, and sum(x) is
 * taken once per row of x for every weight row. The fp32 weights themselves are q * d + m rounded
 * once (fp16 -> fp32 and small integers are exact, d * q needs at most 11 + 8 significant bits, so
 * only the + m rounds, fused or not).
 *
 * Layout (made once at load by `gemv_pack_f32` from the GGUF blocks): weight rows in groups of 4 (the
 * last group padded with zero rows), each group read front to back in one pass, which the hardware
 * prefetcher follows. A group is its 4 x k/32 fp16 scales d (row by row), then (Q4_1) its 4 x k/32
 * fp16 offsets m, then for each block of 32 the 4 rows' integers of that block: Q8_0 one int8 per
 * weight; Q4 two weights per byte, reordered so that the 4-byte word i of a block holds weights
 * 8i .. 8i+7 at bits 0, 4, .., 28 (one broadcast load and one variable shift give eight of them).
 * bf16: the 4 rows' 32 bf16 weights per block, then the 4 rows' last k % 32 weights (k a multiple
 * of 8).
 *
 * x [rows, k] fp32; w [groups, 4 * row bytes]; b [n] fp32 or NULL; y [rows, n] fp32. Groups are
 * split over the caller's OpenMP threads; the sums are in a fixed order whatever the thread count.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "vec.h"

enum { FMT_BF16 = 0, FMT_Q8_0 = 1, FMT_Q4_0 = 2, FMT_Q4_1 = 3 };
enum { MAX_BLOCKS = 1024 }; /* k up to 32,768 in the GGUF formats (checked by the caller) */

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign; /* zero */
    } else { /* subnormal: value = man * 2^-24, exact in fp32 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* n fp16 values to fp32 (exact). */
static inline void fp16_row(const uint8_t *p, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
    for (; i < n; i++) out[i] = fp16_to_f32(p + 2 * i);
}

/* sum a_i b_i over n floats, eight lanes at a time. */
static inline float dot(const float *a, const float *b, int64_t n) {
    v8f acc = splat8(0.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += load8_f32(a + i) * load8_f32(b + i);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Eight weights of a Q4 row: the 4-byte word at p holds them at bits 0, 4, .., 28. */
static inline v8f q4x8_f(const uint8_t *p) {
    uint32_t word;
    memcpy(&word, p, 4);
    const v8u shifts = {0, 4, 8, 12, 16, 20, 24, 28};
    const v8u all = {word, word, word, word, word, word, word, word};
    return __builtin_convertvector((v8i)((all >> shifts) & 0xF), v8f);
}

/* Eight int8 weights. GCC's generic conversion widens bytes one lane at a time; x86 gets the
 * widening instruction by name. */
static inline v8f s8x8_f(const uint8_t *p) {
#if defined(__AVX2__)
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8f v;
    for (int i = 0; i < 8; i++) v[i] = (float)(int8_t)p[i];
    return v;
#endif
}

/* Eight integers (bf16: weights) of a packed block as floats. */
static inline __attribute__((always_inline)) v8f ints8(const uint8_t *p, int fmt) {
    return fmt == FMT_BF16 ? load8_bf16((const uint16_t *)p) : fmt == FMT_Q8_0 ? s8x8_f(p) : q4x8_f(p);
}

/* y[m0 .. m0+MR, j0 .. j0+4) (columns < n only) for MR rows of x and one group of 4 weight rows. Each
 * block of a weight row is expanded once, in registers, and used by every row of x; the 4 rows give
 * the core independent chains of multiply-adds. `xs` holds each x row's sums over blocks of 32. */
static inline __attribute__((always_inline)) void group_rows(const float *x, const float *xs, const uint8_t *g,
                                                             int fmt, const float *b, float *y, int64_t m0,
                                                             int MR, int64_t j0, int64_t k, int64_t n) {
    const int64_t blocks = k / 32;
    const int eb = fmt == FMT_BF16 ? 64 : fmt == FMT_Q8_0 ? 32 : 16; /* bytes of one row's block */
    const int64_t head = fmt == FMT_BF16 ? 0 : (fmt == FMT_Q4_1 ? 16 : 8) * blocks;
    float d[4 * MAX_BLOCKS], off[2][4] = {{0.f}};
    if (fmt != FMT_BF16) {
        fp16_row(g, 4 * blocks, d);
        float m[4 * MAX_BLOCKS];
        if (fmt == FMT_Q4_1) fp16_row(g + 8 * blocks, 4 * blocks, m);
        /* The offsets' share: m * sum(x) per block (Q4_0: m = -8 d). */
        if (fmt != FMT_Q8_0)
            for (int r = 0; r < MR; r++)
                for (int c = 0; c < 4; c++)
                    off[r][c] = dot(fmt == FMT_Q4_1 ? m + c * blocks : d + c * blocks, xs + (m0 + r) * blocks,
                                    blocks) * (fmt == FMT_Q4_1 ? 1.f : -8.f);
    }
    v8f acc[2][4];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = splat8(0.f);
    const uint8_t *q = g + head;
    for (int64_t blk = 0; blk < blocks; blk++, q += 4 * eb) {
        v8f xv[2][4];
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < 4; j++) xv[r][j] = load8_f32(x + (m0 + r) * k + blk * 32 + 8 * j);
        for (int c = 0; c < 4; c++) {
            const uint8_t *p = q + c * eb;
            const v8f q0 = ints8(p, fmt), q1 = ints8(p + eb / 4, fmt), q2 = ints8(p + eb / 2, fmt),
                      q3 = ints8(p + 3 * eb / 4, fmt);
            for (int r = 0; r < MR; r++) {
                const v8f s = (q0 * xv[r][0] + q1 * xv[r][1]) + (q2 * xv[r][2] + q3 * xv[r][3]);
                acc[r][c] += fmt == FMT_BF16 ? s : s * splat8(d[c * blocks + blk]);
            }
        }
    }
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < 4 && j0 + c < n; c++) {
            float s = hsum8(acc[r][c]) + off[r][c];
            if (fmt == FMT_BF16) { /* the rows' tails past the last whole block */
                const int64_t tail = k - blocks * 32;
                const uint16_t *t = (const uint16_t *)q + c * tail;
                for (int64_t i = 0; i < tail; i++) s += x[(m0 + r) * k + blocks * 32 + i] * ld_bf16(t + i);
            }
            y[(m0 + r) * n + j0 + c] = s + (b ? b[j0 + c] : 0.f);
        }
}

/* One format's kernel. The format and the number of x rows per pass (1 or 2) are compile-time
 * constants in each copy, so nothing branches per block; more rows of x are taken in pairs while the
 * group's weights are still in the core's cache. */
#define GEMV_FORMAT(FMT)                                                                                 \
    static void gemv_##FMT(const float *x, const float *xs, const uint8_t *w, int64_t group_bytes,       \
                           const float *b, float *y, int64_t rows, int64_t k, int64_t n, int nthreads) { \
        const int64_t groups = (n + 3) / 4;                                                              \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                              \
        for (int64_t t = 0; t < groups; t++) {                                                           \
            const uint8_t *g = w + t * group_bytes;                                                      \
            for (int64_t m0 = 0; m0 < rows; m0 += 2) {                                                   \
                if (rows - m0 == 1) group_rows(x, xs, g, FMT, b, y, m0, 1, 4 * t, k, n);                  \
                else group_rows(x, xs, g, FMT, b, y, m0, 2, 4 * t, k, n);                                 \
            }                                                                                            \
        }                                                                                                \
    }
GEMV_FORMAT(FMT_BF16)
GEMV_FORMAT(FMT_Q8_0)
GEMV_FORMAT(FMT_Q4_0)
GEMV_FORMAT(FMT_Q4_1)

void gemv_compact_f32(const float *x, const uint8_t *w, int64_t group_bytes, int fmt, const float *b, float *y,
                      int64_t rows, int64_t k, int64_t n, int nthreads) {
    /* Each x row's sums over blocks of 32 (for the offsets m), on the stack: rows are taken in chunks
     * that fit, one chunk for any decode batch of a few rows. */
    enum { SUMS = 4096 };
    float sums[SUMS];
    const int64_t blocks = k / 32, chunk = blocks > 0 && SUMS / blocks < rows ? SUMS / blocks : rows;
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t mr = rows - m0 < chunk ? rows - m0 : chunk;
        const float *xc = x + m0 * k;
        for (int64_t r = 0; r < mr && (fmt == FMT_Q4_0 || fmt == FMT_Q4_1); r++)
            for (int64_t blk = 0; blk < blocks; blk++) {
                v8f s = load8_f32(xc + r * k + blk * 32);
                for (int j = 1; j < 4; j++) s += load8_f32(xc + r * k + blk * 32 + 8 * j);
                sums[r * blocks + blk] = hsum8(s);
            }
        float *yc = y + m0 * n;
        switch (fmt) {
            case FMT_BF16: gemv_FMT_BF16(xc, sums, w, group_bytes, b, yc, mr, k, n, nthreads); break;
            case FMT_Q8_0: gemv_FMT_Q8_0(xc, sums, w, group_bytes, b, yc, mr, k, n, nthreads); break;
            case FMT_Q4_0: gemv_FMT_Q4_0(xc, sums, w, group_bytes, b, yc, mr, k, n, nthreads); break;
            default: gemv_FMT_Q4_1(xc, sums, w, group_bytes, b, yc, mr, k, n, nthreads); break;
        }
    }
}

/* Bytes of one GGUF block of 32 weights (bf16: 32 plain weights). */
static int gguf_block_bytes(int fmt) { return fmt == FMT_BF16 ? 64 : fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_0 ? 18 : 20; }

/* The 32 stored nibbles of a GGUF Q4_0 / Q4_1 block in weight order: byte i holds weight i (low
 * nibble) and weight 16 + i (high). */
static void gguf_q4_nibbles(const uint8_t *block, int fmt, uint8_t q[32]) {
    const uint8_t *qs = block + (fmt == FMT_Q4_1 ? 4 : 2);
    for (int i = 0; i < 16; i++) q[i] = qs[i] & 0x0F, q[16 + i] = qs[i] >> 4;
}

/* GGUF blocks (or bf16 rows) [n, row bytes] -> the kernel's groups [(n + 3) / 4, 4 * row bytes] (see the
 * layout above); dst starts zeroed, so the padding rows of the last group are zero. */
void gemv_pack_f32(const uint8_t *src, int fmt, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t blocks = k / 32;
    const int bsize = gguf_block_bytes(fmt), eb = fmt == FMT_BF16 ? 64 : fmt == FMT_Q8_0 ? 32 : 16;
    const int64_t row_bytes = fmt == FMT_BF16 ? 2 * k : blocks * bsize;
    const int64_t qstart = fmt == FMT_BF16 ? 0 : (fmt == FMT_Q4_1 ? 16 : 8) * blocks;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *in = src + j * row_bytes;
        uint8_t *g = dst + (j / 4) * 4 * row_bytes;
        const int c = (int)(j % 4);
        if (fmt == FMT_BF16) {
            for (int64_t blk = 0; blk < blocks; blk++) memcpy(g + (blk * 4 + c) * eb, in + blk * 64, 64);
            const int64_t tail = 2 * k - blocks * 64;
            memcpy(g + blocks * 4 * eb + c * tail, in + blocks * 64, tail);
            continue;
        }
        for (int64_t blk = 0; blk < blocks; blk++) {
            const uint8_t *p = in + blk * bsize;
            uint8_t *out = g + qstart + (blk * 4 + c) * eb;
            memcpy(g + 2 * (c * blocks + blk), p, 2);                                      /* d */
            if (fmt == FMT_Q4_1) memcpy(g + 2 * (4 * blocks + c * blocks + blk), p + 2, 2); /* m */
            if (fmt == FMT_Q8_0) {
                memcpy(out, p + 2, 32);
                continue;
            }
            uint8_t q[32]; /* packed: byte u holds weight 2u (low nibble) and 2u + 1 (high) */
            gguf_q4_nibbles(p, fmt, q);
            for (int u = 0; u < 16; u++) out[u] = (uint8_t)(q[2 * u] | (q[2 * u + 1] << 4));
        }
    }
}
