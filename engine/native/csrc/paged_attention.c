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
/* the sums of 8 vectors, as one: [sum y[0], ..., sum y[7]] (hadd, not 8 hsums) */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 y[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
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

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* ---------------------------------------------------------------- AVX-512: segments of a row's context
 * A work item is one row over one segment of its context: SEG tokens from a multiple of SEG, so a row's items depend
 * only on its length (never on the batch, the threads or how a prompt was chunked). The item reads its tokens' K
 * and V rows whole, in order (every KV head), 16 floats an instruction, a key or value once for all the query heads
 * that share it (GQA). It leaves each head's softmax max and sum with its unnormalized value sums; a row of more
 * than one segment adds them up in order afterwards (flash-decoding), so a long context runs on every thread. */
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
static int paged_attention_segments(const float *q, int64_t q_stride, const void *keys, const void *values,
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

/* Causal attention of query rows over the paged KV pool: row r (query heads `heads`, head h reading KV head
 * h / (heads / kv_heads)) attends to the first lens[r] tokens of the sequence whose block table is
 * tables[row_table[r] * table_stride ...] (token t in block table[t / block_size]); softmax(q . k * scale)
 * weights the v. A prefill chunk's rows and a decode row run the same code, so a token's result is the same
 * whether it was computed in a prompt or one at a time, in any batch. q and out: [rows, heads * d], q's rows
 * q_stride apart. The K/V of every row must already be in the pool (tq_rope_store). With window > 0 a row sees
 * only its last `window` tokens (a sliding-window layer): blocks before them are not read. An AVX-512 build takes
 * paged_attention_segments where d is a multiple of 16 (bench: 1.4-2x attend_row with K/V in cache; from DRAM,
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
