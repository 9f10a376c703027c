#include "ops.h"

/* ---------------------------------------------------------------- one decoder layer
 * A decode step (or short prompt chunk) of a model whose linear layers are all int4/Q8_0 runs each layer as
 * one call: the same functions as the other files export, in the order LlamaModel.forward calls them, without a trip through
 * Python and torch between them (~2-3 ms of a ~12 ms batch-1 step). Layouts: see engine/native/__init__.py. */
#define KIND_I8 16 /* with KIND_Q4 or KIND_Q8: the weight as tq_i8_pack packed it (scales unused) */
typedef struct {
    int64_t kind; /* KIND_Q4 or KIND_Q8, or either | KIND_I8 */
    const void *w;
    const uint16_t *scales;
    int64_t n, k;
} Linear;

typedef struct {
    const float *attn_norm, *ffn_norm;
    Linear wqkv, wo, gate_up, down;
} Layer;

typedef struct {
    int64_t m, hidden, q_size, width, ffn; /* rows; widths of h, attention output, qkv, the MLP */
    float *h, *res, *x, *qkv, *attn, *gu, *act;
    const int64_t *positions, *blocks, *offsets;
    const float *cos_t, *sin_t;
    int64_t heads, kv_heads, d, block_size, block_stride;
    const int64_t *tables, *row_table, *lens;
    int64_t table_stride;
    float eps, scale;
    int64_t has_res; /* res holds the last sublayer's output, not yet added to h */
    int64_t threads;
    int64_t kv_half; /* the pool holds float16 */
} LayerStep;

static int linear(const Linear *l, const float *x, int64_t m, float *out, int threads) {
    if (l->kind & KIND_I8) /* packed by tq_i8_pack: two digits, as every decode row on kernel path avx512_vnni */
        return tq_i8_matmul((int)(l->kind & ~KIND_I8), (const uint8_t *)l->w, l->n, l->k, x, m, out, 2, threads);
    return quantized_matmul((int)l->kind, l->w, l->scales, l->n, l->k, x, m, out, threads);
}

/* h += res (pending), then the layer; leaves its MLP output in res (pending). Nonzero without memory. */
static int tq_decoder_layer(const Layer *l, LayerStep *s, void *keys, void *values) {
    int t = (int)s->threads;
    int64_t m = s->m;
    tq_rms_norm(s->h, s->has_res ? s->res : NULL, l->attn_norm, m, s->hidden, s->eps, s->x, t);
    if (linear(&l->wqkv, s->x, m, s->qkv, t)) return -1;
    tq_rope_store(s->qkv, m, s->width, s->positions, s->cos_t, s->sin_t, (int)s->heads, (int)s->kv_heads, (int)s->d,
                  keys, values, s->block_stride, s->blocks, s->offsets, (int)s->kv_half, t);
    tq_paged_attention(s->qkv, s->width, keys, values, s->block_stride, s->tables, s->table_stride, s->row_table,
                       s->lens, m, (int)s->heads, (int)s->kv_heads, (int)s->d, (int)s->block_size, s->scale, 0, s->attn,
                       (int)s->kv_half, t);
    if (linear(&l->wo, s->attn, m, s->res, t)) return -1;
    tq_rms_norm(s->h, s->res, l->ffn_norm, m, s->hidden, s->eps, s->x, t);
    if (linear(&l->gate_up, s->x, m, s->gu, t)) return -1;
    tq_silu_mul(s->gu, m, s->ffn, s->act, t);
    if (linear(&l->down, s->act, m, s->res, t)) return -1;
    s->has_res = 1;
    return 0;
}

/* Layers [first, last) of `layers`, each with its own K/V views of the pool: a step's layers in one call. */
int tq_decoder_layers(const Layer *layers, int64_t first, int64_t last, LayerStep *s, void *const *keys,
                      void *const *values) {
    for (int64_t l = first; l < last; l++)
        if (tq_decoder_layer(layers + l, s, keys[l], values[l])) return -1;
    return 0;
}
