#include "ops.h"

/* Decode rows' and short chunks' attention on AVX-512, which tq_paged_attention (paged_attention.c) takes where d is a
 * multiple of 16: 1.4-2x its AVX2 rows with K/V in cache.
 * A work item is one row over one segment of its context: SEG tokens from a multiple of SEG, so a row's items depend
 * only on its length (never on the batch, the threads or how a prompt was chunked). The item reads its tokens' K
 * and V rows whole, in order (every KV head), 16 floats an instruction, a key or value once for all the query heads
 * that share it (GQA). It leaves each head's softmax max and sum with its unnormalized value sums; a row of more
 * than one segment adds them up in order afterwards (flash-decoding), so a long context runs on every thread. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define SEG 128      /* tokens of a work item */
#define SEG_HEADS 3  /* query heads whose scores a pass takes (8 tokens x 3 heads: 24 accumulators) */
#define SEG_VHEADS 4 /* query heads whose value sums a pass takes (4 x 64 floats: 16 accumulators) */
#define SEG_RUN 16   /* tokens whose value sums stay in registers (their V rows stay in L1 for every head) */

/* the sums of 8 vectors of 16, as one: [sum a[0], ..., sum a[7]] */
static inline __attribute__((always_inline)) __m256 sum8x16(const __m512 a[8]) {
    __m256 y[8];
    for (int t = 0; t < 8; t++) y[t] = _mm256_add_ps(_mm512_castps512_ps256(a[t]), _mm512_extractf32x8_ps(a[t], 1));
    return sum8x8(y);
}

/* q . k of H query heads (q: H rows of d) and 8 tokens (their K rows at[0..7], this KV head's columns from gd) into
 * sc[h * SEG + 0..7] */
static inline __attribute__((always_inline)) void scores8(const int H, const int half, const float *q, int d,
                                                          const void *keys, const int64_t *at, int64_t gd, float *sc) {
    __m512 acc[SEG_HEADS][8];
    for (int h = 0; h < H; h++)
        for (int t = 0; t < 8; t++) acc[h][t] = _mm512_setzero_ps();
    for (int j = 0; j < d; j += 16) {
        __m512 qv[SEG_HEADS];
        for (int h = 0; h < H; h++) qv[h] = _mm512_loadu_ps(q + h * d + j);
        for (int t = 0; t < 8; t++) {
            __m512 k = kv_load16(keys, at[t] + gd + j, half);
            for (int h = 0; h < H; h++) acc[h][t] = _mm512_fmadd_ps(qv[h], k, acc[h][t]);
        }
    }
    for (int h = 0; h < H; h++) _mm256_storeu_ps(sc + h * SEG, sum8x16(acc[h]));
}

/* o[h * d + 16 c] += sum_i p[h * SEG + i] v_i[16 c ...] for H heads, W vectors, tokens [i0, i1) in order (their V
 * rows at[i], this head's columns from gj) */
static inline __attribute__((always_inline)) void values_pass(const int H, const int W, const int half, const float *p,
                                                              const void *values, const int64_t *at, int64_t gj,
                                                              int64_t i0, int64_t i1, float *o, int d) {
    __m512 acc[SEG_VHEADS][4];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < W; c++) acc[h][c] = _mm512_loadu_ps(o + h * d + 16 * c);
    for (int64_t i = i0; i < i1; i++) {
        __m512 v[4];
        for (int c = 0; c < W; c++) v[c] = kv_load16(values, at[i] + gj + 16 * c, half);
        for (int h = 0; h < H; h++) {
            __m512 w = _mm512_set1_ps(p[h * SEG + i]);
            for (int c = 0; c < W; c++) acc[h][c] = _mm512_fmadd_ps(w, v[c], acc[h][c]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < W; c++) _mm512_storeu_ps(o + h * d + 16 * c, acc[h][c]);
}

#define SCORES_CASE(H)                                                                                                \
    case H: scores8(H, half, qr + (int64_t)h * d, d, keys, at + i, g * d, sc + h * SEG + i); break;
#define VALUES_W(H, W)                                                                                                \
    case W: values_pass(H, W, half, sc + h * SEG, values, at, g * d + j, a, b, o + h * d + j, d); break;
#define VALUES_CASE(H)                                                                                                \
    case H:                                                                                                           \
        switch (w) { VALUES_W(H, 1) VALUES_W(H, 2) VALUES_W(H, 3) VALUES_W(H, 4) }                                    \
        break;

/* Tokens [lo, hi) of the segment from s0, every head (qr: the row's heads x d): the unnormalized value sums into o
 * [heads][d], head h's score max into ml[h] and its exp-sum into ml[heads + h]; sc: heads x SEG floats of scratch. */
static inline __attribute__((always_inline)) void attend_segment(
    const int half, const float *qr, const void *keys, const void *values, int64_t block_stride, const int64_t *table,
    int64_t s0, int64_t lo, int64_t hi, int heads, int kv_heads, int d, int block_size, float scale, float *sc,
    float *o, float *ml) {
    int group = heads / kv_heads;
    int64_t kv = (int64_t)kv_heads * d, at[SEG];
    int64_t r0 = lo & ~(int64_t)7, r1 = (hi + 7) & ~(int64_t)7, i0 = r0 - s0, i1 = r1 - s0;
    int64_t block = lo / block_size, in = lo % block_size;
    for (int64_t t = lo; t < hi; t++) { /* each token's K/V row */
        at[t - s0] = table[block] * block_stride + in * kv;
        if (++in == block_size) in = 0, block++;
    }
    for (int64_t i = i0; i < lo - s0; i++) at[i] = at[lo - s0]; /* stand-ins, scored -inf below */
    for (int64_t i = hi - s0; i < i1; i++) at[i] = at[lo - s0];
    /* Every K row of the item into L1 and every V row into L2 before the first is read: a segment's 16-token blocks
     * lie anywhere in the pool, where the hardware's prefetch stops at each block's end (batch 16 over 300 / 1,000
     * tokens 1.06x / 1.08x; V into L1 too, or K alone, were slower) */
    for (int64_t t = lo - s0; t < hi - s0; t++)
        for (int64_t j = 0; j < kv; j += half ? 32 : 16) _mm_prefetch(kv_address(keys, at[t] + j, half), _MM_HINT_T0);
    for (int64_t t = lo - s0; t < hi - s0; t++)
        for (int64_t j = 0; j < kv; j += half ? 32 : 16) _mm_prefetch(kv_address(values, at[t] + j, half), _MM_HINT_T1);
    for (int64_t i = i0; i < i1; i += 8)
        for (int g = 0; g < kv_heads; g++)
            for (int h = g * group; h < (g + 1) * group; h += SEG_HEADS)
                switch ((g + 1) * group - h < SEG_HEADS ? (g + 1) * group - h : SEG_HEADS) {
                    SCORES_CASE(1) SCORES_CASE(2) SCORES_CASE(3)
                }
    const __m512 sv = _mm512_set1_ps(scale);
    for (int h = 0; h < heads; h++) {
        float *s = sc + h * SEG;
        for (int64_t i = i0; i < lo - s0; i++) s[i] = -INFINITY;
        for (int64_t i = hi - s0; i < i1; i++) s[i] = -INFINITY;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t i = i0; i < i1; i += 16) {
            __mmask16 live = i + 16 <= i1 ? 0xffff : 0xff;
            __m512 x = _mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + i), sv);
            _mm512_mask_storeu_ps(s + i, live, x);
            mx = _mm512_max_ps(mx, x);
        }
        float m = _mm512_reduce_max_ps(mx);
        __m512 m16 = _mm512_set1_ps(m);
        for (int64_t i = i0; i < i1; i += 16) {
            __mmask16 live = i + 16 <= i1 ? 0xffff : 0xff;
            __m512 e = _mm512_maskz_mov_ps(live, exp_neg16(_mm512_sub_ps(_mm512_mask_loadu_ps(m16, live, s + i), m16)));
            _mm512_mask_storeu_ps(s + i, live, e);
            sum = _mm512_add_ps(sum, e);
        }
        ml[h] = m;
        ml[heads + h] = _mm512_reduce_add_ps(sum);
    }
    memset(o, 0, (size_t)(heads * d) * sizeof(float));
    for (int64_t a = lo - s0, b; a < hi - s0; a = b) {
        b = (a + SEG_RUN) & ~(int64_t)(SEG_RUN - 1);
        b = b < hi - s0 ? b : hi - s0;
        for (int g = 0; g < kv_heads; g++)
            for (int j = 0; j < d; j += 64) {
                int w = d - j < 64 ? (d - j) / 16 : 4;
                for (int h = g * group; h < (g + 1) * group; h += SEG_VHEADS)
                    switch ((g + 1) * group - h < SEG_VHEADS ? (g + 1) * group - h : SEG_VHEADS) {
                        VALUES_CASE(1) VALUES_CASE(2) VALUES_CASE(3) VALUES_CASE(4)
                    }
            }
    }
}

/* The AVX-512 path of tq_paged_attention (d a multiple of 16, at most 256); -1 without memory. */
int paged_attention_segments(const float *q, int64_t q_stride, const void *keys, const void *values,
                                    int64_t block_stride, const int64_t *tables, int64_t table_stride,
                                    const int64_t *row_table, const int64_t *lens, int64_t rows, int heads,
                                    int kv_heads, int d, int block_size, float scale, int64_t window, float *out,
                                    int half, int threads) {
    int64_t part = (int64_t)heads * (d + 2), total = 0;
    int64_t *start = (int64_t *)malloc((size_t)(rows + 1) * sizeof(int64_t)); /* a row's first item */
    if (!start) return -1;
    start[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t len = lens[r], first = window > 0 && len > window ? len - window : 0;
        start[r + 1] = start[r] + (len > 0 ? (len - 1) / SEG - first / SEG + 1 : 0);
        total += len;
        if (len <= 0) memset(out + r * heads * d, 0, (size_t)(heads * d) * sizeof(float));
    }
    int64_t items = start[rows];
    float *parts = (float *)malloc((size_t)(items * part + 1) * sizeof(float));
    int failed = !parts;
    #pragma omp parallel num_threads(threads) if (!failed && total * kv_heads > 256)
    {
        float *sc = failed ? NULL : (float *)malloc((size_t)heads * SEG * sizeof(float));
        if (!sc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (!sc) continue;
            int64_t lo_r = 0, hi_r = rows; /* the row whose items hold w */
            while (hi_r - lo_r > 1) {
                int64_t mid = (lo_r + hi_r) / 2;
                if (start[mid] <= w) lo_r = mid; else hi_r = mid;
            }
            int64_t r = lo_r, len = lens[r], first = window > 0 && len > window ? len - window : 0;
            int64_t s0 = (first / SEG + w - start[r]) * SEG, lo = s0 > first ? s0 : first;
            int64_t hi = s0 + SEG < len ? s0 + SEG : len;
            const float *qr = q + r * q_stride;
            const int64_t *table = tables + row_table[r] * table_stride;
            float *o = parts + w * part;
            if (half)
                attend_segment(1, qr, keys, values, block_stride, table, s0, lo, hi, heads, kv_heads, d, block_size,
                               scale, sc, o, o + heads * d);
            else
                attend_segment(0, qr, keys, values, block_stride, table, s0, lo, hi, heads, kv_heads, d, block_size,
                               scale, sc, o, o + heads * d);
        }
        free(sc);
        /* each row's segments added up in order, each scaled by e^(its max - the row's) */
        #pragma omp for schedule(static)
        for (int64_t x = 0; x < rows * heads; x++) {
            int64_t r = x / heads, h = x % heads, n = start[r + 1] - start[r];
            if (failed || n < 1) continue;
            const float *p0 = parts + start[r] * part;
            float m = -INFINITY, l = 0.f;
            for (int64_t s = 0; s < n; s++) m = p0[s * part + heads * d + h] > m ? p0[s * part + heads * d + h] : m;
            __m512 acc[256 / 16];
            for (int j = 0; j < d; j += 16) acc[j / 16] = _mm512_setzero_ps();
            for (int64_t s = 0; s < n; s++) {
                const float *p = p0 + s * part;
                float c = n == 1 ? 1.f : expf(p[heads * d + h] - m);
                l += p[heads * d + heads + h] * c;
                __m512 cv = _mm512_set1_ps(c);
                for (int j = 0; j < d; j += 16)
                    acc[j / 16] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(p + h * d + j), acc[j / 16]);
            }
            __m512 inv = _mm512_set1_ps(1.f / l);
            float *dst = out + r * heads * d + h * d;
            for (int j = 0; j < d; j += 16) _mm512_storeu_ps(dst + j, _mm512_mul_ps(acc[j / 16], inv));
        }
    }
    free(parts);
    free(start);
    return failed ? -1 : 0;
}
#endif
