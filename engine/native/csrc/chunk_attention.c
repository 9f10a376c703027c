#include "ops.h"

/* ---------------------------------------------------------------- long prompt chunks: flash attention
 * A prompt chunk over KERNELS.kernel_max_chunk tokens is GEMM-shaped attention. torch's float32 SDPA ran it at
 * 70-85 GFLOP/s on two Ice Lake cores that do 400 (a fifth of the peak), and at half the peak on Zen 4: half of
 * a 2,048-token prefill. Here, flash-attention style, in float32 (`bf`: 0) or, where the build has AVX-512 BF16,
 * in bfloat16 (`bf`: 1: q (times scale / ln 2, so the softmax is a power of 2), k, v and the softmax weights
 * rounded to bfloat16 (to nearest even), products summed in float32 by vdpbf16ps). Each KV head's context is
 * first packed into panels of FA_KEYS keys (float32: k [d][key], v [key][d]; bfloat16 pairs: k [d / 2][key][2],
 * v [key / 2][d][2]); then FA_ROWS query rows of each query head sharing a KV head take FA_KEYS keys at a time
 * (the block meets every head while it is in L1): scores, the online softmax
 * (running max and sum per row; the sum is of the weights the values are multiplied by, rounded where they are),
 * and the weighted values added to the rows' output. A row's result does not depend on the chunk's other rows:
 * the keys past a row's position add exact zeros. The quality bench's perplexity moved x0.9995 with torch's
 * bfloat16 SDPA in place of float32. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FA_KEYS 64
#define FA_ROWS 6
#define FA_MAX_D 256
#ifdef __AVX512BF16__
#define FA_BF16 1
#else
#define FA_BF16 0
#endif

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* 2^x for x <= 0, 16 at a time: 2^n 2^f with |f| <= 1/2, 2^f a polynomial; below -126 (and -inf) exactly 0. In
 * float32 (`fine`) of degree 6, 2^f's Taylor series (relative error ~1e-7, as expf's: a degree-4 fit's 2.7e-6 moved
 * the quality bench's int8 perplexity); for bfloat16 weights of degree 4 (2.7e-6, a thousandth of the rounding
 * every weight then takes). */
static inline __m512 exp2_neg(__m512 x, const int fine) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n), p;
    if (fine) {
        p = _mm512_set1_ps(1.5403530e-4f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    } else {
        p = _mm512_set1_ps(9.56052e-3f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591712e-2f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024982e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312196e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999919f));
    }
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* Keys [k0, k0 + FA_KEYS) of KV head g from the pool into its panels (zeros outside [first, context): a
 * sliding-window layer's blocks before `first` may be gone). Rows are read 16 or 32 floats at a time; float32 k is
 * scattered into its columns, bfloat16 k's pairs go through a [key][d / 2] table in L1 (32 KB of stack at most) and
 * are transposed from there. */
static void pack_kv_block(const int bf, const void *keys, const void *values, int64_t block_stride,
                          const int64_t *blocks, int block_size, int kv_heads, int d, int g, int64_t k0, int64_t first,
                          int64_t context, int half, void *kp, void *vp) {
    static const float zeros[FA_MAX_D] = {0};
    uint32_t table[FA_KEYS * FA_MAX_D / 2]; /* bfloat16 pairs [key][d / 2] */
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(FA_KEYS));
    int64_t kv = (int64_t)kv_heads * d;
    int width = d / 2; /* 32-bit words of a bfloat16 key */
    for (int j = 0; j < FA_KEYS; j += 2) {
        const void *k[2], *v[2];
        for (int e = 0; e < 2; e++) {
            int64_t t = k0 + j + e;
            int64_t at = t >= first && t < context
                             ? blocks[t / block_size] * block_stride + (t % block_size) * kv + (int64_t)g * d : -1;
            k[e] = at < 0 ? (const void *)zeros : kv_address(keys, at, half); /* zeros: 0 in either format */
            v[e] = at < 0 ? (const void *)zeros : kv_address(values, at, half);
        }
        if (!bf) {
            for (int e = 0; e < 2; e++)
                for (int i = 0; i < d; i += 16) {
                    _mm512_i32scatter_ps((float *)kp + (int64_t)i * FA_KEYS + j + e, column, kv_load16(k[e], i, half), 4);
                    _mm512_storeu_ps((float *)vp + (int64_t)(j + e) * d + i, kv_load16(v[e], i, half));
                }
            continue;
        }
#if FA_BF16
        for (int i = 0; i < d; i += 32)
            for (int e = 0; e < 2; e++)
                _mm512_storeu_si512(table + (j + e) * width + i / 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(kv_load16(k[e], i + 16, half),
                                                                 kv_load16(k[e], i, half)));
        for (int i = 0; i < d; i += 16) /* v[j][i], v[j + 1][i] side by side */
            _mm512_storeu_si512((uint16_t *)vp + ((int64_t)(j / 2) * d + i) * 2,
                                bf16_pairs(kv_load16(v[0], i, half), kv_load16(v[1], i, half)));
#endif
    }
    uint32_t *kp32 = (uint32_t *)kp;
    for (int i = 0; bf && i < width; i++)
        for (int j = 0; j < FA_KEYS; j++) kp32[i * FA_KEYS + j] = table[j * width + i];
}

/* acc[r][c] += a[r] * b[c] for FA_ROWS rows: a[r] the float at a + r * a_stride, or with `bf` the bfloat16 pair
 * there (broadcast), b the 64 floats (4 x 16 lanes), or 64 lanes of bfloat16 pairs, at b. */
static inline __attribute__((always_inline)) void tile_step(const int bf, __m512 acc[FA_ROWS][4], const void *a,
                                                            int64_t a_stride, const void *b) {
    if (!bf) {
        const float *bf32 = (const float *)b, *af = (const float *)a;
        __m512 b0 = _mm512_loadu_ps(bf32), b1 = _mm512_loadu_ps(bf32 + 16);
        __m512 b2 = _mm512_loadu_ps(bf32 + 32), b3 = _mm512_loadu_ps(bf32 + 48);
        for (int r = 0; r < FA_ROWS; r++) {
            __m512 x = _mm512_set1_ps(af[r * a_stride]);
            acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(x, b3, acc[r][3]);
        }
        return;
    }
#if FA_BF16
    const uint16_t *b16 = (const uint16_t *)b, *a16 = (const uint16_t *)a;
    __m512bh b0 = (__m512bh)_mm512_loadu_si512(b16), b1 = (__m512bh)_mm512_loadu_si512(b16 + 32);
    __m512bh b2 = (__m512bh)_mm512_loadu_si512(b16 + 64), b3 = (__m512bh)_mm512_loadu_si512(b16 + 96);
    for (int r = 0; r < FA_ROWS; r++) {
        int32_t pair;
        memcpy(&pair, a16 + r * a_stride, 4);
        __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, b2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, b3);
    }
#endif
}

/* The bytes of one element of q, the weights and the panels: float32, or bfloat16. */
static inline int fa_bytes(const int bf) { return bf ? 2 : 4; }

/* FA_ROWS query rows (positions pos[r]) of one head over one block of keys starting at k0: scores into s
 * [FA_ROWS][FA_KEYS] (log2 units; -inf where causality or the window hides a key). A bfloat16 step takes a pair. */
static inline __attribute__((always_inline)) void block_scores(const int bf, const void *q, int d, const void *kp,
                                                               int64_t k0, const int64_t *pos, int64_t window,
                                                               float *s) {
    __m512 acc[FA_ROWS][4];
    for (int r = 0; r < FA_ROWS; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    int step = bf ? 2 : 1;
    for (int i = 0; i < d; i += step)
        tile_step(bf, acc, (const char *)q + i * fa_bytes(bf), d, (const char *)kp + (int64_t)i * FA_KEYS * fa_bytes(bf));
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

/* o [FA_ROWS][d] += p [FA_ROWS][FA_KEYS] times the block's values (panel vp), 64 columns of o at a time in
 * registers. */
static inline __attribute__((always_inline)) void block_values(const int bf, const void *p, const void *vp, int d,
                                                               float *o) {
    int step = bf ? 2 : 1;
    for (int c0 = 0; c0 < d; c0 += 64) {
        __m512 acc[FA_ROWS][4];
        for (int r = 0; r < FA_ROWS; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_loadu_ps(o + r * d + c0 + 16 * c);
        for (int j = 0; j < FA_KEYS; j += step)
            tile_step(bf, acc, (const char *)p + j * fa_bytes(bf), FA_KEYS,
                      (const char *)vp + ((int64_t)j * d + c0 * step) * fa_bytes(bf));
        for (int r = 0; r < FA_ROWS; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * d + c0 + 16 * c, acc[r][c]);
    }
}

/* Row r's weights 2^(s - base) of one block into p (float32, or rounded to bfloat16), and their sum. */
static inline __attribute__((always_inline)) __m512 block_weights(const int bf, const float *sr, float base,
                                                                  void *p) {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; c += 2) {
        __m512 e0 = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), _mm512_set1_ps(base)), !bf);
        __m512 e1 = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c + 16), _mm512_set1_ps(base)), !bf);
        if (!bf) {
            _mm512_storeu_ps((float *)p + 16 * c, e0);
            _mm512_storeu_ps((float *)p + 16 * c + 16, e1);
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            continue;
        }
#if FA_BF16
        __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0); /* lanes 0-15: e0, 16-31: e1 */
        _mm512_storeu_si512((uint16_t *)p + 16 * c, (__m512i)pb);
        /* the sum of what the values are weighted by: the rounded weights (times 1, exactly) */
        sum = _mm512_dpbf16_ps(sum, pb, (__m512bh)_mm512_set1_epi16(0x3f80));
#endif
    }
    return sum;
}

/* One tile: FA_ROWS rows (`rows` of them real), chunk rows r0.., of the `group` query heads from h0 that share a KV
 * head, over their visible keys: each block of the KV head's panels meets every head's rows while it is in L1 (a
 * head's rows compute what they would alone). Scratch: q [group][FA_ROWS][d], s [FA_ROWS][FA_KEYS] floats,
 * p [FA_ROWS][FA_KEYS], o [group][FA_ROWS][d] floats, m [group][FA_ROWS] floats, l [group][FA_ROWS] vectors. */
static inline __attribute__((always_inline)) void attention_tile(
    const int bf, const float *q, int64_t q_stride, const void *kp, const void *vp, int d, int h0, int group,
    int64_t r0, int rows, int64_t past, int64_t window, float qscale, float *out, int64_t out_stride, void *qb,
    float *s, void *p, float *o, float *m, __m512 *l) {
    int64_t pos[FA_ROWS];
    for (int r = 0; r < FA_ROWS; r++)
        pos[r] = past + r0 + (r < rows ? r : rows - 1); /* padding rows repeat the last real one */
    for (int x = 0; x < group * FA_ROWS; x++) {
        int r = x % FA_ROWS;
        const float *qr = q + (r0 + (r < rows ? r : rows - 1)) * q_stride + (int64_t)(h0 + x / FA_ROWS) * d;
        for (int i = 0; i < d; i += bf ? 1 : 16) {
            if (bf)
                ((uint16_t *)qb)[x * d + i] = to_bf16(qr[i] * qscale);
            else
                _mm512_storeu_ps((float *)qb + x * d + i, _mm512_mul_ps(_mm512_loadu_ps(qr + i), _mm512_set1_ps(qscale)));
        }
        m[x] = -INFINITY;
        l[x] = _mm512_setzero_ps(); /* each row's sum of weights, 16 lanes of it: added up once, at the end */
    }
    memset(o, 0, (size_t)group * FA_ROWS * d * sizeof(float));
    int64_t lo = window > 0 && pos[0] - window + 1 > 0 ? pos[0] - window + 1 : 0;
    for (int64_t b = lo / FA_KEYS; b * FA_KEYS <= pos[FA_ROWS - 1]; b++) {
        int64_t k0 = b * FA_KEYS;
        for (int hh = 0; hh < group; hh++) {
            float *oh = o + (int64_t)hh * FA_ROWS * d, *mh = m + hh * FA_ROWS;
            __m512 *lh = l + hh * FA_ROWS;
            block_scores(bf, (const char *)qb + (int64_t)hh * FA_ROWS * d * fa_bytes(bf), d,
                         (const char *)kp + k0 * d * fa_bytes(bf), k0, pos, window, s);
            /* each row's new max, then its weights and rescale: the rows' reductions side by side, not one row's
             * chain of latencies after another's */
            float top[FA_ROWS], alpha[FA_ROWS], base[FA_ROWS];
            for (int r = 0; r < FA_ROWS; r++) {
                const float *sr = s + r * FA_KEYS;
                top[r] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(sr), _mm512_loadu_ps(sr + 16)),
                                                            _mm512_max_ps(_mm512_loadu_ps(sr + 32), _mm512_loadu_ps(sr + 48))));
            }
            for (int r = 0; r < FA_ROWS; r++) {
                float mnew = top[r] > mh[r] ? top[r] : mh[r];
                base[r] = mnew == -INFINITY ? 0.0f : mnew; /* a row that saw no key yet: all weights 0 */
                /* the rescale of what came before (1 while the running max stands: the bfloat16 exp2_neg(0) is
                 * 1 - 8e-7), by the same polynomial, with no libm call between vector code */
                alpha[r] = mh[r] == -INFINITY ? 0.0f
                           : mnew == mh[r] ? 1.0f : _mm512_cvtss_f32(exp2_neg(_mm512_set1_ps(mh[r] - base[r]), !bf));
                mh[r] = mnew;
            }
            for (int r = 0; r < FA_ROWS; r++) {
                __m512 sum = block_weights(bf, s + r * FA_KEYS, base[r], (char *)p + r * FA_KEYS * fa_bytes(bf));
                lh[r] = _mm512_fmadd_ps(lh[r], _mm512_set1_ps(alpha[r]), sum);
                if (alpha[r] != 1.0f) {
                    __m512 a = _mm512_set1_ps(alpha[r]);
                    for (int i = 0; i < d; i += 16)
                        _mm512_storeu_ps(oh + r * d + i, _mm512_mul_ps(_mm512_loadu_ps(oh + r * d + i), a));
                }
            }
            block_values(bf, p, (const char *)vp + k0 * d * fa_bytes(bf), d, oh);
        }
    }
    for (int x = 0; x < group * FA_ROWS; x++) {
        int r = x % FA_ROWS;
        if (r >= rows) continue;
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[x]));
        float *dst = out + (r0 + r) * out_stride + (int64_t)(h0 + x / FA_ROWS) * d;
        for (int i = 0; i < d; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_loadu_ps(o + x * d + i), inv));
    }
}

typedef void (*Tile)(const float *, int64_t, const void *, const void *, int, int, int, int64_t, int, int64_t,
                     int64_t, float, float *, int64_t, void *, float *, void *, float *, float *, __m512 *);

static void float32_tile(const float *q, int64_t q_stride, const void *kp, const void *vp, int d, int h0, int group,
                         int64_t r0, int rows, int64_t past, int64_t window, float qscale, float *out,
                         int64_t out_stride, void *qb, float *s, void *p, float *o, float *m, __m512 *l) {
    attention_tile(0, q, q_stride, kp, vp, d, h0, group, r0, rows, past, window, qscale, out, out_stride, qb, s, p, o,
                   m, l);
}

#if FA_BF16
static void bfloat16_tile(const float *q, int64_t q_stride, const void *kp, const void *vp, int d, int h0, int group,
                          int64_t r0, int rows, int64_t past, int64_t window, float qscale, float *out,
                          int64_t out_stride, void *qb, float *s, void *p, float *o, float *m, __m512 *l) {
    attention_tile(1, q, q_stride, kp, vp, d, h0, group, r0, rows, past, window, qscale, out, out_stride, qb, s, p, o,
                   m, l);
}
#endif
#endif

/* 1 where tq_chunk_attention is compiled (AVX-512 F/BW), else 0. */
int tq_has_chunk_attention(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* Causal attention of a prompt chunk's `length` rows (the last of a sequence's `context` tokens, whose K/V are
 * in the pool through `blocks`) as above, in bfloat16 where `bf`, else float32; q [length, q_stride] (query head h
 * at column h * d), out [length, out_stride]; window > 0: each row sees its last `window` tokens. -1 without
 * memory, -2 where the build has no AVX-512 (or, for `bf`, no AVX-512 BF16), -3 where d is not a multiple of 64
 * up to 256. */
int tq_chunk_attention(const float *q, int64_t q_stride, const void *keys, const void *values,
                       int64_t block_stride, const int64_t *blocks, int64_t length, int64_t context, int heads,
                       int kv_heads, int d, int block_size, float scale, int64_t window, float *out,
                       int64_t out_stride, int kv_half, int bf, int threads) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (bf && !FA_BF16)
        return -2;
    if (d % 64 || d > FA_MAX_D)
        return -3;
    int group = heads / kv_heads, bytes = fa_bytes(bf);
    int64_t past = context - length, first = window > 0 && past - window + 1 > 0 ? past - window + 1 : 0;
    int64_t b0 = first / FA_KEYS, nb = (context + FA_KEYS - 1) / FA_KEYS, span = (int64_t)FA_KEYS * d * bytes;
    /* per KV head: its K and V panels of every block from b0 on (index from block 0, unused before b0) */
    char *panels = (char *)aligned_alloc(64, (size_t)(kv_heads * nb * span * 2));
    /* per thread: l [group][FA_ROWS] vectors, q and o [group][FA_ROWS][d], s and p [FA_ROWS][FA_KEYS], m */
    size_t per_thread = (size_t)group * FA_ROWS * (64 + d * 4 * 2 + 4) + (size_t)FA_ROWS * FA_KEYS * 8;
    per_thread = (per_thread + 63) / 64 * 64;
    char *scratch = (char *)aligned_alloc(64, per_thread * threads);
    if (!panels || !scratch) {
        free(panels);
        free(scratch);
        return -1;
    }
    Tile tile = float32_tile;
#if FA_BF16
    if (bf)
        tile = bfloat16_tile;
#endif
    int64_t tiles = (length + FA_ROWS - 1) / FA_ROWS;
    float qscale = scale * 1.44269504088896341f;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t w = 0; w < kv_heads * (nb - b0); w++) {
            int g = (int)(w / (nb - b0));
            int64_t b = b0 + w % (nb - b0);
            char *kp = panels + (int64_t)g * nb * span * 2;
            pack_kv_block(bf, keys, values, block_stride, blocks, block_size, kv_heads, d, g, b * FA_KEYS, first,
                          context, kv_half, kp + b * span, kp + nb * span + b * span);
        }
        int tid = thread_num();
        char *mine = scratch + per_thread * tid;
        __m512 *l = (__m512 *)mine;
        void *qb = mine + (size_t)group * FA_ROWS * 64;
        float *o = (float *)((char *)qb + (size_t)group * FA_ROWS * d * 4);
        float *s = o + (size_t)group * FA_ROWS * d, *m = s + FA_ROWS * FA_KEYS * 2;
        void *p = s + FA_ROWS * FA_KEYS;
        /* one KV head at a time (its panels stay in this core's L2), its longest tiles (the chunk's last rows)
         * first, the query heads that share it in one tile */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < (int64_t)kv_heads * tiles; w++) {
            int g = (int)(w / tiles);
            int64_t t = tiles - 1 - w % tiles;
            int64_t r0 = t * FA_ROWS;
            int rows = length - r0 < FA_ROWS ? (int)(length - r0) : FA_ROWS;
            const char *kp = panels + (int64_t)g * nb * span * 2;
            tile(q, q_stride, kp, kp + nb * span, d, g * group, group, r0, rows, past, window, qscale, out,
                 out_stride, qb, s, p, o, m, l);
        }
    }
    free(scratch);
    free(panels);
    return 0;
#else
    (void)q, (void)q_stride, (void)keys, (void)values, (void)block_stride, (void)blocks, (void)length,
        (void)context, (void)heads, (void)kv_heads, (void)d, (void)block_size, (void)scale, (void)window, (void)out,
        (void)out_stride, (void)kv_half, (void)bf, (void)threads;
    return -2;
#endif
}
