/* Paged decode attention for the CPU: one query token per sequence, read straight from the paged
 * KV cache (no gather copy); the query heads of one KV head share each K/V load.
 *
 * Layouts: q [B, H, D] with rows q_stride apart; out [B, H, D] contiguous; cache [2, NB, BS, KVH, D]
 * (0 = K, 1 = V); tables [B, table_stride] block ids; lens [B] context lengths (the query is at
 * position len - 1). D must be a multiple of 8. Work items are (sequence, kv head) pairs spread over
 * the caller's OpenMP threads: the process already runs torch's libgomp, which this library binds
 * to by soname, so both share one thread pool.
 *
 * GCC vector extensions (8 floats) keep it portable: -march=native lowers them to AVX2/AVX-512 on
 * x86 and NEON on ARM. Each K row is loaded once and multiplied into every query head of its group,
 * which gives the FMA units independent chains instead of one long dependent reduction.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define MAX_GROUP 16
/* Rows are read in block order but each is a few cache lines far from the last: fetch PF rows ahead. */
#define PF 6

/* One (sequence, kv head): scores for every position and query head, softmax, weighted V sum. */
#define ATTEND_ONE(T, LOAD8, STORE)                                                                \
    {                                                                                              \
        const int64_t b = item / KVH, h = item % KVH, len = lens[b];                               \
        const int64_t start = (window > 0 && len > window) ? len - window : 0;                     \
        const int64_t n = len - start;                                                             \
        for (int64_t g = 0; g < G; g++)                                                            \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                v8f x = LOAD8(&q[b * q_stride + (h * G + g) * D + d]) * scale;                     \
                memcpy(&qf[g * D + d], &x, sizeof x);                                              \
            }                                                                                      \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const int64_t p = start + i;                                                           \
            slots[i] = ((tables[b * table_stride + p / BS] * BS + p % BS) * KVH + h) * D;          \
        }                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const T *k = K + slots[i];                                                             \
            if (i + PF < n) prefetch_row(K + slots[i + PF], D * (int64_t)sizeof(T));              \
            v8f a[MAX_GROUP];                                                                      \
            for (int64_t g = 0; g < G; g++) a[g] = (v8f){0};                                       \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                const v8f kv = LOAD8(k + d);                                                       \
                for (int64_t g = 0; g < G; g++) a[g] += load8_f32(&qf[g * D + d]) * kv;            \
            }                                                                                      \
            for (int64_t g = 0; g < G; g++) scores[g * max_len + i] = hsum8(a[g]);                 \
        }                                                                                          \
        float inv_sum[MAX_GROUP];                                                                  \
        for (int64_t g = 0; g < G; g++) {                                                          \
            float *sg = scores + g * max_len, mx = -INFINITY, sum = 0.f;                           \
            for (int64_t i = 0; i < n; i++) mx = sg[i] > mx ? sg[i] : mx;                          \
            int64_t i = 0;                                                                         \
            v8f vsum = splat8(0.f);                                                                \
            for (; i + 8 <= n; i += 8) {                                                           \
                const v8f e = exp8(load8_f32(sg + i) - mx);                                        \
                store8_f32(sg + i, e);                                                             \
                vsum += e;                                                                         \
            }                                                                                      \
            sum = hsum8(vsum);                                                                     \
            for (; i < n; i++) { sg[i] = expf(sg[i] - mx); sum += sg[i]; }                         \
            inv_sum[g] = 1.f / sum;                                                                \
        }                                                                                          \
        memset(acc, 0, sizeof(float) * (size_t)(G * D));                                           \
        for (int64_t i = 0; i < n; i++) {                                                          \
            const T *v = V + slots[i];                                                             \
            if (i + PF < n) prefetch_row(V + slots[i + PF], D * (int64_t)sizeof(T));              \
            for (int64_t d = 0; d < D; d += 8) {                                                   \
                const v8f vv = LOAD8(v + d);                                                       \
                for (int64_t g = 0; g < G; g++) {                                                  \
                    v8f x = load8_f32(&acc[g * D + d]) + scores[g * max_len + i] * vv;             \
                    memcpy(&acc[g * D + d], &x, sizeof x);                                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int64_t g = 0; g < G; g++)                                                            \
            for (int64_t d = 0; d < D; d++)                                                        \
                STORE(&out[((b * H) + h * G + g) * D + d], acc[g * D + d] * inv_sum[g]);           \
    }

#define DECODE_ATTENTION(NAME, T, LOAD8, STORE)                                                    \
    int NAME(const T *q, int64_t q_stride, const T *cache, const int64_t *tables,                  \
             int64_t table_stride, const int64_t *lens, T *out, int64_t B, int64_t H, int64_t KVH, \
             int64_t D, int64_t NB, int64_t BS, int64_t window, float scale, int nthreads,         \
             int64_t max_len) {                                                                    \
        const int64_t G = H / KVH;                                                                 \
        if (G > MAX_GROUP || D % 8) return 2;                                                      \
        const T *K = cache;                                                                        \
        const T *V = cache + NB * BS * KVH * D;                                                    \
        int failed = 0;                                                                            \
        _Pragma("omp parallel num_threads(nthreads)") {                                            \
            float *scores = malloc(sizeof(float) * (size_t)(G * max_len));                         \
            float *qf = malloc(sizeof(float) * (size_t)(G * D));                                   \
            float *acc = malloc(sizeof(float) * (size_t)(G * D));                                  \
            int64_t *slots = malloc(sizeof(int64_t) * (size_t)max_len);                            \
            const int ok = scores && qf && acc && slots;                                           \
            if (!ok) {                                                                             \
                _Pragma("omp atomic write") failed = 1;                                            \
            }                                                                                      \
            _Pragma("omp for schedule(static)") for (int64_t item = 0; item < B * KVH; item++) {   \
                if (ok) ATTEND_ONE(T, LOAD8, STORE)                                                \
            }                                                                                      \
            free(scores);                                                                          \
            free(qf);                                                                              \
            free(acc);                                                                             \
            free(slots);                                                                           \
        }                                                                                          \
        return failed;                                                                             \
    }

DECODE_ATTENTION(decode_attention_f32, float, load8_f32, st_f32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, load8_bf16, st_bf16)
