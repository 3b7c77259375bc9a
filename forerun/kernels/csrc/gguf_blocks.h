/* GGUF weight blocks as the file stores them, decoded 16 weights at a time to exactly the fp32 values
 * gguf's dequantizer gives. Shared by the block GEMV (gemv_kquant.c), the block dequantizer
 * (dequant_blocks.c) and the block GEMM (gemm_blocks.c), so each format is decoded by one piece of
 * code whatever reads it.
 *
 * Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (32-weight blocks) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_XS (256-weight super-blocks).
 *
 * The portable and AVX2 decoders are here; the AVX-512 ones are in gguf_blocks_avx512.h, included at
 * the end.
 *
 * Arithmetic: every format stores, for each run of 16 consecutive weights, small signed integers s
 * (|s| < 2^7: a 2-6 bit field, minus the format's offset, or an IQ4 level) and an affine map
 * w = a s + b that gguf's dequantizer computes in fp32: a = d (legacy, IQ4_NL), d sc (K-quants,
 * IQ4_XS); b = m (Q4_1, Q5_1), -dmin m (Q2_K, Q4_K, Q5_K), and -0 where the format has no minimum.
 * The reference rounds a first (the same product here), then a s, then adds b. Where b = -0,
 * fma(a, s, -0) is a s rounded once, as the reference's product, and adding -0 keeps the sign of a
 * zero. Where the format has a minimum, a s is exact in fp32 (d has 11 significant bits, sc at most
 * 6, s at most 5: 22 of fp32's 24), so the reference rounds only its addition and fma(a, s, b),
 * rounding once, gives the same value, down to the sign of a zero (x - y is x + (-y) in IEEE).
 * Every weight is therefore bit-equal to gguf's fp32 weight.
 */
#ifndef FORERUN_GGUF_BLOCKS_H
#define FORERUN_GGUF_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's type codes, as gguf.GGMLQuantizationType names them. */
enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q2_K = 10, GGML_Q3_K = 11,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23
};
/* The code paths a caller may ask for (ISA_BEST: the widest one built). */
enum { ISA_BEST = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };

/* The path a kernel runs for the caller's `isa`, given `isas` (bit i set: path i built): `isa` itself,
 * or for ISA_BEST the widest built; -1 for a path that does not exist or was not built. */
static inline int path_of(int isa, int isas) {
    if (isa == ISA_BEST) return isas & (1 << ISA_AVX512) ? ISA_AVX512 : isas & (1 << ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
    return isa >= ISA_SCALAR && isa <= ISA_AVX512 && (isas & (1 << isa)) ? isa : -1;
}

/* Runs the statements after F with F an enum constant equal to `fmt` (a format this header decodes;
 * the last case takes any other): the always-inline decoders below then get one specialized copy per
 * format, with no branch on the format inside a loop. */
#define WITH_FORMAT(fmt, F, ...)                                        \
    do {                                                                \
        switch (fmt) {                                                  \
            case GGML_Q4_0: { enum { F = GGML_Q4_0 }; __VA_ARGS__; } break;     \
            case GGML_Q4_1: { enum { F = GGML_Q4_1 }; __VA_ARGS__; } break;     \
            case GGML_Q5_0: { enum { F = GGML_Q5_0 }; __VA_ARGS__; } break;     \
            case GGML_Q5_1: { enum { F = GGML_Q5_1 }; __VA_ARGS__; } break;     \
            case GGML_Q8_0: { enum { F = GGML_Q8_0 }; __VA_ARGS__; } break;     \
            case GGML_IQ4_NL: { enum { F = GGML_IQ4_NL }; __VA_ARGS__; } break; \
            case GGML_Q2_K: { enum { F = GGML_Q2_K }; __VA_ARGS__; } break;     \
            case GGML_Q3_K: { enum { F = GGML_Q3_K }; __VA_ARGS__; } break;     \
            case GGML_Q4_K: { enum { F = GGML_Q4_K }; __VA_ARGS__; } break;     \
            case GGML_Q5_K: { enum { F = GGML_Q5_K }; __VA_ARGS__; } break;     \
            case GGML_IQ4_XS: { enum { F = GGML_IQ4_XS }; __VA_ARGS__; } break; \
            default: { enum { F = GGML_Q6_K }; __VA_ARGS__; } break;            \
        }                                                               \
    } while (0)

/* Put before a loop over the runs of a block: unrolled, each run's shifts and offsets are constants
 * (a K-quant's 16 runs decode about 1.5 times as fast). */
#define UNROLL_RUNS _Pragma("GCC unroll 16")

/* ggml's kvalues_iq4nl: the 16 levels an IQ4 code selects. */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int block_weights(int fmt) {
    return fmt == GGML_Q4_0 || fmt == GGML_Q4_1 || fmt == GGML_Q5_0 || fmt == GGML_Q5_1 || fmt == GGML_Q8_0 ||
                   fmt == GGML_IQ4_NL
               ? 32
               : 256;
}

/* Bytes a block; 0 for a format this header lacks. */
static inline int block_bytes(int fmt) {
    switch (fmt) {
        case GGML_Q4_0: return 18;
        case GGML_Q4_1: return 20;
        case GGML_Q5_0: return 22;
        case GGML_Q5_1: return 24;
        case GGML_Q8_0: return 34;
        case GGML_IQ4_NL: return 18;
        case GGML_Q2_K: return 84;
        case GGML_Q3_K: return 110;
        case GGML_Q4_K: return 144;
        case GGML_Q5_K: return 176;
        case GGML_Q6_K: return 210;
        case GGML_IQ4_XS: return 136;
        default: return 0;
    }
}

/* Whether rows of k weights in `fmt` can be read from rows `stride` bytes apart: a format this header
 * decodes, k a positive whole number of its blocks, and stride at least a row's bytes (the kernels'
 * common argument check). */
static inline int rows_fit(int fmt, int64_t k, int64_t stride) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    return bs != 0 && k > 0 && k % bw == 0 && stride >= k / bw * bs;
}

/* Whether every weight is one nibble of a byte (4-bit codes, no high part). */
static inline int nibble_format(int fmt) {
    return fmt == GGML_Q4_0 || fmt == GGML_Q4_1 || fmt == GGML_IQ4_NL || fmt == GGML_Q4_K || fmt == GGML_IQ4_XS;
}

static inline int iq4_format(int fmt) { return fmt == GGML_IQ4_NL || fmt == GGML_IQ4_XS; }

/* What the reference subtracts from the stored unsigned field (Q3_K: its high bit clear subtracts 4,
 * i.e. s = low + 4 high - 4). */
static inline int offset_of(int fmt) {
    switch (fmt) {
        case GGML_Q4_0: return 8;
        case GGML_Q5_0: return 16;
        case GGML_Q3_K: return 4;
        case GGML_Q6_K: return 32;
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

/* Runs that share one affine map: a 32-weight block's 2 runs, a sub-block of 32 of Q4_K, Q5_K, IQ4_XS;
 * Q2_K, Q3_K and Q6_K have one map a run. */
static inline int map_of(int fmt, int v) { return fmt == GGML_Q2_K || fmt == GGML_Q3_K || fmt == GGML_Q6_K ? v : v / 2; }

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
    switch (fmt) {
        case GGML_Q4_0: case GGML_Q5_0: case GGML_Q8_0: case GGML_IQ4_NL: /* d, ... */
            a[0] = half(blk), b[0] = -0.f;
            break;
        case GGML_Q4_1: case GGML_Q5_1: /* d, m, ... */
            a[0] = half(blk), b[0] = half(blk + 2);
            break;
        case GGML_Q2_K: { /* scales[16] (low 4 bits: scale, high: min), qs[64], d, dmin */
            const float d = half(blk + 80), dmin = half(blk + 82);
            for (int v = 0; v < 16; v++) a[v] = d * (float)(blk[v] & 0xF), b[v] = -dmin * (float)(blk[v] >> 4);
            break;
        }
        case GGML_Q3_K: { /* hmask[32], qs[64], scales[12] (16 six-bit values, biased by 32), d */
            const uint8_t *sc = blk + 96;
            const float d = half(blk + 108);
            for (int v = 0; v < 16; v++) {
                const int lo = v < 8 ? sc[v] & 0xF : sc[v - 8] >> 4, hi = (sc[8 + v % 4] >> (2 * (v / 4))) & 3;
                a[v] = d * (float)((lo | hi << 4) - 32), b[v] = -0.f;
            }
            break;
        }
        case GGML_Q4_K: case GGML_Q5_K: { /* d, dmin, scales[12], ... */
            const float d = half(blk), dmin = half(blk + 2);
            for (int j = 0; j < 8; j++) a[j] = d * (float)scale6(blk + 4, j), b[j] = -dmin * (float)min6(blk + 4, j);
            break;
        }
        case GGML_IQ4_XS: { /* d, scales_h (uint16: 2 bits a sub-block), scales_l[4] (nibbles), qs[128] */
            const float d = half(blk);
            const int high = blk[2] | blk[3] << 8;
            for (int j = 0; j < 8; j++) {
                const int sc = ((blk[4 + j / 2] >> (4 * (j % 2))) & 0xF) | ((high >> (2 * j)) & 3) << 4;
                a[j] = d * (float)(sc - 32), b[j] = -0.f;
            }
            break;
        }
        default: { /* Q6_K: ql[128], qh[64], scales[16] int8, d */
            const float d = half(blk + 208);
            for (int v = 0; v < 16; v++) a[v] = d * (float)(int8_t)blk[192 + v], b[v] = -0.f;
        }
    }
}

/* Where run v of a block keeps its unsigned field: `lo` the bytes holding the low bits (shifted right
 * by `ls`, masked to `lm`), `hi` the bytes holding a high part (shifted right by `hs`, masked to `hm`,
 * moved up by `hu`), or NULL. Lane i of the run is byte i of each, except where `bits` is set: then
 * lane i's high part is bit i of the little-endian 16 bits at `hi` (Q5_0, Q5_1's qh). */
typedef struct {
    const uint8_t *lo, *hi;
    int ls, lm, hs, hm, hu, bits;
} Run;

static inline __attribute__((always_inline)) Run run_of(int fmt, const uint8_t *blk, int v) {
    const int half16 = 16 * (v % 2);
    switch (fmt) {
        case GGML_Q4_0: case GGML_IQ4_NL: /* d, qs[16]: byte t holds weights t (low nibble) and 16 + t */
            return (Run){blk + 2, NULL, 4 * v, 0xF, 0, 0, 0, 0};
        case GGML_Q4_1: return (Run){blk + 4, NULL, 4 * v, 0xF, 0, 0, 0, 0};
        case GGML_Q5_0: /* d, qh[4], qs[16]: as Q4_0, and bit t of qh adds 16 to weight t */
            return (Run){blk + 6, blk + 2 + 2 * v, 4 * v, 0xF, 0, 1, 4, 1};
        case GGML_Q5_1: return (Run){blk + 8, blk + 4 + 2 * v, 4 * v, 0xF, 0, 1, 4, 1};
        case GGML_Q8_0: return (Run){blk + 2 + 16 * v, NULL, 0, 0xFF, 0, 0, 0, 0};
        case GGML_Q2_K: /* 2-bit fields: bytes 32h + t hold weights 128h + 32f + t at bits 2f */
            return (Run){blk + 16 + 32 * (v / 8) + half16, NULL, 2 * ((v % 8) / 2), 3, 0, 0, 0, 0};
        case GGML_Q3_K: /* as Q2_K, and bit v/2 of hmask[t] adds 4 */
            return (Run){blk + 32 + 32 * (v / 8) + half16, blk + half16, 2 * ((v % 8) / 2), 3, v / 2, 1, 2, 0};
        case GGML_Q4_K: /* bytes 32c + t hold weights 64c + t (low nibble) and 64c + 32 + t (high) */
            return (Run){blk + 16 + 32 * (v / 4) + half16, NULL, 4 * ((v / 2) % 2), 0xF, 0, 0, 0, 0};
        case GGML_Q5_K: /* as Q4_K, and bit v/2 of qh[t] adds 16 */
            return (Run){blk + 48 + 32 * (v / 4) + half16, blk + 16 + half16, 4 * ((v / 2) % 2), 0xF, v / 2, 1, 4, 0};
        case GGML_IQ4_XS: /* sub-block j: bytes 8 + 16j + t hold weights 32j + t and 32j + 16 + t */
            return (Run){blk + 8 + 16 * (v / 2), NULL, 4 * (v % 2), 0xF, 0, 0, 0, 0};
        default: /* Q6_K: ql[64h + t] nibbles: weights 128h + 64f + t; qh[32h + t] 2-bit: 128h + 32f + t */
            return (Run){blk + 64 * (v / 8) + 16 * ((v % 8) % 4), blk + 128 + 32 * (v / 8) + half16,
                         4 * ((v % 8) / 4), 0xF, 2 * ((v % 8) / 2), 3, 4, 0};
    }
}

/* The 16 signed integers s of run v. */
static inline __attribute__((always_inline)) void ints16(int fmt, const uint8_t *blk, int v, int32_t s[16]) {
    const Run r = run_of(fmt, blk, v);
    for (int i = 0; i < 16; i++) {
        int u = fmt == GGML_Q8_0 ? (int8_t)r.lo[i] : (r.lo[i] >> r.ls) & r.lm;
        if (r.hi) u |= (r.bits ? (r.hi[i / 8] >> (i % 8)) & 1 : (r.hi[i] >> r.hs) & r.hm) << r.hu;
        s[i] = iq4_format(fmt) ? IQ4_LEVELS[u] : u - offset_of(fmt);
    }
}

/* Run v's 16 weights fma(a, s, b), portable. */
static inline __attribute__((always_inline)) void weights16(int fmt, const uint8_t *blk, int v, float a, float b,
                                                            float w[16]) {
    int32_t s[16];
    ints16(fmt, blk, v, s);
    for (int i = 0; i < 16; i++) w[i] = fmaf(a, (float)s[i], b);
}

#if defined(__AVX2__) && defined(__FMA__)
/* 16 bytes from p in both 128-bit lanes of a register: a broadcast load, which takes no vector port. */
static inline __attribute__((always_inline)) __m256i load16x2(const uint8_t *p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
}

/* The last step of decoding, on unsigned fields as bytes (each 128-bit lane alike): the IQ4 level or the
 * offset removed. */
static inline __attribute__((always_inline)) __m256i signed_bytes2(int fmt, __m256i u) {
    if (iq4_format(fmt)) return _mm256_shuffle_epi8(load16x2((const uint8_t *)IQ4_LEVELS), u);
    if (offset_of(fmt)) return _mm256_sub_epi8(u, _mm256_set1_epi8((char)offset_of(fmt)));
    return u;
}
static inline __attribute__((always_inline)) __m128i signed_bytes(int fmt, __m128i u) {
    return _mm256_castsi256_si128(signed_bytes2(fmt, _mm256_castsi128_si256(u)));
}

/* Whether the format's integers are its unsigned fields as they are (no offset, no level table, not
 * Q8_0's signed bytes). */
static inline int unsigned_format(int fmt) { return fmt != GGML_Q8_0 && !iq4_format(fmt) && !offset_of(fmt); }

/* Run r's unsigned fields as bytes, by byte-wise shifts and masks of loaded bytes, leaving out a
 * bit-wise high part (r.bits: Q5_0, Q5_1's qh). 16-bit shifts move bits across bytes, but each mask
 * keeps only bits that came from the same byte. `two_runs`: r's 16 bytes and the next 16 (the next
 * run's, where its bytes follow with the same shifts, as a K-quant's runs 2j and 2j + 1 do), else r's
 * 16 in both 128-bit lanes. */
static inline __attribute__((always_inline)) __m256i byte_fields(Run r, int two_runs) {
    const __m256i lo = two_runs ? _mm256_loadu_si256((const __m256i *)r.lo) : load16x2(r.lo);
    __m256i q = _mm256_and_si256(_mm256_srli_epi16(lo, r.ls), _mm256_set1_epi8((char)r.lm));
    if (r.hi && !r.bits) {
        const __m256i hi = two_runs ? _mm256_loadu_si256((const __m256i *)r.hi) : load16x2(r.hi);
        /* (hi >> hs & hm) << hu as one shift by hu - hs and a mask of hm << hu (the mask keeps only bits
         * that came from the same byte either way): one shift fewer on the ports that also widen the
         * weights (16-bit GEMV, one thread, 256 x 8192, AMD EPYC with AVX2 only: Q6_K 1.64 against 1.78
         * cycles a 8 weights, Q5_K 1.42 against 1.53, Q3_K 1.72 against 1.79). */
        const __m256i moved = r.hu >= r.hs ? _mm256_slli_epi16(hi, r.hu - r.hs) : _mm256_srli_epi16(hi, r.hs - r.hu);
        q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8((char)(r.hm << r.hu))));
    }
    return q;
}

/* Run v's 16 integers s as signed bytes (with `fold`, its unsigned fields), in both 128-bit lanes of a
 * register. Both lanes, because the AVX2 path widens each lane's half in place (ints8_avx2). */
static inline __attribute__((always_inline)) __m256i fields16x2(int fmt, const uint8_t *blk, int v, int fold) {
    const Run r = run_of(fmt, blk, v);
    if (fmt == GGML_Q8_0) return load16x2(r.lo);
    __m256i q = byte_fields(r, 0);
    if (r.hi && r.bits) { /* byte i tests bit i % 8 of byte i / 8 of the two at hi */
        uint16_t two;
        memcpy(&two, r.hi, 2);
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi16((short)two),
            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8((char)(1 << r.hu))));
    }
    return fold ? q : signed_bytes2(fmt, q);
}

/* Run v's 16 integers s as signed bytes (the AVX-512 path's form). */
static inline __attribute__((always_inline)) __m128i bytes16(int fmt, const uint8_t *blk, int v) {
    return _mm256_castsi256_si128(fields16x2(fmt, blk, v, 0));
}

/* Integers 8h .. 8h + 7 of a run given by fields16x2, as 32-bit lanes: lane 0 of the register takes bytes
 * 8h .. 8h + 3 of its copy, lane 1 bytes 8h + 4 .. 8h + 7 of its own, with one in-lane byte shuffle
 * (into the low byte of each 32-bit lane, zeros above, where the integers are unsigned; else into the
 * top byte, then an arithmetic shift sign-extends). Why: vpmovsxbd from a 128-bit register crosses
 * lanes, and on an AMD EPYC with AVX2 only it issues once per 1.26 cycles against 0.5 for a byte
 * shuffle or a shift; two a run were the GEMV's limit. One weight row of Q4_1 in L2, one thread:
 * 2.19 against 2.94 cycles a 8 weights; Q4_K 2.27 against 3.18, Q8_0 2.17 against 2.52. */
static inline __attribute__((always_inline)) __m256i ints8_avx2(int fmt, __m256i q, int h, int fold) {
    const char b = (char)(8 * h), z = -1;
    if (fold || unsigned_format(fmt))
        return _mm256_shuffle_epi8(q, _mm256_setr_epi8(b, z, z, z, b + 1, z, z, z, b + 2, z, z, z, b + 3, z, z, z, b + 4,
                                                       z, z, z, b + 5, z, z, z, b + 6, z, z, z, b + 7, z, z, z));
    return _mm256_srai_epi32(_mm256_shuffle_epi8(q, _mm256_setr_epi8(z, z, z, b, z, z, z, b + 1, z, z, z, b + 2, z, z,
                                                                     z, b + 3, z, z, z, b + 4, z, z, z, b + 5, z, z,
                                                                     z, b + 6, z, z, z, b + 7)),
                             24);
}

/* block_maps with vector arithmetic for the common K-quants (the products are exact, so the maps are
 * bit-equal to the scalar ones); the other formats keep the scalar code. */
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
        /* d and dmin in one conversion, and the 8 scales and 8 mins zero-extended by in-lane byte shuffles
         * of six in both halves, where two vpmovzxbd (lane-crossing) cost more: one thread, 16-bit Q4_K
         * GEMV over 4096 weights in L1, 4.02-4.07 against 4.10-4.21 cycles a block of 32 (AMD EPYC, AVX2
         * only). The values are the same. */
#if defined(__F16C__)
        uint32_t two;
        memcpy(&two, blk, 4);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two));
#else
        const __m128 dd = _mm_setr_ps(half(blk), half(blk + 2), 0.f, 0.f);
#endif
        const __m256i both = _mm256_broadcastsi128_si256(six); /* bytes 0-7 scales, 8-15 mins (unsigned) */
        const __m256 neg_dmin = _mm256_xor_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), _mm256_set1_ps(-0.f));
        _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(ints8_avx2(fmt, both, 0, 1))));
        _mm256_storeu_ps(b, _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(ints8_avx2(fmt, both, 1, 1))));
    } else if (fmt == GGML_Q6_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(half(blk + 208));
        _mm256_storeu_ps(a, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(a + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
        _mm256_storeu_ps(b, _mm256_set1_ps(-0.f));
        _mm256_storeu_ps(b + 8, _mm256_set1_ps(-0.f));
    } else if (fmt == GGML_Q2_K) {
        const __m128i sc = _mm_loadu_si128((const __m128i *)blk);
        const __m256 d = _mm256_set1_ps(half(blk + 80)), m = _mm256_set1_ps(-half(blk + 82));
        for (int h = 0; h < 2; h++) {
            const __m128i s8 = h ? _mm_srli_si128(sc, 8) : sc;
            const __m256i s = _mm256_cvtepu8_epi32(_mm_and_si128(s8, _mm_set1_epi8(15)));
            const __m256i mn = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(15)));
            _mm256_storeu_ps(a + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
            _mm256_storeu_ps(b + 8 * h, _mm256_mul_ps(m, _mm256_cvtepi32_ps(mn)));
        }
    } else if (fmt == GGML_Q3_K) { /* the 16 six-bit scales as block_maps builds them, 16 at once */
        const uint8_t *sc = blk + 96;
        uint32_t top4;
        memcpy(&top4, sc + 8, 4);
        const __m128i low8 = _mm_loadl_epi64((const __m128i *)sc);
        const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(low8, _mm_set1_epi8(15)),
                                              _mm_and_si128(_mm_srli_epi16(low8, 4), _mm_set1_epi8(15)));
        /* run v: bits 2 (v / 4) of sc[8 + v % 4]: dword v / 4 holds sc[8..11] shifted by 2 (v / 4) */
        const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)top4), _mm_setr_epi32(0, 2, 4, 6)),
                                         _mm_set1_epi8(3));
        const __m128i six = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
        const __m256 d = _mm256_set1_ps(half(blk + 108));
        _mm256_storeu_ps(a, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(six))));
        _mm256_storeu_ps(a + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(six, 8)))));
        _mm256_storeu_ps(b, _mm256_set1_ps(-0.f));
        _mm256_storeu_ps(b + 8, _mm256_set1_ps(-0.f));
    } else {
        block_maps(fmt, blk, a, b);
    }
}

/* Run v's 16 weights in two registers (AVX2): fma(a, s, b), or with `fold` (a folded_format, the
 * GEMV's form) fma(a, u, -offset a) from the unsigned fields u. */
static inline __attribute__((always_inline)) void expand16_avx2(int fmt, const uint8_t *blk, int v, float a, float b,
                                                                int fold, __m256 w[2]) {
    const __m256i q = fields16x2(fmt, blk, v, fold);
    const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(fold ? -(float)offset_of(fmt) * a : b);
    w[0] = _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(ints8_avx2(fmt, q, 0, fold)), bv);
    w[1] = _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(ints8_avx2(fmt, q, 1, fold)), bv);
}

/* Run v's 16 weights fma(a, s, b) in two registers (AVX2). */
static inline __attribute__((always_inline)) void weights16_avx2(int fmt, const uint8_t *blk, int v, float a, float b,
                                                                 __m256 w[2]) {
    expand16_avx2(fmt, blk, v, a, b, 0, w);
}

/* Whether the GEMV takes the format's fields as they are and the offset into the map (expand16_avx2's
 * `fold`): Q4_0 and Q5_0, whose offset is a power of two and whose map has no minimum. Each weight is
 * then fma(a, u, -offset a): one rounding of a u - offset a = a s exactly (offset a is exact, a power
 * of two times a), so it is the reference's a s, except that a zero weight may be +0 where the
 * reference's is -0: a GEMV's sums cannot tell (each starts at +0, and x + (-0) = x, +0 + (-0) = +0),
 * so its results are the unfolded path's bit for bit. The dequantizer keeps weights16_avx2. Why: the
 * sign extension and the offset's subtraction go; one weight row in cache, one thread, Q4_0 2.21-2.28
 * against 2.45-2.61 cycles a 8 weights, Q5_0 3.08-3.10 against 3.57-3.70 (AMD EPYC, AVX2 only). */
static inline int folded_format(int fmt) { return fmt == GGML_Q4_0 || fmt == GGML_Q5_0; }
#endif

#include "gguf_blocks_avx512.h"
#endif
