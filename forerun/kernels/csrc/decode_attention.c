/* Paged decode attention for the CPU: one query token per sequence, read straight from the paged
 * KV cache (no gather copy); the query heads of one KV head share each K/V load.
 *
 * Layouts: q [B, H, D] with rows q_stride apart; out [B, H, D] contiguous; cache [2, NB, BS, KVH, D]
 * (0 = K, 1 = V); tables [B, table_stride] block ids; lens [B] context lengths (the query is at
 * position len - 1). D must be a multiple of 8. Work items are spread over the caller's OpenMP
 * threads: the process already runs torch's libgomp, which this library binds to by soname, so both
 * share one thread pool.
 *
 * Work items: with at least two sequences per thread an item is a whole sequence, all its KV heads:
 * a position's K (then V) values of every head lie side by side in the cache, so the item reads them
 * as one contiguous run, which the memory system streams at about 1.5x the rate it serves the
 * every-other-256-bytes pattern of one head at a time (measured at 64 sequences of 256 tokens). With
 * fewer sequences (one request decoding) an item is one (sequence, KV head), so every thread works;
 * with fewer of those than two per thread, an item is also one part of the context (flash-decoding's
 * split), and each query head's parts are merged by rescaling their sums to the largest max score:
 * one request of 1,000 tokens with 3 KV heads on 2 threads went from 202-219 to 178-188 us a layer.
 * `split` 0 fixes the split instead (batch-invariant mode), so that a row's result does not depend on
 * how many rows and threads share the call: a row's context is cut into parts by its own length alone
 * (one part a FIXED_PART positions, at most MAX_PARTS, of equal size), merged in part order; whole
 * sequences or (sequence, KV head) pairs are still the items, which changes who computes a part, not
 * its sums. A prefill token given as a row then equals the same token decoded, and one request keeps
 * every thread busy over a long context (one part a row at 128/1,024 lost 2-3% of one request's speed).
 * There, as soon as rows times parts give two items a thread, an item is a whole (sequence, part), all
 * KV heads, read as one run: one request's attention over 1,024 positions, 3 KV heads, 2 threads, in
 * 30 layers took 1.99 ms against 3.22 as (sequence, KV head, part) items and 2.66 split by the batch.
 *
 * GCC vector extensions (8 floats) keep it portable: -march=native lowers them to AVX2/AVX-512 on
 * x86 and NEON on ARM. The group size (query heads per KV head) is a compile-time constant in the
 * inner loops for the common sizes, so their accumulators stay in registers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define MAX_GROUP 16
#define MAX_HEADS 256
/* Positions ahead to fetch: the rows are a few cache lines each and not always adjacent (blocks). */
#define PF 8
/* Context parts per (sequence, KV head) when there are few of those: at most MAX_PARTS, each at least
 * MIN_PART positions (shorter ones cost more to merge than they save). */
#define MAX_PARTS 16
#define MIN_PART 64
/* Positions a part of a row's context covers in batch-invariant mode (until MAX_PARTS parts). */
#define FIXED_PART 128
/* Output columns pv keeps per query head. 16 lanes a vector (the head size a multiple of 16 on
 * AVX-512): MAX_COLS in registers for up to 4 query heads a KV head (G x MAX_COLS / 16 vectors), else
 * PV_COLS. 8 lanes: a whole head of up to MAX_COLS (pv), or LONG_COLS at a time (pv_long), the
 * accumulators that the 16 registers cannot hold kept in L1 (see pv). */
#define PV_COLS 32
#define MAX_COLS 64
#define LONG_COLS 128
/* Whether pv sums a head of D values 16 lanes a vector. */
#define WIDE_VALUES(D) (VEC16_NATIVE && (D) % 16 == 0)
#define INLINE static inline __attribute__((always_inline))

/* Batch-invariant mode's parts of a row of context length `len`: from its length alone. */
static inline int64_t fixed_parts(int64_t len, int64_t window) {
    const int64_t n = window > 0 && len > window ? window : len, parts = (n + FIXED_PART - 1) / FIXED_PART;
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

/* Calls CALL(g) with g a literal for the usual group sizes (unrolled, register accumulators):
 * 1 (multi-head), 2-8 (grouped-query models: SmolLM2 3, Llama 4, Qwen2 7, ...). */
#define BY_GROUP(G, CALL)       \
    switch (G) {                \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        case 3: CALL(3); break; \
        case 4: CALL(4); break; \
        case 5: CALL(5); break; \
        case 6: CALL(6); break; \
        case 7: CALL(7); break; \
        case 8: CALL(8); break; \
        default: CALL(G);       \
    }

/* pv's columns d0 .. d0 + cols (at most BOUND, a constant) of head h (sh: its scores), WIDTH lanes a
 * vector. */
#define PV_COLUMNS(T, WIDTH, VF, SPLAT, LOADW, STOREW, BOUND)                                            \
    do {                                                                                                 \
        const int64_t w = D - d0 < cols ? (D - d0) / WIDTH : cols / WIDTH;                               \
        VF a[MAX_GROUP][BOUND / WIDTH];                                                                  \
        for (int g = 0; g < G; g++)                                                                      \
            for (int j = 0; j < w; j++) a[g][j] = SPLAT(0.f);                                            \
        for (int64_t i = 0; i < n; i++) {                                                                \
            if (i + PF < n) prefetch_row(V + rows[i + PF] + h * D + d0, WIDTH * w * (int64_t)sizeof(T)); \
            const T *v = V + rows[i] + h * D + d0;                                                       \
            for (int j = 0; j < BOUND / WIDTH; j++) {                                                    \
                if (j >= w) break;                                                                       \
                const VF vv = LOADW(v + WIDTH * j);                                                      \
                for (int g = 0; g < G; g++) a[g][j] += sh[g * max_len + i] * vv;                         \
            }                                                                                            \
        }                                                                                                \
        for (int g = 0; g < G; g++)                                                                      \
            for (int j = 0; j < w; j++) STOREW(acc + ((h - h0) * G + g) * D + d0 + WIDTH * j, a[g][j]);  \
    } while (0)

/* a[g] = the 8 lanes of q[g] . k over a head of 64 (qv: the queries in registers), lane l summing
 * d = l mod 8 in increasing d. */
#define QK64_DOT(LOAD8, k, a)                                                                            \
    do {                                                                                                 \
        for (int g = 0; g < G; g++) (a)[g] = splat8(0.f);                                                \
        for (int j = 0; j < 8; j++) {                                                                    \
            const v8f kv = LOAD8((k) + 8 * j);                                                           \
            for (int g = 0; g < G; g++) (a)[g] += qv[g][j] * kv;                                         \
        }                                                                                                \
    } while (0)

#define DEFINE_ATTENTION(SUFFIX, T, LOAD8, LOAD16, STORE)                                                \
    /* scores[(h * G + g) * max_len + i] = q[h, g] . K[row i, head h] for heads h0..h1 (qf is pre-scaled): \
     * 8 lanes, lane l summing d = l mod 8 in increasing d, then hsum8. Head by head, so that at D = 64  \
     * a head's queries stay in registers over the rows. */                                          \
    INLINE void qk_##SUFFIX(const int G, const float *qf, const T *K, const int64_t *rows, int64_t n,        \
                            int64_t h0, int64_t h1, int64_t D, float *scores, int64_t max_len) {            \
        for (int64_t h = h0; h < h1; h++) {                                                              \
            const float *qh = qf + (h - h0) * G * D;                                                     \
            float *sh = scores + (h - h0) * G * max_len;                                                 \
            if (D == 64) {                                                                               \
                v8f qv[MAX_GROUP][8];                                                                    \
                for (int g = 0; g < G; g++)                                                              \
                    for (int j = 0; j < 8; j++) qv[g][j] = load8_f32(qh + g * 64 + 8 * j);               \
                /* Eight positions at a time, their sums finished together (hsum8_pairs); the rest one   \
                 * by one. Intel Xeon, one thread, 768 positions: 29.0-29.1 against 30.1-30.6 us. */  \
                int64_t i = 0;                                                                           \
                for (; VEC_SHUFFLES && i + 8 <= n; i += 8) { /* without shuffles: one by one below */    \
                    v8f pairs[MAX_GROUP][4];                                                             \
                    for (int u = 0; u < 8; u += 2) {                                                     \
                        v8f a[2][MAX_GROUP];                                                             \
                        for (int e = 0; e < 2; e++) {                                                    \
                            const int64_t at = i + u + e;                                                \
                            if (at + PF < n) prefetch_row(K + rows[at + PF] + h * 64, 64 * (int64_t)sizeof(T)); \
                            QK64_DOT(LOAD8, K + rows[at] + h * 64, a[e]);                                \
                        }                                                                                \
                        for (int g = 0; g < G; g++) pairs[g][u / 2] = hsum8_pair(a[0][g], a[1][g]);      \
                    }                                                                                    \
                    for (int g = 0; g < G; g++) store8_f32(sh + g * max_len + i, hsum8_pairs(pairs[g])); \
                }                                                                                        \
                for (; i < n; i++) {                                                                     \
                    if (i + PF < n) prefetch_row(K + rows[i + PF] + h * 64, 64 * (int64_t)sizeof(T));    \
                    v8f a[MAX_GROUP];                                                                    \
                    QK64_DOT(LOAD8, K + rows[i] + h * 64, a);                                            \
                    for (int g = 0; g < G; g++) sh[g * max_len + i] = hsum8(a[g]);                       \
                }                                                                                        \
                continue;                                                                                \
            }                                                                                            \
            for (int64_t i = 0; i < n; i++) {                                                            \
                if (i + PF < n) prefetch_row(K + rows[i + PF] + h * D, D * (int64_t)sizeof(T));          \
                const T *k = K + rows[i] + h * D;                                                        \
                v8f a[MAX_GROUP];                                                                        \
                for (int g = 0; g < G; g++) a[g] = splat8(0.f);                                          \
                for (int64_t d = 0; d < D; d += 8) {                                                     \
                    const v8f kv = LOAD8(k + d);                                                         \
                    for (int g = 0; g < G; g++) a[g] += load8_f32(qh + g * D + d) * kv;                  \
                }                                                                                        \
                for (int g = 0; g < G; g++) sh[g * max_len + i] = hsum8(a[g]);                           \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
    /* acc[(h * G + g) * D + d] = sum of p[h, g, i] * V[row i, head h, d] over all rows, i in increasing \
     * order from 0 (each element one multiply-add a row): held in registers over the rows, PV_COLS      \
     * columns at a time, every element of acc written. Where D allows, 16 lanes a vector (the same     \
     * multiply-adds, half the instructions on AVX-512) and, for up to 4 query heads a KV head, MAX_COLS \
     * columns at a time, so that enough accumulators are in flight to cover a multiply-add's latency   \
     * (Intel Xeon, one thread, 768 positions, 3 query heads a KV head: 31.1-32.0 us against 32.6-32.7 \
     * at 32 columns and 33.6-34.3 at 8 lanes). At 8 lanes (AVX2) a head of up to MAX_COLS is done in one \
     * pass over the rows, its accumulators beyond the 16 registers in L1: a pass per 32 columns read \
     * each V row in parts, every part a wait on memory (AMD EPYC, AVX2, 2 threads, V from memory: one \
     * request of 3 query heads a KV head at head size 64 and 192 positions, 20-25 against 23-35 us a  \
     * layer; 64 requests of 192 positions, 1.30-1.41 against 1.79-1.93 ms). */                         \
    INLINE void pv_##SUFFIX(const int G, const float *scores, int64_t max_len, const T *V,                \
                            const int64_t *rows, int64_t n, int64_t h0, int64_t h1, int64_t D,               \
                            float *acc) {                                                                \
        const int wide = WIDE_VALUES(D);                                                                 \
        const int64_t cols = !wide || G <= 4 ? MAX_COLS : PV_COLS;                                       \
        for (int64_t h = h0; h < h1; h++)                                                                \
            for (int64_t d0 = 0; d0 < D; d0 += cols) {                                                   \
                const float *sh = scores + (h - h0) * G * max_len;                                       \
                if (wide) PV_COLUMNS(T, 16, v16f, splat16, LOAD16, store16_f32, MAX_COLS);               \
                else PV_COLUMNS(T, 8, v8f, splat8, LOAD8, store8_f32, MAX_COLS);                         \
            }                                                                                            \
    }                                                                                                    \
    /* pv at 8 lanes for heads over MAX_COLS, LONG_COLS columns a pass (its own function: the larger   \
     * bound in pv made the head size 64's code slower). Head size 128, 4 query heads a KV head, one   \
     * request of 256 positions: 127-163 against 185-308 us a layer at 32 columns a pass. */           \
    INLINE void pv_long_##SUFFIX(const int G, const float *scores, int64_t max_len, const T *V,           \
                                 const int64_t *rows, int64_t n, int64_t h0, int64_t h1, int64_t D,          \
                                 float *acc) {                                                           \
        const int64_t cols = LONG_COLS;                                                                  \
        for (int64_t h = h0; h < h1; h++)                                                                \
            for (int64_t d0 = 0; d0 < D; d0 += cols) {                                                   \
                const float *sh = scores + (h - h0) * G * max_len;                                       \
                PV_COLUMNS(T, 8, v8f, splat8, LOAD8, store8_f32, LONG_COLS);                             \
            }                                                                                            \
    }                                                                                                    \
    /* One item: sequence b, KV heads h0..h1, and of its context positions part `part` of `parts`. With  \
     * one part the result goes to out; with several, the part's unnormalised sums, its max score and   \
     * its sum of exponentials go to `partial` ([heads][D + 2]) for merge_parts. */                     \
    static void attend_##SUFFIX(const T *q, int64_t q_stride, const T *K, const T *V, const int64_t *tables, \
                                int64_t table_stride, const int64_t *lens, T *out, int64_t b, int64_t h0,   \
                                int64_t h1, int64_t H, int64_t KVH, int64_t D, int64_t BS, int64_t window,  \
                                float scale, int64_t max_len, float *scores, float *qf, float *acc,       \
                                int64_t *rows, int64_t part, int64_t parts, float *partial) {             \
        const int64_t G = H / KVH, RW = KVH * D, heads = (h1 - h0) * G, len = lens[b];                  \
        const int64_t first = (window > 0 && len > window) ? len - window : 0;                           \
        const int64_t chunk = (len - first + parts - 1) / parts;                                         \
        const int64_t start = first + part * chunk < len ? first + part * chunk : len;                   \
        const int64_t n = (start + chunk < len ? start + chunk : len) - start;                           \
        const T *qb = q + b * q_stride + h0 * G * D;                                                     \
        for (int64_t x = 0; x < heads * D; x += 8) store8_f32(&qf[x], LOAD8(qb + x) * scale);            \
        /* Block by block: a division a position took a sixth of one thread's time at 768 positions. */ \
        for (int64_t i = 0, p = start; i < n;) {                                                         \
            const int64_t off = p % BS, run = BS - off < n - i ? BS - off : n - i;                       \
            const int64_t first = (tables[b * table_stride + p / BS] * BS + off) * RW;                   \
            for (int64_t j = 0; j < run; j++) rows[i + j] = first + j * RW;                              \
            i += run, p += run;                                                                          \
        }                                                                                                \
        float inv_sum[MAX_HEADS];                                                                        \
        BY_GROUP(G, QK_##SUFFIX)                                                                         \
        for (int64_t j = 0; j < heads; j++) {                                                            \
            float *sg = scores + j * max_len, mx = -INFINITY;                                            \
            /* The largest score, eight lanes at a time: a maximum does not depend on the order (a NaN   \
             * is skipped either way), and one chain of compares waited on each compare's latency. */   \
            v8f m8 = splat8(-INFINITY);                                                                  \
            int64_t i = 0;                                                                               \
            for (; i + 8 <= n; i += 8) {                                                                 \
                const v8f v = load8_f32(sg + i);                                                         \
                m8 = select8(v > m8, v, m8);                                                             \
            }                                                                                            \
            for (int l = 0; l < 8; l++) mx = m8[l] > mx ? m8[l] : mx;                                    \
            for (; i < n; i++) mx = sg[i] > mx ? sg[i] : mx;                                             \
            i = 0;                                                                                       \
            v8f vsum = splat8(0.f);                                                                      \
            for (; i + 8 <= n; i += 8) {                                                                 \
                const v8f e = exp8(load8_f32(sg + i) - mx);                                              \
                store8_f32(sg + i, e);                                                                   \
                vsum += e;                                                                               \
            }                                                                                            \
            float sum = hsum8(vsum);                                                                     \
            for (; i < n; i++) { sg[i] = expf(sg[i] - mx); sum += sg[i]; }                                \
            inv_sum[j] = 1.f / sum;                                                                      \
            if (parts > 1) partial[j * (D + 2) + D] = mx, partial[j * (D + 2) + D + 1] = sum;            \
        }                                                                                                \
        if (!WIDE_VALUES(D) && D > MAX_COLS) BY_GROUP(G, PVL_##SUFFIX)                                   \
        else BY_GROUP(G, PV_##SUFFIX)                                                                    \
        if (parts > 1) {                                                                                 \
            for (int64_t j = 0; j < heads; j++) memcpy(partial + j * (D + 2), acc + j * D, sizeof(float) * (size_t)D); \
            return;                                                                                      \
        }                                                                                                \
        T *ob = out + (b * H + h0 * G) * D;                                                              \
        for (int64_t j = 0; j < heads; j++)                                                              \
            for (int64_t d = 0; d < D; d++) STORE(&ob[j * D + d], acc[j * D + d] * inv_sum[j]);          \
    }                                                                                                    \
    /* out for query head j of sequence b from its parts' partial results: each part's sums rescaled   \
     * to the largest max score (an empty part has max -inf and weighs nothing). */                     \
    static void merge_parts_##SUFFIX(const float *partial, int64_t stride, int64_t parts, int64_t D, T *out) { \
        float top = -INFINITY, sum = 0.f, w[MAX_PARTS];                                                  \
        for (int64_t p = 0; p < parts; p++) top = fmaxf(top, partial[p * stride + D]);                      \
        for (int64_t p = 0; p < parts; p++) {                                                            \
            const float m = partial[p * stride + D];                                                     \
            w[p] = m == -INFINITY ? 0.f : expf(m - top);                                                 \
            sum += w[p] * partial[p * stride + D + 1];                                                   \
        }                                                                                                \
        for (int64_t d = 0; d < D; d++) {                                                                \
            float a = 0.f;                                                                               \
            for (int64_t p = 0; p < parts; p++) a += w[p] * partial[p * stride + d];                     \
            STORE(&out[d], a / sum);                                                                     \
        }                                                                                                \
    }                                                                                                    \
    int decode_attention_##SUFFIX(const T *q, int64_t q_stride, const T *cache, const int64_t *tables,      \
                                  int64_t table_stride, const int64_t *lens, T *out, int64_t B, int64_t H,  \
                                  int64_t KVH, int64_t D, int64_t NB, int64_t BS, int64_t window,         \
                                  float scale, int nthreads, int64_t max_len, int split) {                 \
        const int64_t G = H / KVH;                                                                       \
        if (G > MAX_GROUP || H > MAX_HEADS || D % 8) return 2;                                           \
        const T *K = cache;                                                                              \
        const T *V = cache + NB * BS * KVH * D;                                                          \
        int whole = B >= 2 * (int64_t)nthreads; /* items: sequences, else (sequence, KV head) */        \
        /* Fewer (sequence, KV head) items than two per thread (one request decoding): each item's      \
         * context is also split into parts of at least MIN_PART positions, merged at the end. */       \
        int64_t parts = 1; /* the most parts of a row (batch-invariant mode: each row its own) */     \
        if (split && !whole && B * KVH < 2 * (int64_t)nthreads) {                                        \
            parts = (2 * (int64_t)nthreads + B * KVH - 1) / (B * KVH);                                   \
            parts = parts < max_len / MIN_PART ? parts : max_len / MIN_PART;                             \
            parts = parts < MAX_PARTS ? (parts > 1 ? parts : 1) : MAX_PARTS;                             \
        }                                                                                                \
        for (int64_t b = 0; !split && b < B; b++)                                                        \
            parts = fixed_parts(lens[b], window) > parts ? fixed_parts(lens[b], window) : parts;         \
        if (!split && B * parts >= 2 * (int64_t)nthreads) whole = 1;                                     \
        const int64_t span = whole ? KVH : 1, items = (whole ? B : B * KVH) * parts;                     \
        float *partial = parts > 1 ? malloc(sizeof(float) * (size_t)(items * span * G * (D + 2))) : NULL; \
        if (parts > 1 && !partial) return 1;                                                             \
        int failed = 0;                                                                                  \
        _Pragma("omp parallel num_threads(nthreads)") {                                                  \
            float *scores = malloc(sizeof(float) * (size_t)(span * G * max_len));                        \
            float *qf = malloc(sizeof(float) * (size_t)(span * G * D));                                  \
            float *acc = malloc(sizeof(float) * (size_t)(span * G * D));                                 \
            int64_t *rows = malloc(sizeof(int64_t) * (size_t)max_len);                                   \
            const int ok = scores && qf && acc && rows;                                                  \
            if (!ok) {                                                                                   \
                _Pragma("omp atomic write") failed = 1;                                                  \
            }                                                                                            \
            /* Item (b, p) (whole) or (b, h, p); its partial sums at partial + item * span * G * (D + 2). */ \
            _Pragma("omp for schedule(static)") for (int64_t item = 0; item < items; item++) {           \
                const int64_t b = whole ? item / parts : item / (KVH * parts);                           \
                const int64_t h0 = whole ? 0 : item / parts % KVH, part = item % parts;                  \
                const int64_t mine = split ? parts : fixed_parts(lens[b], window);                       \
                if (ok && part < mine)                                                                   \
                    attend_##SUFFIX(q, q_stride, K, V, tables, table_stride, lens, out, b, h0, h0 + span, H, \
                                    KVH, D, BS, window, scale, max_len, scores, qf, acc, rows, part, mine, \
                                    mine > 1 ? partial + item * span * G * (D + 2) : NULL);              \
            }                                                                                            \
            if (parts > 1) { /* query head j = h * G + g of sequence b from its parts, in part order */  \
                _Pragma("omp for schedule(static)") for (int64_t bj = 0; bj < B * H; bj++) {             \
                    const int64_t b = bj / H, j = bj % H, h = j / G, g = j % G;                          \
                    const int64_t mine = split ? parts : fixed_parts(lens[b], window);                   \
                    const float *first = whole ? partial + (b * parts * H + j) * (D + 2)                 \
                                               : partial + ((b * KVH + h) * parts * G + g) * (D + 2);    \
                    if (ok && mine > 1)                                                                  \
                        merge_parts_##SUFFIX(first, (whole ? H : G) * (D + 2), mine, D, out + bj * D);   \
                }                                                                                        \
            }                                                                                            \
            free(scores);                                                                                \
            free(qf);                                                                                    \
            free(acc);                                                                                   \
            free(rows);                                                                                  \
        }                                                                                                \
        free(partial);                                                                                   \
        return failed;                                                                                   \
    }

#define QK_f32(GG) qk_f32(GG, qf, K, rows, n, h0, h1, D, scores, max_len)
#define PV_f32(GG) pv_f32(GG, scores, max_len, V, rows, n, h0, h1, D, acc)
#define PVL_f32(GG) pv_long_f32(GG, scores, max_len, V, rows, n, h0, h1, D, acc)
#define QK_bf16(GG) qk_bf16(GG, qf, K, rows, n, h0, h1, D, scores, max_len)
#define PV_bf16(GG) pv_bf16(GG, scores, max_len, V, rows, n, h0, h1, D, acc)
#define PVL_bf16(GG) pv_long_bf16(GG, scores, max_len, V, rows, n, h0, h1, D, acc)

DEFINE_ATTENTION(f32, float, load8_f32, load16_f32, st_f32)
DEFINE_ATTENTION(bf16, uint16_t, load8_bf16, load16_bf16, st_bf16)
