/* Attention of decode rows and short prompt chunks over the paged KV pool (float32 or float16 K/V), the same
 * code for both, so a token attends alike whichever way it was computed. */
#include "ops.h"

#ifdef __AVX2__

/* 8 of the pool's K/V elements from offset i, as float32 (F16C converts float16). */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* a . (the pool's d elements from offset b) */
static inline __attribute__((always_inline)) float dot_d(const float *a, const void *kv, int64_t b, int d,
                                                          const int half) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= d; j += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), kv_load8(kv, b + j, half), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), kv_load8(kv, b + j + 8, half), s1);
    }
    if (j < d) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), kv_load8(kv, b + j, half), s0);
    __m256 v = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
/* q . k for 8 consecutive tokens (the pool's rows from offset k, k_stride apart) at once: 8 sums reduced
 * together (hadd, not 8 hsums). */
static inline __attribute__((always_inline)) __m256 dot8_tokens(const float *q, const void *kv, int64_t k,
                                                                 int64_t k_stride, int d, const int half) {
    __m256 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
    for (int j = 0; j < d; j += 8) {
        __m256 qv = _mm256_loadu_ps(q + j);
        for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(qv, kv_load8(kv, k + t * k_stride + j, half), acc[t]);
    }
    return sum8x8(acc);
}

/* o[0:width] += sum_t p[t] inv v_t[0:width] over `count` tokens of one block (v: the pool's offset of its first
 * token's columns, token rows kv apart; `width` a constant <= 64 after inlining: the sums stay in registers,
 * over t in order). */
static inline __attribute__((always_inline)) void weigh_values(const int width, const float *p, float inv,
                                                               const void *values, int64_t v, int64_t kv,
                                                               int64_t count, float *o, const int half) {
    __m256 acc[8];
    for (int j = 0; j < width / 8; j++) acc[j] = _mm256_loadu_ps(o + 8 * j);
    for (int64_t i = 0; i < count; i++) {
        __m256 w = _mm256_set1_ps(p[i] * inv);
        for (int j = 0; j < width / 8; j++)
            acc[j] = _mm256_fmadd_ps(w, kv_load8(values, v + i * kv + 8 * j, half), acc[j]);
    }
    for (int j = 0; j < width / 8; j++) _mm256_storeu_ps(o + 8 * j, acc[j]);
}

#define ATTN_VECTOR(d) ((d) % 8 == 0 && (d) <= 256)
#else
#define ATTN_VECTOR(d) 0
#endif

/* a . (the pool's d elements from offset b) in C: eight partial sums in a fixed order (the compiler may vectorize
 * them, not reorder them: no `omp simd reduction`, whose order it picks per loop), so a float16 pool and a float32
 * one holding the same values give the same bits, as on the SIMD paths. */
static inline float dot_fixed(const float *a, const void *kv, int64_t b, int d, const int half) {
    float part[8] = {0.f};
    int j = 0;
    for (; j + 8 <= d; j += 8)
        for (int i = 0; i < 8; i++) part[i] += a[j + i] * kv_at(kv, b + j + i, half);
    for (int i = 0; j < d; j++, i++) part[i] += a[j] * kv_at(kv, b + j, half);
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* Row r's attention for KV heads [g0, g1) (its query heads g * group ...): scores, softmax and value sums, in
 * the order every row uses (tokens in order; a head's value sums 64 columns at a time), so its result does not
 * depend on how its heads were split into work items. The vector path walks the context a block at a time for
 * all the item's KV heads: each token row of the pool is read whole, in address order, and the blocks AHEAD on
 * are prefetched into L2. Measured at batch 16 over 400 tokens, 30 layers: 0.89x the time of one KV head a pass;
 * what is left is memory (the same calls with one layer's K/V in cache take 0.3x), 295 MB of float32 K/V a
 * step at ~16 GB/s. */
#define AHEAD 2 /* blocks prefetched ahead (1-8 measured the same) */
static inline __attribute__((always_inline)) void attend_row(
    const float *qr, const void *keys, const void *values, int64_t block_stride, const int64_t *table, int64_t len,
    int g0, int g1, int group, int d, int64_t kv, int block_size, float scale, int64_t window, float *scores,
    float *outr, const int half) {
    int nh = (g1 - g0) * group; /* query heads of this item: h = g0 * group + x */
    int64_t first = window > 0 && len > window ? len - window : 0, b0 = first / block_size;
    const float *qh0 = qr + (int64_t)g0 * group * d;
    float *oh0 = outr + (int64_t)g0 * group * d;
    float mx[256], inv[256]; /* up to 256 query heads */
    for (int x = 0; x < nh; x++) mx[x] = -INFINITY;
    for (int64_t start = b0 * block_size, b = b0; start < len; start += block_size, b++) {
        int64_t kb = table[b] * block_stride + (int64_t)g0 * d; /* offset of the block's first key */
        int64_t count = len - start < block_size ? len - start : block_size, i = 0;
#ifdef __AVX2__
        int64_t span = (int64_t)(g1 - g0) * d; /* floats of a token row this item reads */
        for (int64_t a = b == b0 ? b : b + AHEAD; a <= b + AHEAD && a * block_size < len; a++) {
            int64_t at = table[a] * block_stride + (int64_t)g0 * d;
            for (int64_t t = 0; t < block_size; t++)
                for (int64_t j = 0; j < span; j += half ? 32 : 16) { /* a 64-byte line at a time */
                    _mm_prefetch(kv_address(keys, at + t * kv + j, half), _MM_HINT_T1);
                    _mm_prefetch(kv_address(values, at + t * kv + j, half), _MM_HINT_T1);
                }
        }
        if (ATTN_VECTOR(d)) /* whole runs of 8 tokens (a token's run depends only on len: same in any batch) */
            for (; i + 8 <= count; i += 8)
                for (int x = 0; x < nh; x++) {
                    int64_t k = kb + (int64_t)(x / group) * d + i * kv;
                    __m256 sv = _mm256_mul_ps(dot8_tokens(qh0 + (int64_t)x * d, keys, k, kv, d, half),
                                              _mm256_set1_ps(scale));
                    if (start + i < first) { /* the run starts before the window: its early tokens count not */
                        __m256 at = _mm256_add_ps(_mm256_set1_ps((float)(start + i)),
                                                  _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
                        sv = _mm256_blendv_ps(sv, _mm256_set1_ps(-INFINITY),
                                              _mm256_cmp_ps(at, _mm256_set1_ps((float)first), _CMP_LT_OQ));
                    }
                    _mm256_storeu_ps(scores + x * len + start + i, sv);
                    float m8 = hmax8(sv);
                    mx[x] = m8 > mx[x] ? m8 : mx[x];
                }
#endif
        for (; i < count; i++)
            for (int x = 0; x < nh; x++) {
                int64_t k = kb + (int64_t)(x / group) * d + i * kv;
                const float *qh = qh0 + (int64_t)x * d;
#ifdef __AVX2__
                float s = ATTN_VECTOR(d) ? dot_d(qh, keys, k, d, half) : dot_fixed(qh, keys, k, d, half);
#else
                float s = dot_fixed(qh, keys, k, d, half);
#endif
                s = start + i < first ? -INFINITY : s * scale;
                scores[x * len + start + i] = s;
                mx[x] = s > mx[x] ? s : mx[x];
            }
    }
    for (int x = 0; x < nh; x++) {
        float *sc = scores + x * len, sum = 0.f;
        int64_t t = b0 * block_size;
#ifdef __AVX2__
        __m256 m8 = _mm256_set1_ps(mx[x]), s8 = _mm256_setzero_ps();
        for (; t + 8 <= len; t += 8) {
            __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m8));
            _mm256_storeu_ps(sc + t, e);
            s8 = _mm256_add_ps(s8, e);
        }
        float part[8];
        _mm256_storeu_ps(part, s8);
        for (int i = 0; i < 8; i++) sum += part[i];
#endif
        for (; t < len; t++) {
            sc[t] = expf(sc[t] - mx[x]);
            sum += sc[t];
        }
        inv[x] = 1.f / sum;
    }
    for (int x = 0; x < nh * d; x++) oh0[x] = 0.f;
    for (int64_t start = b0 * block_size, b = b0; start < len; start += block_size, b++) {
        int64_t vb = table[b] * block_stride + (int64_t)g0 * d; /* offset of the block's first value */
        int64_t count = len - start < block_size ? len - start : block_size;
#ifdef __AVX2__
        if (ATTN_VECTOR(d)) {
            for (int x = 0; x < nh; x++) { /* the head's sums in registers over the block, 64 floats at a time */
                const float *p = scores + x * len + start;
                int64_t v = vb + (int64_t)(x / group) * d;
                float *oh = oh0 + (int64_t)x * d;
                int j = 0;
                for (; j + 64 <= d; j += 64) weigh_values(64, p, inv[x], values, v + j, kv, count, oh + j, half);
                if (j + 32 <= d) {
                    weigh_values(32, p, inv[x], values, v + j, kv, count, oh + j, half);
                    j += 32;
                }
                if (j + 16 <= d) {
                    weigh_values(16, p, inv[x], values, v + j, kv, count, oh + j, half);
                    j += 16;
                }
                if (j < d) /* d is a multiple of 8 (ATTN_VECTOR) */
                    weigh_values(8, p, inv[x], values, v + j, kv, count, oh + j, half);
            }
            continue;
        }
#endif
        for (int64_t i = 0; i < count; i++)
            for (int x = 0; x < nh; x++) {
                int64_t v = vb + i * kv + (int64_t)(x / group) * d;
                float p = scores[x * len + start + i] * inv[x];
                float *o = oh0 + (int64_t)x * d;
                #pragma omp simd
                for (int j = 0; j < d; j++) o[j] += p * kv_at(values, v + j, half);
            }
    }
}

/* Causal attention of query rows over the paged KV pool: row r (query heads `heads`, head h reading KV head
 * h / (heads / kv_heads)) attends to the first lens[r] tokens of the sequence whose block table is
 * tables[row_table[r] * table_stride ...] (token t in block table[t / block_size]); softmax(q . k * scale)
 * weights the v. A prefill chunk's rows and a decode row run the same code, so a token's result is the same
 * whether it was computed in a prompt or one at a time, in any batch. q and out: [rows, heads * d], q's rows
 * q_stride apart. The K/V of every row must already be in the pool (tq_rope_store). With window > 0 a row sees
 * only its last `window` tokens (a sliding-window layer): blocks before them are not read. An AVX-512 build takes
 * paged_attention_segments (paged_segments.c) where d is a multiple of 16 (bench: 1.4-2x attend_row with K/V in cache; from DRAM,
 * both wait on memory); AVX2 builds and other head sizes, attend_row. */
void tq_paged_attention(const float *q, int64_t q_stride, const void *keys, const void *values,
                        int64_t block_stride, const int64_t *tables, int64_t table_stride, const int64_t *row_table,
                        const int64_t *lens, int64_t rows, int heads, int kv_heads, int d, int block_size,
                        float scale, int64_t window, float *out, int kv_half, int threads) {
    int group = heads / kv_heads;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (d % 16 == 0 && d <= 256 &&
        !paged_attention_segments(q, q_stride, keys, values, block_stride, tables, table_stride, row_table, lens, rows,
                                  heads, kv_heads, d, block_size, scale, window, out, kv_half, threads))
        return;
#endif
    int64_t kv = (int64_t)kv_heads * d, total = 0;
    for (int64_t r = 0; r < rows; r++) total += lens[r];
    /* a row is one work item when there are rows enough to share, else each of its KV heads is one */
    int split = rows >= 2 * threads ? 1 : kv_heads;
    /* one thread for a small call: the parallel region costs more than ~64 tokens of context */
    #pragma omp parallel num_threads(threads) if (total * kv_heads > 256)
    {
        int64_t cap = 0;
        float *scores = NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < rows * split; w++) {
            int64_t r = w / split, len = lens[r];
            int g0 = split == 1 ? 0 : (int)(w % split), g1 = split == 1 ? kv_heads : g0 + 1;
            if (len > cap) {
                free(scores);
                cap = len;
                scores = (float *)malloc((size_t)(cap * heads) * sizeof(float));
            }
            const float *qr = q + r * q_stride;
            const int64_t *table = tables + row_table[r] * table_stride;
            float *outr = out + r * heads * d;
            if (kv_half)
                attend_row(qr, keys, values, block_stride, table, len, g0, g1, group, d, kv, block_size, scale, window,
                           scores, outr, 1);
            else
                attend_row(qr, keys, values, block_stride, table, len, g0, g1, group, d, kv, block_size, scale, window,
                           scores, outr, 0);
        }
        free(scores);
    }
}
