/* Every decoder layer of a Llama-family model for a decode step of a few rows, in one call.
 *
 * Why: at one to a few decode rows a layer's arithmetic takes tens of microseconds, while driving
 * its ten ops from Python (norm, q/k/v matmul, rotary, cache write, attention, o matmul, norm,
 * gate/up matmul, activation, down matmul) costs about as much again in dispatch. Here the same
 * kernels the Python path calls run back to back from C, with the same arguments, so the result is
 * the Python path's bit for bit (tests check it) at a fraction of the overhead: the CPU's
 * counterpart of replaying a captured graph.
 *
 * The caller (forerun.kernels.decode) checks every condition first: fp32, matmuls on the
 * compact-weight GEMV, one rank, all rows decoding. hidden [rows, hidden] holds the embedded tokens
 * and is updated in place; residual [rows, hidden] is written (the first layer starts from hidden
 * alone, as the module path does).
 *
 * `decode_step_f32` is the whole step of an fp32 engine from token ids to the final-norm hidden states
 * and the logits: the embedding rows, the rotary factors of each position, every layer, the final norm,
 * then the LM head's matmul (as a layer's matmuls run, so the logits are the module path's). Why: after
 * a step has streamed the weights through the caches, each of the few torch calls around the layers
 * (an embedding lookup, a table gather, a norm) ran 10-20 times its warm time, cold in the TLB, and
 * together took about as long as 5% of the step; here they are a few loops over the same values.
 *
 * `decode_layers_bf16` is the same step for a bf16 engine: its KV cache is bf16 (the new K/V and the
 * queries round to bf16, and the bf16 attention kernel reads them), everything else stays fp32 (the
 * caller converts hidden states and norm weights, exactly, at the boundary). It keeps more precision
 * than the bf16 module path, which rounds after every op, so it equals that path only within bf16
 * rounding, not bit for bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void gemv_compact_f32(const float *x, const uint8_t *w, int64_t group_bytes, int fmt, const float *b, float *y,
                      int64_t rows, int64_t k, int64_t n, int nthreads);
int gemv_kquant_strided_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, float *y, int64_t ldy,
                            int64_t rows, int64_t k, int64_t n, int isa, int nthreads);
int gemv_int_strided_f32(const float *x, const uint8_t *w, int64_t stride, int fmt, int bits, float *y, int64_t ldy,
                         int64_t rows, int64_t k, int64_t n, int isa, int nthreads);
void add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *res_out,
                      int64_t rows, int64_t hidden, float eps, int nthreads);
void silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter, int nthreads);
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t *out, int nthreads);
void rotary_f32(const float *x, int64_t x_stride, const float *cos, const float *sin, int64_t cos_sin_stride,
                float *out, int64_t tokens, int64_t heads, int64_t D, int nthreads);
int decode_attention_f32(const float *q, int64_t q_stride, const float *cache, const int64_t *tables,
                         int64_t table_stride, const int64_t *lens, float *out, int64_t B, int64_t H, int64_t KVH,
                         int64_t D, int64_t NB, int64_t BS, int64_t window, float scale, int nthreads,
                         int64_t max_len, int split);
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *cache, const int64_t *tables,
                          int64_t table_stride, const int64_t *lens, uint16_t *out, int64_t B, int64_t H,
                          int64_t KVH, int64_t D, int64_t NB, int64_t BS, int64_t window, float scale, int nthreads,
                          int64_t max_len, int split);

/* One matmul: on the compact-weight GEMV (the packed weight, its format and group size), or, where
 * fmt >= BLOCK_FMT, on the block GEMV over a GGUF file's rows of blocks as stored (w the rows,
 * group_bytes the bytes of one row, fmt - BLOCK_FMT the ggml type), or, where fmt >= INT8_FMT, on the
 * GEMV over integer activations (the activation_bits setting: fmt - INT8_FMT the ggml type for 8 bits,
 * fmt - INT16_FMT for 16). A weight packed from parts in
 * different formats (q/k/v or gate/up of a K-quant mix) has one entry per part, each writing its n
 * columns of the output beside the previous part's. bias or NULL. */
enum { BLOCK_FMT = 256, INT8_FMT = 768, INT16_FMT = 1024, MAX_PARTS = 3 };
typedef struct {
    int64_t parts;
    const uint8_t *w[MAX_PARTS];
    int64_t group_bytes[MAX_PARTS];
    int64_t fmt[MAX_PARTS];
    int64_t n[MAX_PARTS];
    const float *bias;
} matmul_t;

typedef struct {
    matmul_t qkv, o, gate_up, down;
    const float *input_norm, *post_norm; /* RMSNorm weights [hidden] */
    void *kv_cache;                      /* [2, num_blocks, block_size, kv_heads, head_dim], fp32 or bf16 */
    int64_t window;                      /* sliding window, 0 for full attention */
} layer_t;

/* The model's shape (fixed at load). */
typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim, num_blocks, block_size;
    float eps, scale;
    int64_t parallel_min_elements; /* smaller element-wise passes run on one thread (forerun.kernels.ops' rule) */
    int64_t split;                 /* 0: attention never splits a context (batch-invariant mode) */
} shape_t;

/* One step's batch (see forerun.kernels.types.DecodeBatch for the decode fields). */
typedef struct {
    int64_t rows;
    const float *cos, *sin; /* per-row rotary factors, rows cos_sin_stride apart */
    int64_t cos_sin_stride;
    const int64_t *slots;  /* [rows] cache slot of each row's new token */
    const int64_t *tables; /* [rows, table_stride] block ids */
    int64_t table_stride;
    const int64_t *lens; /* [rows] context lengths */
    int64_t max_len;
} batch_t;

/* The ends of a whole step (decode_step_f32): the embedding table (rows of `embed_fmt`: a ggml block
 * type dequant_rows_f32 reads, or TABLE_F32 / TABLE_BF16 for plain rows; `embed_rows` rows,
 * `embed_row_bytes` apart), the rotary table (`rotary_rows` positions, each the head_dim cos factors
 * then the head_dim sin factors, as forerun.model.layers.RotaryEmbedding keeps them), the final
 * norm's weight [hidden] and the LM head. */
enum { TABLE_F32 = -1, TABLE_BF16 = -2 };
typedef struct {
    const int64_t *ids, *positions; /* [rows] */
    const uint8_t *embed;
    int64_t embed_fmt, embed_rows, embed_row_bytes;
    const float *rotary;
    int64_t rotary_rows;
    const float *final_norm;
    const matmul_t *head; /* the LM head [head_n, hidden], or NULL: no logits */
    int64_t head_n;
    int64_t *greedy; /* [rows]: each row's argmax of the logits (as argmax_rows_f32 gives it), or NULL */
} ends_t;

/* Threads for an element-wise pass: all of them only from the size forerun.kernels.ops uses. */
static int threads_for(const shape_t *s, int64_t elements, int nthreads) {
    return elements >= s->parallel_min_elements ? nthreads : 1;
}

static inline uint16_t to_bf16(float v) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void matmul(const matmul_t *m, const float *x, float *y, int64_t rows, int64_t k, int64_t n, int nthreads) {
    if (m->fmt[0] < BLOCK_FMT) { /* one part */
        gemv_compact_f32(x, m->w[0], m->group_bytes[0], (int)m->fmt[0], m->bias, y, rows, k, n, nthreads);
        return;
    }
    /* The formats, shapes and part widths (summing to n) were checked when the Python side built it. */
    for (int64_t p = 0, col = 0; p < m->parts; col += m->n[p], p++) {
        if (m->fmt[p] >= INT8_FMT) {
            const int bits = m->fmt[p] >= INT16_FMT ? 16 : 8;
            gemv_int_strided_f32(x, m->w[p], m->group_bytes[p], (int)(m->fmt[p] - (bits == 16 ? INT16_FMT : INT8_FMT)),
                                 bits, y + col, n, rows, k, m->n[p], 0, nthreads);
        } else
            gemv_kquant_strided_f32(x, m->w[p], m->group_bytes[p], (int)(m->fmt[p] - BLOCK_FMT), y + col, n, rows,
                                    k, m->n[p], 0, nthreads);
    }
    if (m->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += m->bias[j];
}

/* The new tokens' K (rotated, in qk) and V (in qkv) into the paged cache; then the attention of q. */
static int attend_f32(const layer_t *L, const shape_t *s, const batch_t *b, const float *qkv, const float *qk,
                      float *att, int nthreads) {
    const int64_t R = b->rows, D = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t qk_w = (H + KVH) * D, qkv_w = qk_w + KVH * D;
    float *K = L->kv_cache, *V = (float *)L->kv_cache + s->num_blocks * s->block_size * KVH * D;
    for (int64_t r = 0; r < R; r++) {
        memcpy(K + b->slots[r] * KVH * D, qk + r * qk_w + H * D, sizeof(float) * (size_t)(KVH * D));
        memcpy(V + b->slots[r] * KVH * D, qkv + r * qkv_w + qk_w, sizeof(float) * (size_t)(KVH * D));
    }
    return decode_attention_f32(qk, qk_w, L->kv_cache, b->tables, b->table_stride, b->lens, att, R, H, KVH, D,
                                s->num_blocks, s->block_size, L->window, s->scale, nthreads, b->max_len, (int)s->split);
}

/* As attend_f32 over a bf16 cache: K, V and q round to bf16 (`qb`, `ab`: [rows, (H + KVH) * D] and
 * [rows, H * D] scratch), the attention output converts back to fp32. */
static int attend_bf16(const layer_t *L, const shape_t *s, const batch_t *b, const float *qkv, const float *qk,
                       float *att, uint16_t *qb, uint16_t *ab, int nthreads) {
    const int64_t R = b->rows, D = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t qk_w = (H + KVH) * D, qkv_w = qk_w + KVH * D;
    uint16_t *K = L->kv_cache, *V = (uint16_t *)L->kv_cache + s->num_blocks * s->block_size * KVH * D;
    for (int64_t r = 0; r < R; r++) {
        for (int64_t i = 0; i < qk_w; i++) qb[r * qk_w + i] = to_bf16(qk[r * qk_w + i]);
        memcpy(K + b->slots[r] * KVH * D, qb + r * qk_w + H * D, sizeof(uint16_t) * (size_t)(KVH * D));
        for (int64_t i = 0; i < KVH * D; i++) V[b->slots[r] * KVH * D + i] = to_bf16(qkv[r * qkv_w + qk_w + i]);
    }
    const int failed = decode_attention_bf16(qb, qk_w, L->kv_cache, b->tables, b->table_stride, b->lens, ab, R, H,
                                             KVH, D, s->num_blocks, s->block_size, L->window, s->scale, nthreads,
                                             b->max_len, (int)s->split);
    for (int64_t i = 0; i < R * H * D; i++) {
        const uint32_t u = (uint32_t)ab[i] << 16;
        memcpy(&att[i], &u, sizeof u);
    }
    return failed;
}

static int decode_layers(const layer_t *layers, int64_t num_layers, const shape_t *s, const batch_t *b, float *hidden,
                         float *residual, int nthreads, int kv_bf16) {
    const int64_t R = b->rows, Hd = s->hidden, D = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t qk_w = (H + KVH) * D, qkv_w = qk_w + KVH * D, I = s->inter;
    float *buf = malloc(sizeof(float) * (size_t)(R * (qkv_w + qk_w + H * D + Hd + 3 * I)));
    uint16_t *half = kv_bf16 ? malloc(sizeof(uint16_t) * (size_t)(R * (qk_w + H * D))) : NULL;
    if (!buf || (kv_bf16 && !half)) {
        free(buf);
        free(half);
        return 1;
    }
    float *qkv = buf, *qk = qkv + R * qkv_w, *att = qk + R * qk_w, *normed = att + R * H * D, *gu = normed + R * Hd;
    float *act = gu + R * 2 * I;
    const int small = threads_for(s, R * Hd, nthreads), rot = threads_for(s, R * qk_w, nthreads);
    const int act_threads = threads_for(s, R * 2 * I, nthreads);
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const layer_t *L = &layers[l];
        /* input norm (the residual add of the previous layer's MLP output fused in) */
        const float *add = l == 0 ? NULL : residual; /* NULL: residual = hidden */
        add_rms_norm_f32(hidden, add, L->input_norm, normed, residual, R, Hd, s->eps, small);
        matmul(&L->qkv, normed, qkv, R, Hd, qkv_w, nthreads);
        rotary_f32(qkv, qkv_w, b->cos, b->sin, b->cos_sin_stride, qk, R, H + KVH, D, rot);
        failed = kv_bf16 ? attend_bf16(L, s, b, qkv, qk, att, half, half + R * qk_w, nthreads)
                         : attend_f32(L, s, b, qkv, qk, att, nthreads);
        matmul(&L->o, att, hidden, R, H * D, Hd, nthreads);
        add_rms_norm_f32(hidden, residual, L->post_norm, normed, residual, R, Hd, s->eps, small);
        matmul(&L->gate_up, normed, gu, R, Hd, 2 * I, nthreads);
        silu_mul_f32(gu, act, R, I, act_threads);
        matmul(&L->down, act, hidden, R, I, Hd, nthreads);
    }
    free(buf);
    free(half);
    return failed;
}

int dequant_rows_f32(const uint8_t *w, int64_t stride, int fmt, int64_t rows, int64_t k, float *out, int nthreads);

/* hidden [rows, hidden] = the embedding rows of e->ids. Returns 0, 3 for an id outside the table (so
 * that a bad id never reads past it), or 4 for a table format dequant_rows_f32 refuses (the caller
 * checked the format). */
static int embed_rows(const ends_t *e, int64_t rows, int64_t hidden_size, float *hidden) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t id = e->ids[r];
        if (id < 0 || id >= e->embed_rows) return 3;
        const uint8_t *row = e->embed + id * e->embed_row_bytes;
        float *out = hidden + r * hidden_size;
        if (e->embed_fmt == TABLE_F32) {
            memcpy(out, row, sizeof(float) * (size_t)hidden_size);
        } else if (e->embed_fmt == TABLE_BF16) { /* exact: a bf16 value is the top half of its fp32 */
            for (int64_t i = 0; i < hidden_size; i++) {
                uint16_t h;
                memcpy(&h, row + 2 * i, 2);
                const uint32_t u = (uint32_t)h << 16;
                memcpy(&out[i], &u, sizeof u);
            }
        } else if (dequant_rows_f32(row, e->embed_row_bytes, (int)e->embed_fmt, 1, hidden_size, out, 1) != 0) {
            return 4;
        }
    }
    return 0;
}

/* out [rows, hidden]: the final-norm hidden states of a decode step from its token ids and positions
 * (the file's comment), and logits [rows, e->head_n] where e->head is set, with each row's argmax in
 * e->greedy where that is set too; hidden and residual [rows, hidden] are scratch. b's cos, sin and
 * cos_sin_stride are ignored: the factors are gathered from e->rotary. Returns 0, 1 when memory runs
 * out, 3 for an id outside the embedding, 4 for an embedding format not read here, 5 for a position
 * outside the rotary table, or decode_layers' code. */
int decode_step_f32(const layer_t *layers, int64_t num_layers, const shape_t *s, const batch_t *b, const ends_t *e,
                    float *out, float *logits, float *hidden, float *residual, int nthreads) {
    const int64_t R = b->rows, D = s->head_dim;
    int failed = embed_rows(e, R, s->hidden, hidden);
    if (failed) return failed;
    float *factors = malloc(sizeof(float) * (size_t)(R * 2 * D));
    if (!factors) return 1;
    for (int64_t r = 0; r < R && !failed; r++) {
        if (e->positions[r] < 0 || e->positions[r] >= e->rotary_rows) failed = 5;
        else memcpy(factors + r * 2 * D, e->rotary + e->positions[r] * 2 * D, sizeof(float) * (size_t)(2 * D));
    }
    batch_t with_factors = *b;
    with_factors.cos = factors, with_factors.sin = factors + D, with_factors.cos_sin_stride = 2 * D;
    if (!failed) failed = decode_layers(layers, num_layers, s, &with_factors, hidden, residual, nthreads, 0);
    free(factors);
    if (failed) return failed;
    add_rms_norm_f32(hidden, residual, e->final_norm, out, residual, R, s->hidden, s->eps,
                     threads_for(s, R * s->hidden, nthreads));
    if (e->head) matmul(e->head, out, logits, R, s->hidden, e->head_n, nthreads);
    /* Greedy sampling's ids while the logits are in cache: the same argmax the sampler would call a
     * moment later, when its code and the logits have gone cold (forerun.kernels.decode). */
    if (e->head && e->greedy) argmax_rows_f32(logits, R, e->head_n, e->greedy, nthreads);
    return 0;
}

int decode_layers_f32(const layer_t *layers, int64_t num_layers, const shape_t *s, const batch_t *b, float *hidden,
                      float *residual, int nthreads) {
    return decode_layers(layers, num_layers, s, b, hidden, residual, nthreads, 0);
}

/* fp32 hidden and residual, a bf16 KV cache (see the file's comment). */
int decode_layers_bf16(const layer_t *layers, int64_t num_layers, const shape_t *s, const batch_t *b, float *hidden,
                       float *residual, int nthreads) {
    return decode_layers(layers, num_layers, s, b, hidden, residual, nthreads, 1);
}
