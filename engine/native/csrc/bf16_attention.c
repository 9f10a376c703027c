#include "ops.h"

/* ---------------------------------------------------------------- long prompt chunks: attention in bfloat16
 * A prompt chunk over KERNELS.kernel_max_chunk tokens is GEMM-shaped attention: torch's float32 SDPA ran it at
 * about half this CPU's float32 peak, half of a 2,048-token prefill. Here, flash-attention style: q (times
 * scale / ln 2, so the softmax is a power of 2), k, v and the softmax weights rounded to bfloat16 (to nearest
 * even), products summed in float32 by vdpbf16ps. Each KV head's context is first packed into pair panels
 * (k: [block of FA_KEYS keys][d / 2][key][2], v: [block][key / 2][d][2]); then FA_ROWS query rows of one head
 * take FA_KEYS keys at a time: scores, the online softmax (running max and sum per row; the sum is of the
 * rounded weights the values are multiplied by), and the weighted values added to the rows' output. The
 * quality bench's perplexity moved x0.9995 with torch's bfloat16 SDPA in place of float32. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FA_KEYS 64
#define FA_ROWS 6
#define FA_MAX_D 256

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 2^x for x <= 0, 16 at a time: 2^n 2^f with |f| <= 1/2, 2^f a degree-4 polynomial (relative error 2.7e-6, a
 * thousandth of the bfloat16 rounding every weight then takes); below -126 (and -inf) exactly 0. */
static inline __m512 exp2_neg(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.56052e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591712e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024982e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312196e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999919f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* Keys [k0, k0 + FA_KEYS) of KV head g from the pool into its pair panels (zeros outside [first, context):
 * a sliding-window layer's blocks before `first` may be gone). Rows are rounded 32 floats at a time; k's pairs
 * go through a [key][d / 2] table in L1 and are transposed from there. */
static inline __m512 kv_load16(const void *row, int i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)))
                : _mm512_loadu_ps((const float *)row + i);
}

static void pack_kv_block(const void *keys, const void *values, int64_t block_stride, const int64_t *blocks,
                          int block_size, int kv_heads, int d, int g, int64_t k0, int64_t first, int64_t context,
                          int half, uint16_t *kp, uint16_t *vp) {
    static const float zeros[FA_MAX_D] = {0};
    uint32_t pairs[FA_KEYS * FA_MAX_D / 2];
    int64_t kv = (int64_t)kv_heads * d;
    int npairs = d / 2;
    for (int j = 0; j < FA_KEYS; j += 2) {
        const void *k[2], *v[2];
        for (int e = 0; e < 2; e++) {
            int64_t t = k0 + j + e;
            int64_t at = t >= first && t < context
                             ? blocks[t / block_size] * block_stride + (t % block_size) * kv + (int64_t)g * d : -1;
            k[e] = at < 0 ? (const void *)zeros : kv_address(keys, at, half); /* zeros: 0 in either format */
            v[e] = at < 0 ? (const void *)zeros : kv_address(values, at, half);
        }
        for (int i = 0; i < d; i += 32)
            for (int e = 0; e < 2; e++)
                _mm512_storeu_si512(pairs + (j + e) * npairs + i / 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(kv_load16(k[e], i + 16, half),
                                                                 kv_load16(k[e], i, half)));
        for (int i = 0; i < d; i += 16) /* v[j][i], v[j + 1][i] side by side */
            _mm512_storeu_si512(vp + ((int64_t)(j / 2) * d + i) * 2,
                                bf16_pairs(kv_load16(v[0], i, half), kv_load16(v[1], i, half)));
    }
    uint32_t *kp32 = (uint32_t *)kp;
    for (int i = 0; i < npairs; i++)
        for (int j = 0; j < FA_KEYS; j++) kp32[i * FA_KEYS + j] = pairs[j * npairs + i];
}

/* acc[r][c] += a[r] . b[c] for FA_ROWS rows: a[r] the bfloat16 pair at a + r * a_stride (broadcast), b the 4 x 32
 * bfloat16 (64 lanes of pairs) at b. */
static inline __attribute__((always_inline)) void pair_step(__m512 acc[FA_ROWS][4], const uint16_t *a,
                                                            int64_t a_stride, const uint16_t *b) {
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 32);
    __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 64), b3 = (__m512bh)_mm512_loadu_si512(b + 96);
    for (int r = 0; r < FA_ROWS; r++) {
        int32_t pair;
        memcpy(&pair, a + r * a_stride, 4);
        __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, b2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, b3);
    }
}

/* FA_ROWS query rows (positions pos[r]) of one head over one block of keys starting at k0: scores into s
 * [FA_ROWS][FA_KEYS] (log2 units; -inf where causality or the window hides a key). */
static inline void block_scores(const uint16_t *q16, int d, const uint16_t *kp, int64_t k0, const int64_t *pos,
                                int64_t window, float *s) {
    __m512 acc[FA_ROWS][4];
    for (int r = 0; r < FA_ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int i = 0; i < d / 2; i++) {
        const uint16_t *b = kp + (int64_t)i * FA_KEYS * 2;
        pair_step(acc, q16 + 2 * i, d, b);
    }
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < FA_ROWS; r++)
        for (int c = 0; c < 4; c++) {
            __m512i t = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(k0 + 16 * c)));
            __mmask16 seen = _mm512_cmple_epi32_mask(t, _mm512_set1_epi32((int)pos[r]));
            if (window > 0)
                seen &= _mm512_cmpgt_epi32_mask(t, _mm512_set1_epi32((int)(pos[r] - window)));
            _mm512_storeu_ps(s + r * FA_KEYS + 16 * c,
                             _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), acc[r][c]));
        }
}

/* o [FA_ROWS][d] += p16 [FA_ROWS][FA_KEYS] (bfloat16) times the block's values (pair panel vp), 64 columns of
 * o at a time in registers. */
static inline void block_values(const uint16_t *p16, const uint16_t *vp, int d, float *o) {
    for (int c0 = 0; c0 < d; c0 += 64) {
        __m512 acc[FA_ROWS][4];
        for (int r = 0; r < FA_ROWS; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_loadu_ps(o + r * d + c0 + 16 * c);
        for (int j = 0; j < FA_KEYS / 2; j++) {
            const uint16_t *b = vp + ((int64_t)j * d + c0) * 2;
            pair_step(acc, p16 + 2 * j, FA_KEYS, b);
        }
        for (int r = 0; r < FA_ROWS; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * d + c0 + 16 * c, acc[r][c]);
    }
}

/* One tile: FA_ROWS rows (`rows` of them real) of query head h, chunk rows r0.., over their visible keys. */
static void attention_tile(const float *q, int64_t q_stride, const uint16_t *kp, const uint16_t *vp, int d,
                           int h, int64_t r0, int rows, int64_t past, int64_t window, float qscale, float *out,
                           int64_t out_stride, uint16_t *q16, float *s, uint16_t *p16, float *o) {
    int64_t pos[FA_ROWS];
    float m[FA_ROWS];
    __m512 l[FA_ROWS]; /* each row's sum of weights, 16 lanes of it: added up once, at the end */
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80); /* bfloat16 1.0 */
    for (int r = 0; r < FA_ROWS; r++) {
        int64_t row = r0 + (r < rows ? r : rows - 1); /* padding rows repeat the last real one */
        pos[r] = past + row;
        const float *qr = q + row * q_stride + (int64_t)h * d;
        for (int i = 0; i < d; i++) q16[r * d + i] = to_bf16(qr[i] * qscale);
        m[r] = -INFINITY;
        l[r] = _mm512_setzero_ps();
    }
    memset(o, 0, (size_t)FA_ROWS * d * sizeof(float));
    int64_t lo = window > 0 && pos[0] - window + 1 > 0 ? pos[0] - window + 1 : 0;
    for (int64_t b = lo / FA_KEYS; b * FA_KEYS <= pos[FA_ROWS - 1]; b++) {
        int64_t k0 = b * FA_KEYS;
        block_scores(q16, d, kp + k0 * d, k0, pos, window, s);
        for (int r = 0; r < FA_ROWS; r++) {
            float *sr = s + r * FA_KEYS;
            __m512 mx = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(sr), _mm512_loadu_ps(sr + 16)),
                                      _mm512_max_ps(_mm512_loadu_ps(sr + 32), _mm512_loadu_ps(sr + 48)));
            float top = _mm512_reduce_max_ps(mx), mnew = top > m[r] ? top : m[r];
            float base = mnew == -INFINITY ? 0.0f : mnew; /* a row that saw no key yet: all weights 0 */
            /* the rescale of what came before (1 while the running max stands: exp2_neg(0) is 1 - 8e-7), by the
             * same polynomial, with no libm call between vector code */
            float alpha = m[r] == -INFINITY ? 0.0f
                          : mnew == m[r] ? 1.0f : _mm512_cvtss_f32(exp2_neg(_mm512_set1_ps(m[r] - base)));
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < 4; c += 2) {
                __m512 e0 = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), _mm512_set1_ps(base)));
                __m512 e1 = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c + 16), _mm512_set1_ps(base)));
                __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0); /* lanes 0-15: e0, 16-31: e1 */
                _mm512_storeu_si512(p16 + r * FA_KEYS + 16 * c, (__m512i)pb);
                /* the sum of what the values are weighted by: the rounded weights (times 1, exactly) */
                sum = _mm512_dpbf16_ps(sum, pb, ones);
            }
            l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha), sum);
            m[r] = mnew;
            if (alpha != 1.0f) {
                __m512 a = _mm512_set1_ps(alpha);
                for (int i = 0; i < d; i += 16)
                    _mm512_storeu_ps(o + r * d + i, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + i), a));
            }
        }
        block_values(p16, vp + k0 * d, d, o);
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / _mm512_reduce_add_ps(l[r]);
        float *dst = out + (r0 + r) * out_stride + (int64_t)h * d;
        for (int i = 0; i < d; i++) dst[i] = o[r * d + i] * inv;
    }
}
#endif

/* Causal attention of a prompt chunk's `length` rows (the last of a sequence's `context` tokens, whose K/V are
 * in the pool through `blocks`) in bfloat16, as above; q [length, q_stride] (query head h at column h * d),
 * out [length, out_stride]; window > 0: each row sees its last `window` tokens. -1 without memory, -2 where the
 * build has no AVX-512 BF16, -3 where d is not a multiple of 64 up to 256. */
int tq_bf16_attention(const float *q, int64_t q_stride, const void *keys, const void *values,
                      int64_t block_stride, const int64_t *blocks, int64_t length, int64_t context, int heads,
                      int kv_heads, int d, int block_size, float scale, int64_t window, float *out,
                      int64_t out_stride, int kv_half, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (d % 64 || d > FA_MAX_D)
        return -3;
    int group = heads / kv_heads;
    int64_t past = context - length, first = window > 0 && past - window + 1 > 0 ? past - window + 1 : 0;
    int64_t b0 = first / FA_KEYS, nb = (context + FA_KEYS - 1) / FA_KEYS, span = (int64_t)FA_KEYS * d;
    /* per KV head: its K and V pair panels of every block from b0 on (index from block 0, unused before b0) */
    uint16_t *panels = (uint16_t *)aligned_alloc(64, (size_t)(kv_heads * nb * span * 2) * sizeof(uint16_t));
    size_t per_thread = (size_t)FA_ROWS * (d * 2 + FA_KEYS * 4 + FA_KEYS * 2 + d * 4);
    per_thread = (per_thread + 63) / 64 * 64;
    char *scratch = (char *)aligned_alloc(64, per_thread * threads);
    if (!panels || !scratch) {
        free(panels);
        free(scratch);
        return -1;
    }
    int64_t tiles = (length + FA_ROWS - 1) / FA_ROWS;
    float qscale = scale * 1.44269504088896341f;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < kv_heads * (nb - b0); w++) {
            int g = (int)(w / (nb - b0));
            int64_t b = b0 + w % (nb - b0);
            uint16_t *kp = panels + (int64_t)g * nb * span * 2;
            pack_kv_block(keys, values, block_stride, blocks, block_size, kv_heads, d, g, b * FA_KEYS, first, context,
                          kv_half, kp + b * span, kp + nb * span + b * span);
        }
        int tid = thread_num();
        char *mine = scratch + per_thread * tid;
        uint16_t *q16 = (uint16_t *)mine;
        float *s = (float *)(mine + FA_ROWS * d * 2);
        uint16_t *p16 = (uint16_t *)(mine + FA_ROWS * (d * 2 + FA_KEYS * 4));
        float *o = (float *)(mine + FA_ROWS * (d * 2 + FA_KEYS * 4 + FA_KEYS * 2));
        /* the longest tiles (the chunk's last rows) first, the heads of one KV head side by side */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < (int64_t)heads * tiles; w++) {
            int hh = (int)(w % group), g = (int)(w / group % kv_heads);
            int64_t t = tiles - 1 - w / heads;
            int64_t r0 = t * FA_ROWS;
            int rows = length - r0 < FA_ROWS ? (int)(length - r0) : FA_ROWS;
            const uint16_t *kp = panels + (int64_t)g * nb * span * 2;
            attention_tile(q, q_stride, kp, kp + nb * span, d, g * group + hh, r0, rows, past, window, qscale, out,
                           out_stride, q16, s, p16, o);
        }
    }
    free(scratch);
    free(panels);
    return 0;
#else
    (void)q, (void)q_stride, (void)keys, (void)values, (void)block_stride, (void)blocks, (void)length,
        (void)context, (void)heads, (void)kv_heads, (void)d, (void)block_size, (void)scale, (void)window, (void)out,
        (void)out_stride, (void)kv_half, (void)threads;
    return -2;
#endif
}
