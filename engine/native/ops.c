/* A forward pass's work on the CPU, in C: the small per-layer operations (each one call instead of the 5-10
 * torch operations, and their dispatch of ~2-5 us each, it replaces), the int4/Q8_0 matmul kernels, and a
 * whole decoder layer as one call. Built and loaded by engine/native/__init__.py. float32 activations; every
 * output row depends only on its own input row and on which side of a matmul's PANEL_MIN_ROWS its batch is
 * (on the packed int8 panels, only on how many digits its caller asked for), so a token computes the same in
 * any batch of that side. Parallel over
 * rows, weight rows, sequences or sequence x KV head with OpenMP, on torch's own runtime. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifndef TQ_SOURCE_HASH
#define TQ_SOURCE_HASH "unknown"
#endif
/* What this library was built from (engine/native/build.py source_hash): the loader refuses a stale build. */
const char *tq_source_hash(void) { return TQ_SOURCE_HASH; }

/* The pool's K/V elements: float32, or float16 where `half` (half the bytes a decode step reads; rounded to
 * nearest even where written). Offsets are in elements. */
static inline float kv_at(const void *p, int64_t i, const int half) {
    return half ? (float)((const _Float16 *)p)[i] : ((const float *)p)[i];
}

static inline const char *kv_address(const void *p, int64_t i, const int half) {
    return (const char *)p + i * (half ? 2 : 4);
}

/* This thread's number in the enclosing OpenMP team (0 outside one, or without OpenMP). */
static inline int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------- work a thread may not finish
 * A matmul's items (weight tiles or panels) start as one contiguous range per thread: each streams its weights in
 * address order, which the hardware prefetcher follows (64 interleaved chunks per matmul ran 0.6x as fast). A
 * thread done with its range takes chunks from the back of another's. One the OS takes the core from (the gateway,
 * nats-server and the client share the cores with an aggregated worker; a prefill worker's second thread runs at
 * idle priority on the decode worker's core) then holds its matmul up by a chunk, not by the rest of its share. */
typedef struct {
    int64_t range; /* lo | hi << 32: the items not yet taken */
    char pad[56];  /* one cache line each */
} Share;

/* `blocks` sets of `threads` ranges (one set per block of rows), each splitting `items` evenly; NULL without memory */
static Share *shares_new(int64_t blocks, int threads, int64_t items) {
    Share *s = (Share *)aligned_alloc(64, (size_t)(blocks * threads) * sizeof(Share));
    if (s)
        for (int64_t i = 0; i < blocks * threads; i++) {
            int64_t t = i % threads;
            s[i].range = items * t / threads | (items * (t + 1) / threads) << 32;
        }
    return s;
}

/* The next chunk [*b, *e) for thread `tid` (up to `chunk` items): from the front of its own range, else from the back
 * of another's; 0 when every range is empty. Each item is taken once, by whichever thread gets there first. */
static int share_next(Share *s, int threads, int tid, int64_t chunk, int64_t *b, int64_t *e) {
    for (int i = 0; i < threads; i++) {
        Share *o = s + (tid + i) % threads;
        int64_t old = __atomic_load_n(&o->range, __ATOMIC_RELAXED);
        for (;;) {
            int64_t lo = old & 0xffffffff, hi = (int64_t)((uint64_t)old >> 32);
            if (lo >= hi) break;
            int64_t n = hi - lo < chunk ? hi - lo : chunk;
            int64_t next = i == 0 ? (lo + n) | hi << 32 : lo | (hi - n) << 32;
            if (__atomic_compare_exchange_n(&o->range, &old, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *b = i == 0 ? lo : hi - n;
                *e = *b + n;
                return 1;
            }
        }
    }
    return 0;
}

/* A thread's chunk: a sixteenth of its range, so a thief waits on at most that much of another's. */
static inline int64_t share_chunk(int64_t items, int threads) {
    int64_t c = items / ((int64_t)threads * 16);
    return c > 1 ? c : 1;
}

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, rows of n floats (x and out may alias); with a residual, x[i] +=
 * residual[i] first (in place: the residual stream's add and the next norm in one pass). */
void tq_rms_norm(float *x, const float *residual, const float *w, int64_t m, int64_t n, float eps, float *out,
                 int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        float *row = x + i * n;
        if (residual) {
            const float *add = residual + i * n;
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) row[j] += add[j];
        }
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; j++) ss += row[j] * row[j];
        float r = 1.f / sqrtf(ss / (float)n + eps);
        float *o = out + i * n;
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) o[j] = row[j] * r * w[j];
    }
}

/* Half-split RoPE on the q and k heads of each row of qkv ([m, width]: heads + kv_heads heads of d, then
 * kv_heads of v), in place; then k and v of row i are stored at slot (blocks[i], offsets[i]) of the pool's
 * key and value views (a block is `block_size` tokens of kv_heads * d floats; blocks are block_stride apart).
 * cos/sin: [positions, d] tables, sin with the sign of rotate_half folded in ([-sin, sin]). */
void tq_rope_store(float *qkv, int64_t m, int64_t width, const int64_t *positions, const float *cos_t,
                   const float *sin_t, int heads, int kv_heads, int d, void *keys, void *values,
                   int64_t block_stride, const int64_t *blocks, const int64_t *offsets, int kv_half, int threads) {
    int half = d / 2, rot = heads + kv_heads;
    int64_t kv = (int64_t)kv_heads * d;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        float *row = qkv + i * width;
        const float *c = cos_t + positions[i] * d, *s = sin_t + positions[i] * d;
        for (int h = 0; h < rot; h++) {
            float *x = row + (int64_t)h * d;
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = x[j], b = x[j + half];
                x[j] = a * c[j] + b * s[j];
                x[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
        int64_t slot = blocks[i] * block_stride + offsets[i] * kv;
        const float *k = row + (int64_t)heads * d, *v = row + (int64_t)rot * d;
        if (kv_half) {
            _Float16 *kd = (_Float16 *)keys + slot, *vd = (_Float16 *)values + slot;
            for (int64_t j = 0; j < kv; j++) {
                kd[j] = (_Float16)k[j];
                vd[j] = (_Float16)v[j];
            }
        } else {
            memcpy((float *)keys + slot, k, kv * sizeof(float));
            memcpy((float *)values + slot, v, kv * sizeof(float));
        }
    }
}

#ifdef __AVX2__
/* e^x for x <= 0 (scores minus their max), 8 at a time: 2^n e^r with |r| <= ln2 / 2, r's exponential a degree-6
 * polynomial (relative error ~2e-7, as expf's); below -87 it is 0. */
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

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
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
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

static inline float hmax8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
#define ATTN_VECTOR(d) ((d) % 8 == 0 && (d) <= 256)
#else
#define ATTN_VECTOR(d) 0
#endif

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
                float s = 0.f;
#ifdef __AVX2__
                if (ATTN_VECTOR(d)) {
                    s = dot_d(qh, keys, k, d, half);
                } else
#endif
                {
                    #pragma omp simd reduction(+ : s)
                    for (int j = 0; j < d; j++) s += qh[j] * kv_at(keys, k + j, half);
                }
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
 * only its last `window` tokens (a sliding-window layer): blocks before them are not read. */
void tq_paged_attention(const float *q, int64_t q_stride, const void *keys, const void *values,
                        int64_t block_stride, const int64_t *tables, int64_t table_stride, const int64_t *row_table,
                        const int64_t *lens, int64_t rows, int heads, int kv_heads, int d, int block_size,
                        float scale, int64_t window, float *out, int kv_half, int threads) {
    int group = heads / kv_heads;
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

/* out[i] = the index of the largest of row i's n floats: the first of equal ones, or the first NaN (as
 * torch.argmax). The greedy sampler's pick from the logits, which torch scans on one thread. */
void tq_argmax(const float *x, int64_t m, int64_t n, int64_t *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * n > 65536)
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * n;
        float best = -INFINITY;
        int nan = 0;
        int64_t j = 0;
#ifdef __AVX2__
        __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
            __m256 v = _mm256_loadu_ps(row + j);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        best = hmax8(mx);
#endif
        for (; j < n; j++) {
            if (row[j] != row[j]) nan = 1;
            else if (row[j] > best) best = row[j];
        }
        j = 0;
#ifdef __AVX2__
        if (!nan) {
            __m256 b = _mm256_set1_ps(best);
            for (; j + 8 <= n; j += 8) {
                int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), b, _CMP_EQ_OQ));
                if (hit) {
                    j += __builtin_ctz(hit);
                    break;
                }
            }
        }
#endif
        for (; j < n; j++)
            if (nan ? row[j] != row[j] : row[j] == best) break;
        out[i] = j;
    }
}

/* The MLP's gate: out[i, j] = silu(gu[i, j]) * gu[i, f + j] for rows of gu = [gate | up] (2 f floats). */
void tq_silu_mul(const float *gu, int64_t m, int64_t f, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        const float *g = gu + i * 2 * f, *u = g + f;
        float *o = out + i * f;
        int64_t j = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= f; j += 8) { /* sigmoid from e^-|g| <= 1: no overflow either way */
            __m256 x = _mm256_loadu_ps(g + j);
            __m256 e = exp_neg(_mm256_or_ps(x, sign));
            __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));
            __m256 sig = _mm256_blendv_ps(pos, _mm256_mul_ps(e, pos), x);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < f; j++) o[j] = g[j] / (1.f + expf(-g[j])) * u[j];
    }
}

/* ---------------------------------------------------------------- quantized weights, int16 activations
 * Two weight formats, both a GGUF's blocks as they are (groups of 32 along a row, float16 scales):
 *   Q8_0: int8 codes q [n, k] and a scale d per group ([n, k / 32]): w = d q.
 *   int4 (Q4_0/Q4_1): codes q in 0..15 with a scale d and an offset m per group, w = d q + m. Layout: qs
 *     [n, k / 2] bytes in pairs of groups (byte i of pair p holds element i of group 2p in its low nibble and
 *     of group 2p + 1 in its high one: one 32-byte load and two masks unpack 64 codes); dm [n, 2, groups]:
 *     the row's d's, then its m's.
 * Up to PANEL_MIN_ROWS rows (decode batches, where the weight bytes bound the time), activations are
 * quantized per group of 32 to int16 (x ~ xd xq), so a group's dot product is integer (vpmaddwd) and
 *   out[r, j] = sum_g d[j, g] xd[r, g] sum_i q xq  (+ sum_g m[j, g] xd[r, g] sum_i xq for int4).
 * Each output is computed by the same sequence of operations whatever the tile it is in, so a row's result
 * does not depend on the other rows of its batch. More rows take the float32 panels below. */
#define Q8_GROUP 32
#define TILE_R 4 /* activation rows per tile */
#define TILE_C 2 /* int4 weight rows per tile at batch 1 (more independent sums in flight: 1.13-1.16x) */
enum { KIND_Q8 = 8, KIND_Q4 = 4 };

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023, bits;
    if (e == 0) {
        if (f == 0) {
            bits = s;
        } else { /* subnormal: normalize */
            e = 113;
            while (!(f & 1024)) {
                f <<= 1;
                e--;
            }
            bits = s | (e << 23) | ((f & 1023) << 13);
        }
    } else if (e == 31) {
        bits = s | 0x7f800000u | (f << 13);
    } else {
        bits = s | ((e + 112) << 23) | (f << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A group's 32 codes (bytes, unsigned in 0..15 or signed) against its 32 int16 activations stored in
 * unpack order (`quantize_rows`): 8 int32 partial sums, as float. */
static inline __m256 dot_group(__m256i codes, __m256i high_bytes, const int16_t *y) {
    __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi8(codes, high_bytes), _mm256_loadu_si256((const __m256i *)y));
    __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi8(codes, high_bytes),
                                   _mm256_loadu_si256((const __m256i *)(y + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}
#endif

typedef struct {
    int16_t *q; /* [m, k], each group in unpack order (see quantize_rows) */
    float *d;  /* [m, groups] */
    float *s;  /* [m, groups]: d * sum(q) */
} QuantizedRows;

static QuantizedRows rows_at(QuantizedRows a, int64_t r, int64_t k) {
    QuantizedRows t = {a.q + r * k, a.d + r * (k / Q8_GROUP), a.s + r * (k / Q8_GROUP)};
    return t;
}

/* Element e of a group sits at slot UNPACK_SLOT(e) of its int16 codes: the order in which vpunpck{l,h}bw
 * widen a group's 32 weight bytes (slots 0-7: elements 0-7, 8-15: 16-23, 16-23: 8-15, 24-31: 24-31). */
#define UNPACK_SLOT(e) ((e) < 8 || (e) >= 24 ? (e) : (e) < 16 ? (e) + 8 : (e) - 8)

static void quantize_rows(const float *x, int64_t m, int64_t k, QuantizedRows a, int threads) {
    int64_t groups = k / Q8_GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k > 65536)
    for (int64_t rg = 0; rg < m * groups; rg++) {
        const float *v = x + rg * Q8_GROUP;
        int16_t *q = a.q + rg * Q8_GROUP;
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
               v3 = _mm256_loadu_ps(v + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        int sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
        /* packs interleaves 128-bit lanes: (0-3, 16-19 | 4-7, 20-23) -> (0-7 | 16-23) */
        _mm256_storeu_si256((__m256i *)q, _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i2), 0xD8));
        _mm256_storeu_si256((__m256i *)(q + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i1, i3), 0xD8));
#else
        float amax = 0.f;
        for (int i = 0; i < Q8_GROUP; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
        float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < Q8_GROUP; i++) {
            int c = (int)lrintf(v[i] * inv);
            q[UNPACK_SLOT(i)] = (int16_t)c;
            sum += c;
        }
#endif
        a.d[rg] = amax / 32767.f;
        a.s[rg] = a.d[rg] * (float)sum;
    }
}

/* Per-tile scalars: ds[(c R + r) groups + g] = d[j + c, g] xd[r, g], and (int4) off[c][r] = sum_g m xs. */
static inline __attribute__((always_inline)) void tile_scales(const uint16_t *d16, int64_t d_stride,
                                                              const uint16_t *m16, QuantizedRows a, int64_t groups,
                                                              const int R, const int C, float *ds,
                                                              float off[TILE_C][TILE_R]) {
    for (int c = 0; c < C; c++) {
        for (int r = 0; r < R; r++) {
            float *dsr = ds + (c * R + r) * groups, o = 0.f;
            const uint16_t *dc = d16 + c * d_stride, *mc = m16 ? m16 + c * d_stride : NULL;
            const float *xd = a.d + r * groups, *xs = a.s + r * groups;
            int64_t g = 0;
#ifdef __AVX2__
            __m256 ov = _mm256_setzero_ps();
            for (; g + 8 <= groups; g += 8) {
                __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dc + g)));
                _mm256_storeu_ps(dsr + g, _mm256_mul_ps(dv, _mm256_loadu_ps(xd + g)));
                if (mc)
                    ov = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mc + g))),
                                         _mm256_loadu_ps(xs + g), ov);
            }
            o = hsum8(ov);
#endif
            for (; g < groups; g++) {
                dsr[g] = half_to_float(dc[g]) * xd[g];
                if (mc) o += half_to_float(mc[g]) * xs[g];
            }
            off[c][r] = o;
        }
    }
}

/* One tile: R activation rows x C weight rows of `kind` (R, C, kind constants after inlining); writes
 * out[r * os + c]. ds: scratch for R C groups floats. */
static inline __attribute__((always_inline)) void tile(const int kind, const void *w, const uint16_t *scales,
                                                       int64_t k, QuantizedRows a, const int R, const int C,
                                                       float *ds, float *out, int64_t os) {
    int64_t groups = k / Q8_GROUP;
    float off[TILE_C][TILE_R];
    if (kind == KIND_Q4)
        tile_scales(scales, 2 * groups, scales + groups, a, groups, R, C, ds, off);
    else
        tile_scales(scales, groups, NULL, a, groups, R, C, ds, off);
#ifdef __AVX2__
    __m256 acc0[TILE_C][TILE_R], acc1[TILE_C][TILE_R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc0[c][r] = acc1[c][r] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; g += 2) { /* two groups: the int4 pair, or two Q8_0 groups */
        int two = g + 1 < groups; /* Q8_0 rows of an odd number of groups end with one */
        for (int c = 0; c < C; c++) {
            __m256i u0, u1, h0, h1; /* codes, and the high bytes that widen them to int16 */
            if (kind == KIND_Q4) {
                const __m256i low = _mm256_set1_epi8(0x0F);
                __m256i b = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + c * (k / 2) + g * 16));
                u0 = _mm256_and_si256(b, low);
                u1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
                h0 = h1 = zero;
            } else {
                const int8_t *q = (const int8_t *)w + c * k + g * Q8_GROUP;
                u0 = _mm256_loadu_si256((const __m256i *)q);
                u1 = two ? _mm256_loadu_si256((const __m256i *)(q + Q8_GROUP)) : zero;
                h0 = _mm256_cmpgt_epi8(zero, u0);
                h1 = _mm256_cmpgt_epi8(zero, u1);
            }
            for (int r = 0; r < R; r++) {
                const int16_t *y = a.q + r * k + g * Q8_GROUP;
                const float *dsr = ds + (c * R + r) * groups + g;
                acc0[c][r] = _mm256_fmadd_ps(dot_group(u0, h0, y), _mm256_broadcast_ss(dsr), acc0[c][r]);
                if (kind == KIND_Q4 || two)
                    acc1[c][r] = _mm256_fmadd_ps(dot_group(u1, h1, y + Q8_GROUP), _mm256_broadcast_ss(dsr + 1),
                                                 acc1[c][r]);
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) out[r * os + c] = hsum8(_mm256_add_ps(acc0[c][r], acc1[c][r])) + off[c][r];
#else
    for (int c = 0; c < C; c++) {
        for (int r = 0; r < R; r++) {
            const float *dsr = ds + (c * R + r) * groups;
            const int16_t *y = a.q + r * k;
            float acc = 0.f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int i = 0; i < Q8_GROUP; i++) {
                    int32_t code;
                    if (kind == KIND_Q4) {
                        uint8_t byte = ((const uint8_t *)w)[c * (k / 2) + (g / 2) * 32 + i];
                        code = g % 2 ? byte >> 4 : byte & 15;
                    } else {
                        code = ((const int8_t *)w)[c * k + g * Q8_GROUP + i];
                    }
                    dot += code * y[g * Q8_GROUP + UNPACK_SLOT(i)];
                }
                acc += (float)dot * dsr[g];
            }
            out[r * os + c] = acc + off[c][r];
        }
    }
#endif
}

typedef struct {
    const void *w;
    const uint16_t *scales;
    int64_t n, k, m;
    QuantizedRows a;
    float *out;
    Share *shares; /* per block of rows (tile_rows), `threads` ranges of tiles */
    int threads;
} Matmul;

/* Rows a block of share_tiles holds (their int16 codes stay in L1), and weight rows a tile holds. */
static int64_t tile_rows(int64_t k) {
    int64_t rblock = (8192 / k) / TILE_R * TILE_R;
    return rblock < TILE_R ? TILE_R : rblock;
}
static int tile_cols(int kind, int64_t m, int64_t k) {
    return m == 1 && k < 1024 && kind == KIND_Q4 ? TILE_C : 1; /* Q8_0 rows: 1 x 2 ran 0.55-0.6x of 1 x 1 */
}

/* This thread's tiles, taken with share_next from mm.shares (call it inside a parallel region). Batch 1 runs
 * int4 tiles of 1 x TILE_C where rows are short (k < 1024); larger batches and Q8_0 tiles of TILE_R x 1, in blocks of rows
 * whose int16 codes stay in L1. `kind` must be a constant here: a parallel region's body is outlined, and
 * its captured variables are not. */
static inline __attribute__((always_inline)) void share_tiles(const int kind, Matmul mm, float *ds) {
    int64_t n = mm.n, k = mm.k, m = mm.m, groups = k / Q8_GROUP;
    int64_t row_bytes = kind == KIND_Q4 ? k / 2 : k, scale_stride = kind == KIND_Q4 ? 2 * groups : groups;
    int64_t rblock = tile_rows(k);
    int cols = tile_cols(kind, m, k), tid = thread_num();
    int64_t tiles = (n + cols - 1) / cols, chunk = share_chunk(tiles, mm.threads);
    for (int64_t r0 = 0; r0 < m; r0 += rblock) {
        int64_t r1 = r0 + rblock < m ? r0 + rblock : m;
        Share *sh = mm.shares + r0 / rblock * mm.threads;
        for (int64_t b, e; share_next(sh, mm.threads, tid, chunk, &b, &e);)
        for (int64_t jb = b; jb < e; jb++) {
            int64_t j = jb * cols;
            const void *wj = (const uint8_t *)mm.w + j * row_bytes;
            const uint16_t *sj = mm.scales + j * scale_stride;
            if (cols == TILE_C) {
                if (j + TILE_C <= n)
                    tile(kind, wj, sj, k, mm.a, 1, TILE_C, ds, mm.out + j, n);
                else /* an odd row count's last row */
                    tile(kind, wj, sj, k, mm.a, 1, 1, ds, mm.out + j, n);
                continue;
            }
            int64_t r = r0;
            for (; r + TILE_R <= r1; r += TILE_R)
                tile(kind, wj, sj, k, rows_at(mm.a, r, k), TILE_R, 1, ds, mm.out + r * n + j, n);
            QuantizedRows t = rows_at(mm.a, r, k);
            switch (r1 - r) {
            case 1: tile(kind, wj, sj, k, t, 1, 1, ds, mm.out + r * n + j, n); break;
            case 2: tile(kind, wj, sj, k, t, 2, 1, ds, mm.out + r * n + j, n); break;
            case 3: tile(kind, wj, sj, k, t, 3, 1, ds, mm.out + r * n + j, n); break;
            default: break;
            }
        }
    }
}

static void share_tiles_q4(Matmul mm, float *ds) { share_tiles(KIND_Q4, mm, ds); }
static void share_tiles_q8(Matmul mm, float *ds) { share_tiles(KIND_Q8, mm, ds); }

/* ---------------------------------------------------------------- many rows: float32 panels
 * With many rows a matmul is compute-bound, and there the int16 kernel above is no faster than float32: its
 * two vpmaddwd, convert and FMA per row and group of 32 take the same two vector pipes as four float32 FMAs.
 * So from PANEL_MIN_ROWS rows on, each panel of PANEL weight rows is dequantized once (w = d q + m, as
 * tq_int4_dequant) into float32 [k][PANEL] in this thread's scratch, and multiplied by PANEL_R x PANEL
 * register tiles of FMAs (an activation broadcast against two vectors of the panel). An output's sum runs
 * over k in the same order in every tile: a row computes the same in any batch of PANEL_MIN_ROWS rows or
 * more, as it does in any batch of fewer. The crossovers were measured on a 2-core AMD EPYC (AVX2): int4
 * from 16 rows; Q8_0, whose int16 kernel has no nibbles to unpack, from 32. */
#define PANEL_MIN_ROWS(kind) ((kind) == KIND_Q4 ? 16 : 32)
#define PANEL 16
#define PANEL_R 6

#ifdef __AVX2__
/* In: r[c] = 32 bytes of weight row c. Out: r[i] = byte i of the 16 rows in its low 128 bits, byte 16 + i in
 * its high 128 bits (four rounds of interleaving rows c and c + 8 transpose 16 x 16 bytes, in each half). */
static inline void transpose_bytes(__m256i r[PANEL]) {
    for (int round = 0; round < 4; round++) {
        __m256i t[PANEL];
        for (int c = 0; c < PANEL / 2; c++) {
            t[2 * c] = _mm256_unpacklo_epi8(r[c], r[c + PANEL / 2]);
            t[2 * c + 1] = _mm256_unpackhi_epi8(r[c], r[c + PANEL / 2]);
        }
        for (int c = 0; c < PANEL; c++) r[c] = t[c];
    }
}

/* 16 codes (one per panel row, unsigned int4 or signed int8) of one k as floats d q + m into panel row o. */
static inline __attribute__((always_inline)) void panel_codes(const int kind, __m128i b, const float *d,
                                                              const float *m, float *o) {
    for (int h = 0; h < 2; h++) {
        __m128i part = h ? _mm_srli_si128(b, 8) : b;
        __m256 q = _mm256_cvtepi32_ps(kind == KIND_Q4 ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part));
        _mm256_storeu_ps(o + 8 * h, kind == KIND_Q4 ? _mm256_fmadd_ps(q, _mm256_loadu_ps(d + 8 * h),
                                                                      _mm256_loadu_ps(m + 8 * h))
                                                    : _mm256_mul_ps(q, _mm256_loadu_ps(d + 8 * h)));
    }
}

/* The 32-byte runs at group g of weight rows [j, j + PANEL) (an int4 group pair, or a Q8_0 group; zeros past n),
 * transposed as bytes, and their groups' scales d and (int4) offsets m as floats, one per row. */
static inline __attribute__((always_inline)) void load_runs(const int kind, const void *w, const uint16_t *scales,
                                                            int64_t n, int64_t k, int64_t j, int64_t g,
                                                            __m256i r[PANEL], float d[2][PANEL], float m[2][PANEL]) {
    int64_t groups = k / Q8_GROUP, row_bytes = kind == KIND_Q4 ? k / 2 : k;
    int64_t scale_stride = kind == KIND_Q4 ? 2 * groups : groups;
    int step = kind == KIND_Q4 ? 2 : 1; /* groups per 32-byte run */
    for (int c = 0; c < PANEL; c++) {
        int live = j + c < n;
        const uint8_t *run = (const uint8_t *)w + (j + c) * row_bytes + g * Q8_GROUP / step;
        r[c] = live ? _mm256_loadu_si256((const __m256i *)run) : _mm256_setzero_si256();
        const uint16_t *sc = scales + (j + c) * scale_stride;
        for (int s = 0; s < step; s++) {
            d[s][c] = live ? half_to_float(sc[g + s]) : 0.f;
            m[s][c] = live && kind == KIND_Q4 ? half_to_float(sc[groups + g + s]) : 0.f;
        }
    }
    transpose_bytes(r);
}

/* Weight rows [j, j + PANEL) (zeros past n) as panel[i * PANEL + c] = w[j + c, i]: each 32-byte run of the
 * 16 rows (an int4 group pair, or a Q8_0 group) transposed as bytes, then widened to floats 16 at a time. */
static inline __attribute__((always_inline)) void dequant_panel(const int kind, const void *w,
                                                                const uint16_t *scales, int64_t n, int64_t k,
                                                                int64_t j, float *panel) {
    int64_t groups = k / Q8_GROUP;
    for (int64_t g = 0; g < groups; g += kind == KIND_Q4 ? 2 : 1) {
        __m256i r[PANEL];
        float d[2][PANEL], m[2][PANEL];
        load_runs(kind, w, scales, n, k, j, g, r, d, m);
        for (int i = 0; i < 16; i++) {
            __m128i lo = _mm256_castsi256_si128(r[i]), hi = _mm256_extracti128_si256(r[i], 1);
            float *o = panel + (g * Q8_GROUP + i) * PANEL;
            if (kind == KIND_Q4) {
                const __m128i low = _mm_set1_epi8(0x0F);
                panel_codes(kind, _mm_and_si128(lo, low), d[0], m[0], o);
                panel_codes(kind, _mm_and_si128(hi, low), d[0], m[0], o + 16 * PANEL);
                panel_codes(kind, _mm_and_si128(_mm_srli_epi16(lo, 4), low), d[1], m[1], o + 32 * PANEL);
                panel_codes(kind, _mm_and_si128(_mm_srli_epi16(hi, 4), low), d[1], m[1], o + 48 * PANEL);
            } else {
                panel_codes(kind, lo, d[0], m[0], o);
                panel_codes(kind, hi, d[0], m[0], o + 16 * PANEL);
            }
        }
    }
}

/* out[r * os + c] = sum_i x[r * k + i] panel[i * PANEL + c] for R rows and the first `cols` columns. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t k, const float *panel,
                                                             const int R, int cols, float *out, int64_t os) {
    __m256 lo[PANEL_R], hi[PANEL_R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 b0 = _mm256_loadu_ps(panel + i * PANEL), b1 = _mm256_loadu_ps(panel + i * PANEL + 8);
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_broadcast_ss(x + r * k + i);
            lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
            hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (cols == PANEL) {
            _mm256_storeu_ps(out + r * os, lo[r]);
            _mm256_storeu_ps(out + r * os + 8, hi[r]);
        } else {
            float t[PANEL];
            _mm256_storeu_ps(t, lo[r]);
            _mm256_storeu_ps(t + 8, hi[r]);
            memcpy(out + r * os, t, (size_t)cols * sizeof(float));
        }
    }
}

/* Rows a block of share_panels holds (their activations stay in L2). */
static inline int64_t panel_rows(int64_t k) {
    int64_t rblock = (65536 / k) / PANEL_R * PANEL_R;
    return rblock < PANEL_R ? PANEL_R : rblock;
}

/* This thread's panels, taken with share_next from `shares` (one set per block of panel_rows); `kind` a
 * constant, as in share_tiles. panel: this thread's PANEL k floats. */
static inline __attribute__((always_inline)) void share_panels(const int kind, const void *w,
                                                               const uint16_t *scales, int64_t n, int64_t k,
                                                               const float *x, int64_t m, float *out,
                                                               float *panel, Share *shares, int threads) {
    int64_t rblock = panel_rows(k), panels = (n + PANEL - 1) / PANEL, chunk = share_chunk(panels, threads);
    int tid = thread_num();
    for (int64_t r0 = 0; r0 < m; r0 += rblock) {
        int64_t r1 = r0 + rblock < m ? r0 + rblock : m;
        Share *sh = shares + r0 / rblock * threads;
        for (int64_t b, e; share_next(sh, threads, tid, chunk, &b, &e);)
        for (int64_t j = b * PANEL; j < e * PANEL && j < n; j += PANEL) {
            int cols = n - j < PANEL ? (int)(n - j) : PANEL;
            dequant_panel(kind, w, scales, n, k, j, panel);
            int64_t r = r0;
            for (; r + PANEL_R <= r1; r += PANEL_R) panel_tile(x + r * k, k, panel, PANEL_R, cols, out + r * n + j, n);
            const float *xr = x + r * k;
            float *o = out + r * n + j;
            switch (r1 - r) {
            case 1: panel_tile(xr, k, panel, 1, cols, o, n); break;
            case 2: panel_tile(xr, k, panel, 2, cols, o, n); break;
            case 3: panel_tile(xr, k, panel, 3, cols, o, n); break;
            case 4: panel_tile(xr, k, panel, 4, cols, o, n); break;
            case 5: panel_tile(xr, k, panel, 5, cols, o, n); break;
            default: break;
            }
        }
    }
}

static void share_panels_q4(const void *w, const uint16_t *s, int64_t n, int64_t k, const float *x, int64_t m,
                            float *out, float *panel, Share *shares, int threads) {
    share_panels(KIND_Q4, w, s, n, k, x, m, out, panel, shares, threads);
}
static void share_panels_q8(const void *w, const uint16_t *s, int64_t n, int64_t k, const float *x, int64_t m,
                            float *out, float *panel, Share *shares, int threads) {
    share_panels(KIND_Q8, w, s, n, k, x, m, out, panel, shares, threads);
}

static int panel_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                        int64_t m, float *out, int threads) {
    int64_t per_thread = PANEL * k; /* floats; a multiple of 16, so each thread's panel starts a cache line */
    float *scratch = (float *)aligned_alloc(64, (size_t)(threads * per_thread) * sizeof(float));
    Share *shares = shares_new((m + panel_rows(k) - 1) / panel_rows(k), threads, (n + PANEL - 1) / PANEL);
    if (!scratch || !shares) {
        free(scratch);
        free(shares);
        return -1;
    }
    #pragma omp parallel num_threads(threads)
    {
        int tid = thread_num();
        if (kind == KIND_Q4)
            share_panels_q4(w, scales, n, k, x, m, out, scratch + tid * per_thread, shares, threads);
        else
            share_panels_q8(w, scales, n, k, x, m, out, scratch + tid * per_thread, shares, threads);
    }
    free(shares);
    free(scratch);
    return 0;
}
#endif

/* ---------------------------------------------------------------- many rows: bfloat16 panels
 * Where the CPU has AVX-512 BF16, vdpbf16ps does 32 multiply-adds where a float32 FMA does 16 (measured on a
 * 2-core AMD EPYC: torch's bf16 GEMM 2.3x its float32 one). The activations are rounded to bfloat16 once per
 * matmul, each panel of BF_PANEL weight rows is widened to the floats of the float32 panels above and rounded
 * straight to bfloat16 pairs bp[(i * BF_PANEL + c) * 2 + e] = w[j + c, 2 i + e], and BF_R x BF_PANEL tiles
 * (fewer rows at a chunk's end) accumulate in float32. Both
 * roundings are to nearest even (2^-9 relative); the sums run over k in one order in every tile, so a row's
 * result does not depend on the other rows. Only long prompt chunks take it (engine/quant.py): there the
 * perplexity moved x1.0005, where every matmul of 16 rows or more on it (decode batches, short prompts)
 * changed 2 of the quality bench's 20 greedy answers. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF_PANEL 32
#define BF_R 12

/* 16 columns' values at an even k and at the next odd one as 16 bfloat16 pairs (column c: even, odd at 2c, 2c + 1),
 * rounded to nearest even: cvtne2ps_pbh holds the evens in lanes 0-15 and the odds in 16-31, interleaved here. */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

/* 16 codes (one per panel column, unsigned int4 or signed int8) as floats d q + m: the float32 panels' values. */
static inline __attribute__((always_inline)) __m512 codes16(const int kind, __m128i b, __m512 d, __m512 m) {
    __m512 q = _mm512_cvtepi32_ps(kind == KIND_Q4 ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
    return kind == KIND_Q4 ? _mm512_fmadd_ps(q, d, m) : _mm512_mul_ps(q, d);
}

/* Weight rows [j, j + BF_PANEL) (zeros past n) as the bfloat16 pair panel bp[(i * BF_PANEL + c) * 2 + e] =
 * w[j + c, 2 i + e]: each 16-row half's 32-byte runs transposed as bytes (as dequant_panel), two neighbouring k
 * widened to the same floats as the float32 panels hold and rounded to bfloat16 pairs, with no float32 panel
 * written and read back between. */
static inline __attribute__((always_inline)) void dequant_bf16_panel(const int kind, const void *w,
                                                                     const uint16_t *scales, int64_t n, int64_t k,
                                                                     int64_t j, uint16_t *bp) {
    const __m128i low = _mm_set1_epi8(0x0F);
    int64_t groups = k / Q8_GROUP;
    for (int h = 0; h < 2; h++) {
        for (int64_t g = 0; g < groups; g += kind == KIND_Q4 ? 2 : 1) {
            __m256i r[PANEL];
            float d[2][PANEL], m[2][PANEL];
            load_runs(kind, w, scales, n, k, j + h * PANEL, g, r, d, m);
            __m512 d0 = _mm512_loadu_ps(d[0]), m0 = _mm512_loadu_ps(m[0]);
            __m512 d1 = _mm512_loadu_ps(d[1]), m1 = _mm512_loadu_ps(m[1]);
            for (int i = 0; i < 16; i += 2) { /* elements i, i + 1 of the run: one pair of k */
                __m128i lo[2] = {_mm256_castsi256_si128(r[i]), _mm256_castsi256_si128(r[i + 1])};
                __m128i hi[2] = {_mm256_extracti128_si256(r[i], 1), _mm256_extracti128_si256(r[i + 1], 1)};
                __m512 f[4][2]; /* [which k of the run][even, odd] */
                int parts = kind == KIND_Q4 ? 4 : 2;
                for (int e = 0; e < 2; e++) {
                    if (kind == KIND_Q4) {
                        f[0][e] = codes16(kind, _mm_and_si128(lo[e], low), d0, m0);
                        f[1][e] = codes16(kind, _mm_and_si128(hi[e], low), d0, m0);
                        f[2][e] = codes16(kind, _mm_and_si128(_mm_srli_epi16(lo[e], 4), low), d1, m1);
                        f[3][e] = codes16(kind, _mm_and_si128(_mm_srli_epi16(hi[e], 4), low), d1, m1);
                    } else {
                        f[0][e] = codes16(kind, lo[e], d0, m0);
                        f[1][e] = codes16(kind, hi[e], d0, m0);
                    }
                }
                for (int p = 0; p < parts; p++) {
                    int64_t at = g * Q8_GROUP + 16 * p + i; /* the even k */
                    _mm512_storeu_si512(bp + ((at / 2) * BF_PANEL + 16 * h) * 2, bf16_pairs(f[p][0], f[p][1]));
                }
            }
        }
    }
}

/* out[r * os + c] = sum_i x16[r, i] w[c, i] for R <= BF_R rows (x16 bfloat16 [R, k]) and 32 columns. A row's
 * sums are the same operations whatever R is. */
static inline __attribute__((always_inline)) void bf16_tile(const int R, const uint16_t *x16, int64_t k,
                                                            const uint16_t *bp, float *out, int64_t os) {
    __m512 lo[BF_R], hi[BF_R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k / 2; i++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + i * 2 * BF_PANEL);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + i * 2 * BF_PANEL + BF_PANEL);
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, x16 + r * k + 2 * i, 4);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
            hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * os, lo[r]);
        _mm512_storeu_ps(out + r * os + 16, hi[r]);
    }
}

/* bf16_tile for any 1 <= rows <= BF_R, each height compiled on its own: a prompt of 256 rows is 21 tiles of 12 and
 * one of 4, not 22 of 12 (padding rows cost 6% of the matmul there). */
static void bf16_tile_rows(int rows, const uint16_t *x16, int64_t k, const uint16_t *bp, float *out, int64_t os) {
    switch (rows) {
#define BF_TILE(R) case R: bf16_tile(R, x16, k, bp, out, os); return;
    BF_TILE(1) BF_TILE(2) BF_TILE(3) BF_TILE(4) BF_TILE(5) BF_TILE(6)
    BF_TILE(7) BF_TILE(8) BF_TILE(9) BF_TILE(10) BF_TILE(11)
#undef BF_TILE
    default: bf16_tile(BF_R, x16, k, bp, out, os);
    }
}

/* float32 rows [m, k] to bfloat16 (round to nearest even). */
static void rows_to_bf16(const float *x, int64_t m, int64_t k, uint16_t *x16, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k > 65536)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i += 32) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * k + i + 16), _mm512_loadu_ps(x + r * k + i));
            _mm512_storeu_si512(x16 + r * k + i, (__m512i)v);
        }
    }
}

/* A tile of `rows` rows from row r of a panel of `width` columns at column j: where it writes (out itself, or the
 * spill tile where the panel runs past n, `cols` < width), and `unspill` copies those columns out afterwards. */
static inline float *tile_out(float *out, int64_t n, int64_t r, int64_t j, int cols, int width, float *spill) {
    return cols == width ? out + r * n + j : spill;
}

static inline void unspill(float *out, int64_t n, int64_t r, int64_t j, int rows, int cols, int width,
                           const float *spill) {
    if (cols < width)
        for (int t = 0; t < rows; t++) memcpy(out + (r + t) * n + j, spill + t * width, (size_t)cols * sizeof(float));
}

static inline __attribute__((always_inline)) void share_bf16_panels(const int kind, const void *w,
                                                                    const uint16_t *scales, int64_t n, int64_t k,
                                                                    const uint16_t *x16, int64_t m, float *out,
                                                                    uint16_t *bp, float *spill, Share *shares,
                                                                    int threads) {
    /* each panel is dequantized once and meets every row (rows in blocks that stayed in L2 dequantized it once a
     * block: 0.83-0.88x at 256 rows, measured on the model's four shapes) */
    int64_t chunk = share_chunk((n + BF_PANEL - 1) / BF_PANEL, threads);
    int tid = thread_num();
    for (int64_t b, e; share_next(shares, threads, tid, chunk, &b, &e);)
    for (int64_t j = b * BF_PANEL; j < e * BF_PANEL && j < n; j += BF_PANEL) {
        int cols = n - j < BF_PANEL ? (int)(n - j) : BF_PANEL;
        dequant_bf16_panel(kind, w, scales, n, k, j, bp);
        for (int64_t r = 0; r < m; r += BF_R) {
            int rows = m - r < BF_R ? (int)(m - r) : BF_R;
            float *o = tile_out(out, n, r, j, cols, BF_PANEL, spill);
            int64_t os = cols == BF_PANEL ? n : BF_PANEL;
            if (rows == BF_R)
                bf16_tile(BF_R, x16 + r * k, k, bp, o, os);
            else
                bf16_tile_rows(rows, x16 + r * k, k, bp, o, os);
            unspill(out, n, r, j, rows, cols, BF_PANEL, spill);
        }
    }
}

static void share_bf16_panels_q4(const void *w, const uint16_t *s, int64_t n, int64_t k, const uint16_t *x16,
                                 int64_t m, float *out, uint16_t *bp, float *spill, Share *shares, int threads) {
    share_bf16_panels(KIND_Q4, w, s, n, k, x16, m, out, bp, spill, shares, threads);
}
static void share_bf16_panels_q8(const void *w, const uint16_t *s, int64_t n, int64_t k, const uint16_t *x16,
                                 int64_t m, float *out, uint16_t *bp, float *spill, Share *shares, int threads) {
    share_bf16_panels(KIND_Q8, w, s, n, k, x16, m, out, bp, spill, shares, threads);
}

static int bf16_panel_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                             int64_t m, float *out, int threads) {
    /* per thread: a bfloat16 pair panel, a spill tile (both multiples of 64 bytes) */
    int64_t per_thread = BF_PANEL * k * 2 + BF_R * BF_PANEL * 4;
    uint16_t *x16 = (uint16_t *)aligned_alloc(64, (size_t)(m * k) * sizeof(uint16_t));
    char *scratch = (char *)aligned_alloc(64, (size_t)(threads * per_thread));
    Share *shares = shares_new(1, threads, (n + BF_PANEL - 1) / BF_PANEL);
    if (!x16 || !scratch || !shares) {
        free(x16);
        free(scratch);
        free(shares);
        return -1;
    }
    rows_to_bf16(x, m, k, x16, threads);
    #pragma omp parallel num_threads(threads)
    {
        int tid = thread_num();
        char *mine = scratch + tid * per_thread;
        uint16_t *bp = (uint16_t *)mine;
        float *spill = (float *)(mine + BF_PANEL * k * 2);
        if (kind == KIND_Q4)
            share_bf16_panels_q4(w, scales, n, k, x16, m, out, bp, spill, shares, threads);
        else
            share_bf16_panels_q8(w, scales, n, k, x16, m, out, bp, spill, shares, threads);
    }
    free(shares);
    free(scratch);
    free(x16);
    return 0;
}
#endif

/* 1 where bf16_matmul is compiled (AVX-512 BF16), else 0. */
int tq_has_bf16(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] = x [m, k] @ W.T on bfloat16 panels (kind KIND_Q4 or KIND_Q8): -1 without memory, -2 where the
 * build has no AVX-512 BF16. For long prompt chunks, where it beats dequantize + float32 GEMM. */
int tq_bf16_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                   int64_t m, float *out, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return bf16_panel_matmul(kind, w, scales, n, k, x, m, out, threads);
#else
    (void)kind, (void)w, (void)scales, (void)n, (void)k, (void)x, (void)m, (void)out, (void)threads;
    return -2;
#endif
}

/* ---------------------------------------------------------------- int8 activations on packed weights (VNNI)
 * vpdpbusd does four times the multiply-adds of a float32 FMA (twice vdpbf16ps's) in the same time. Each
 * activation row is rounded to int8 per group of 32 (p = round(a / s), s = max |a| / 127, ties to even: llama.cpp's
 * Q8_0 with a float32 scale) and each group's dot product with the weights' codes is exact in int32; then
 * out += s d I + s P m in float32, per group in k order (P = sum p). vpdpbusd multiplies unsigned bytes (here the
 * weights' codes u: int4's 0..15 as they are, w = d u + m; Q8_0's q + 128, w = d u - 128 d) by signed ones (the
 * activations, each 4 bytes broadcast to every column; so a group's sum starts at 0).
 * The weights are packed once, when a model loads (tq_i8_pack), in panels of I8_PANEL weight rows: per block (int4:
 * a pair of groups, their codes in one byte's low and high nibble as in the rows; Q8_0: one group, codes + 128) the
 * codes as [8 steps][I8_PANEL columns][4 k] bytes, then the float16 scales per column (int4: d of both groups, m of
 * both; Q8_0: d). The same bytes as the rows, read in order by every row count: a decode step streams them once
 * (batch 1 ~2.5-3x the int16 kernel), a prompt chunk meets each panel from cache once per tile of I8_R rows. A
 * row's result does not depend on the other rows, nor on how many there are.
 * Decode steps and short chunks (`digits` 2) keep 15 bits of each activation, as two int8 digits: p = 128 h + l
 * (s = max |a| / 16383, h = floor(p / 128), l in 0..127), I = 128 (u . h) + u . l, twice the products of one digit
 * and still exact; int8 alone changed greedy outputs of the quality bench's chat prompts. */
#define I8_PANEL 32
#define I8_R 6  /* rows per tile, one digit */
#define I8_R2 4 /* two digits */
#define I8_CODES (8 * I8_PANEL * 4)

static inline int64_t i8_block_bytes(int kind) { return kind == KIND_Q4 ? I8_CODES + 4 * I8_PANEL * 2 : I8_CODES + I8_PANEL * 2; }
static inline int64_t i8_blocks(int kind, int64_t k) { return kind == KIND_Q4 ? k / 64 : k / Q8_GROUP; }

/* Bytes tq_i8_pack writes for an [n, k] weight of `kind`. */
int64_t tq_i8_packed_bytes(int kind, int64_t n, int64_t k) {
    return (n + I8_PANEL - 1) / I8_PANEL * i8_blocks(kind, k) * i8_block_bytes(kind);
}

/* The weight rows (int4 codes [n, k / 2] with (d, m) [n, 2, k / 32], or Q8_0 [n, k] with d [n, k / 32]) in the layout
 * above; rows past n are zero codes with zero scales. Plain C: any build can pack (only VNNI multiplies). */
void tq_i8_pack(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, uint8_t *out, int threads) {
    int64_t groups = k / Q8_GROUP, blocks = i8_blocks(kind, k), bb = i8_block_bytes(kind);
    int64_t row_bytes = kind == KIND_Q4 ? k / 2 : k, scale_stride = kind == KIND_Q4 ? 2 * groups : groups;
    int64_t panels = (n + I8_PANEL - 1) / I8_PANEL;
    const uint32_t flip = kind == KIND_Q4 ? 0u : 0x80808080u;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t pb = 0; pb < panels * blocks; pb++) {
        int64_t p = pb / blocks, b = pb % blocks;
        uint8_t *blk = out + pb * bb;
        uint16_t *sc = (uint16_t *)(blk + I8_CODES);
        for (int c = 0; c < I8_PANEL; c++) {
            int64_t j = p * I8_PANEL + c;
            int live = j < n;
            const uint8_t *run = (const uint8_t *)w + j * row_bytes + b * 32;
            for (int s = 0; s < 8; s++) {
                uint32_t four = 0;
                if (live) {
                    memcpy(&four, run + 4 * s, 4);
                    four ^= flip;
                }
                memcpy(blk + (s * I8_PANEL + c) * 4, &four, 4);
            }
            const uint16_t *row = scales + (live ? j : 0) * scale_stride;
            if (kind == KIND_Q4) {
                for (int q = 0; q < 2; q++) {
                    sc[q * I8_PANEL + c] = live ? row[2 * b + q] : 0;
                    sc[(2 + q) * I8_PANEL + c] = live ? row[groups + 2 * b + q] : 0;
                }
            } else {
                sc[c] = live ? row[b] : 0;
            }
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Activation rows [m, k] as int8 groups (see above): xq = p (one digit) or h, then l (two: xl), xs = s, xsp = s sum p. */
static void rows_to_i8(const float *x, int64_t m, int64_t k, const int digits, int8_t *xq, int8_t *xl, float *xs,
                       float *xsp, int threads) {
    int64_t groups = k / Q8_GROUP;
    const float top = digits == 2 ? 16383.f : 127.f;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k > 65536)
    for (int64_t rg = 0; rg < m * groups; rg++) {
        __m512 v0 = _mm512_loadu_ps(x + rg * Q8_GROUP), v1 = _mm512_loadu_ps(x + rg * Q8_GROUP + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        __m512 inv = _mm512_set1_ps(amax > 0.f ? top / amax : 0.f);
        __m512i p0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), p1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        float s = amax / top;
        xs[rg] = s;
        xsp[rg] = s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(p0, p1));
        if (digits == 2) {
            const __m512i seven = _mm512_set1_epi32(127);
            _mm_storeu_si128((__m128i *)(xl + rg * Q8_GROUP), _mm512_cvtepi32_epi8(_mm512_and_si512(p0, seven)));
            _mm_storeu_si128((__m128i *)(xl + rg * Q8_GROUP + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(p1, seven)));
            p0 = _mm512_srai_epi32(p0, 7);
            p1 = _mm512_srai_epi32(p1, 7);
        }
        _mm_storeu_si128((__m128i *)(xq + rg * Q8_GROUP), _mm512_cvtepi32_epi8(p0));
        _mm_storeu_si128((__m128i *)(xq + rg * Q8_GROUP + 16), _mm512_cvtepi32_epi8(p1));
    }
}

/* out[r * os + c] = sum over groups of s d I + s P m for R rows (<= I8_R, I8_R2 with two digits) and the I8_PANEL
 * columns of panel `wp`. The integer sums are exact in any order (one row of one digit takes two chains of vpdpbusd,
 * so their latency overlaps); the float operations are the same whatever R is. */
static inline __attribute__((always_inline)) void i8_tile(const int kind, const int D, const int R, const int8_t *xq,
                                                          const int8_t *xl, const float *xs, const float *xsp,
                                                          int64_t k, const uint8_t *wp, float *out, int64_t os) {
    int64_t groups = k / Q8_GROUP, bb = i8_block_bytes(kind);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 lo[I8_R], hi[I8_R];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int high = kind == KIND_Q4 && (g & 1); /* int4: the pair's second group, in the high nibbles */
        const uint8_t *blk = wp + (kind == KIND_Q4 ? g / 2 : g) * bb;
        __m512i ilo[I8_R], ihi[I8_R], jlo[I8_R], jhi[I8_R]; /* j: the second digit's sums, or a one-row tile's odd steps */
        for (int r = 0; r < R; r++) ilo[r] = ihi[r] = jlo[r] = jhi[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i w0 = _mm512_loadu_si512(blk + s * I8_PANEL * 4), w1 = _mm512_loadu_si512(blk + s * I8_PANEL * 4 + 64);
            if (kind == KIND_Q4) {
                w0 = _mm512_and_si512(high ? _mm512_srli_epi16(w0, 4) : w0, low);
                w1 = _mm512_and_si512(high ? _mm512_srli_epi16(w1, 4) : w1, low);
            }
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + r * k + g * Q8_GROUP + 4 * s, 4);
                __m512i a = _mm512_set1_epi32(four);
                if (D == 1 && R == 1 && (s & 1)) {
                    jlo[r] = _mm512_dpbusd_epi32(jlo[r], w0, a);
                    jhi[r] = _mm512_dpbusd_epi32(jhi[r], w1, a);
                } else {
                    ilo[r] = _mm512_dpbusd_epi32(ilo[r], w0, a);
                    ihi[r] = _mm512_dpbusd_epi32(ihi[r], w1, a);
                }
                if (D == 2) {
                    memcpy(&four, xl + r * k + g * Q8_GROUP + 4 * s, 4);
                    a = _mm512_set1_epi32(four);
                    jlo[r] = _mm512_dpbusd_epi32(jlo[r], w0, a);
                    jhi[r] = _mm512_dpbusd_epi32(jhi[r], w1, a);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            if (D == 2) {
                ilo[r] = _mm512_add_epi32(_mm512_slli_epi32(ilo[r], 7), jlo[r]);
                ihi[r] = _mm512_add_epi32(_mm512_slli_epi32(ihi[r], 7), jhi[r]);
            } else if (R == 1) {
                ilo[r] = _mm512_add_epi32(ilo[r], jlo[r]);
                ihi[r] = _mm512_add_epi32(ihi[r], jhi[r]);
            }
        }
        const uint16_t *sc = (const uint16_t *)(blk + I8_CODES) + (high ? I8_PANEL : 0);
        __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16)));
        __m512 m0, m1;
        if (kind == KIND_Q4) {
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * I8_PANEL)));
            m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 2 * I8_PANEL + 16)));
        } else {
            m0 = _mm512_mul_ps(d0, _mm512_set1_ps(-128.f));
            m1 = _mm512_mul_ps(d1, _mm512_set1_ps(-128.f));
        }
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_set1_ps(xs[r * groups + g]), sp = _mm512_set1_ps(xsp[r * groups + g]);
            lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ilo[r]), _mm512_mul_ps(d0, s), _mm512_fmadd_ps(m0, sp, lo[r]));
            hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ihi[r]), _mm512_mul_ps(d1, s), _mm512_fmadd_ps(m1, sp, hi[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out + r * os, lo[r]);
        _mm512_storeu_ps(out + r * os + 16, hi[r]);
    }
}

/* A tile of `rows` rows (1 up to the digits' tile height). */
static inline __attribute__((always_inline)) void i8_tile_rows(const int kind, const int D, int rows,
                                                               const int8_t *xq, const int8_t *xl, const float *xs,
                                                               const float *xsp, int64_t k, const uint8_t *wp,
                                                               float *out, int64_t os) {
    switch (rows) {
#define I8_TILE(R) case R: i8_tile(kind, D, R, xq, xl, xs, xsp, k, wp, out, os); return;
    I8_TILE(1) I8_TILE(2) I8_TILE(3)
    default:
        if (D == 2) {
            i8_tile(kind, D, I8_R2, xq, xl, xs, xsp, k, wp, out, os);
            return;
        }
        switch (rows) { I8_TILE(4) I8_TILE(5) default: i8_tile(kind, 1, I8_R, xq, xl, xs, xsp, k, wp, out, os); }
#undef I8_TILE
    }
}

/* This thread's panels (taken with share_next), each against every row. `kind` and D constants (see share_tiles). */
static inline __attribute__((always_inline)) void share_i8_panels(const int kind, const int D, const uint8_t *wp,
                                                                  int64_t n, int64_t k, const int8_t *xq,
                                                                  const int8_t *xl, const float *xs, const float *xsp,
                                                                  int64_t m, float *out, float *spill, Share *shares,
                                                                  int threads) {
    int64_t panels = (n + I8_PANEL - 1) / I8_PANEL, groups = k / Q8_GROUP;
    int64_t panel_bytes = i8_blocks(kind, k) * i8_block_bytes(kind), chunk = share_chunk(panels, threads);
    const int height = D == 2 ? I8_R2 : I8_R;
    int tid = thread_num();
    for (int64_t b, e; share_next(shares, threads, tid, chunk, &b, &e);)
    for (int64_t p = b; p < e; p++) {
        int64_t j = p * I8_PANEL;
        int cols = n - j < I8_PANEL ? (int)(n - j) : I8_PANEL;
        for (int64_t r = 0; r < m; r += height) {
            int rows = m - r < height ? (int)(m - r) : height;
            float *o = tile_out(out, n, r, j, cols, I8_PANEL, spill);
            i8_tile_rows(kind, D, rows, xq + r * k, xl + r * k, xs + r * groups, xsp + r * groups, k,
                         wp + p * panel_bytes, o, cols == I8_PANEL ? n : I8_PANEL);
            unspill(out, n, r, j, rows, cols, I8_PANEL, spill);
        }
    }
}

#define I8_SHARE(name, kind, D) \
    static void name(const uint8_t *wp, int64_t n, int64_t k, const int8_t *xq, const int8_t *xl, const float *xs, \
                     const float *xsp, int64_t m, float *out, float *spill, Share *shares, int threads) { \
        share_i8_panels(kind, D, wp, n, k, xq, xl, xs, xsp, m, out, spill, shares, threads); \
    }
I8_SHARE(share_i8_q4, KIND_Q4, 1)
I8_SHARE(share_i8_q8, KIND_Q8, 1)
I8_SHARE(share_i8x2_q4, KIND_Q4, 2)
I8_SHARE(share_i8x2_q8, KIND_Q8, 2)
#undef I8_SHARE
#endif

/* 1 where i8_matmul is compiled (AVX-512 VNNI), else 0. */
int tq_has_i8(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

/* out [m, n] = x [m, k] @ W.T for a weight tq_i8_pack packed (`kind` KIND_Q4 or KIND_Q8), x rounded per group of 32
 * to `digits` int8 digits (1: 8 bits, 2: 15): -1 without memory, -2 where the build has no AVX-512 VNNI. */
int tq_i8_matmul(int kind, const uint8_t *wp, int64_t n, int64_t k, const float *x, int64_t m, float *out, int digits,
                 int threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    int64_t groups = k / Q8_GROUP, bytes = (m * k + 63) / 64 * 64;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(2 * bytes));
    float *xs = (float *)malloc((size_t)(2 * m * groups) * sizeof(float));
    float *spill = (float *)aligned_alloc(64, (size_t)threads * I8_R * I8_PANEL * sizeof(float));
    Share *shares = shares_new(1, threads, (n + I8_PANEL - 1) / I8_PANEL);
    if (!xq || !xs || !spill || !shares) {
        free(xq);
        free(xs);
        free(spill);
        free(shares);
        return -1;
    }
    int8_t *xl = xq + bytes;
    float *xsp = xs + m * groups;
    rows_to_i8(x, m, k, digits, xq, xl, xs, xsp, threads);
    #pragma omp parallel num_threads(threads)
    {
        float *mine = spill + thread_num() * I8_R * I8_PANEL;
        if (digits == 2)
            (kind == KIND_Q4 ? share_i8x2_q4 : share_i8x2_q8)(wp, n, k, xq, xl, xs, xsp, m, out, mine, shares, threads);
        else
            (kind == KIND_Q4 ? share_i8_q4 : share_i8_q8)(wp, n, k, xq, xl, xs, xsp, m, out, mine, shares, threads);
    }
    free(shares);
    free(spill);
    free(xs);
    free(xq);
    return 0;
#else
    (void)kind, (void)wp, (void)n, (void)k, (void)x, (void)m, (void)out, (void)digits, (void)threads;
    return -2;
#endif
}

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

/* On the row-invariant path (tq_set_row_invariant) every row takes the int16 kernel above, whatever the
 * batch: a row's result is then the same in any batch of any size, at the speed of that kernel. */
static int row_invariant = 0;

void tq_set_row_invariant(int on) { row_invariant = on; }

/* out [m, n] = x [m, k] @ W.T (k a multiple of 32; of 64 for int4). Returns nonzero without memory. */
static int quantized_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                            int64_t m, float *out, int threads) {
#ifdef __AVX2__
    if (!row_invariant && m >= PANEL_MIN_ROWS(kind)) return panel_matmul(kind, w, scales, n, k, x, m, out, threads);
#endif
    int64_t groups = k / Q8_GROUP, cols = tile_cols(kind, m, k);
    int16_t *codes = (int16_t *)malloc((size_t)(m * k) * sizeof(int16_t));
    float *floats = (float *)malloc((size_t)(2 * m * groups + threads * TILE_R * TILE_C * groups) * sizeof(float));
    Share *shares = shares_new((m + tile_rows(k) - 1) / tile_rows(k), threads, (n + cols - 1) / cols);
    if (!codes || !floats || !shares) {
        free(codes);
        free(floats);
        free(shares);
        return -1;
    }
    Matmul mm = {w, scales, n, k, m, {codes, floats, floats + m * groups}, out, shares, threads};
    quantize_rows(x, m, k, mm.a, threads);
    #pragma omp parallel num_threads(threads)
    {
        int tid = thread_num();
        float *ds = floats + 2 * m * groups + (int64_t)tid * TILE_R * TILE_C * groups;
        if (kind == KIND_Q4)
            share_tiles_q4(mm, ds);
        else
            share_tiles_q8(mm, ds);
    }
    free(shares);
    free(floats);
    free(codes);
    return 0;
}

/* The fewest rows a matmul of `kind` (4: int4, 8: Q8_0) runs on the float32 panels; without AVX2, never. */
int64_t tq_panel_min_rows(int kind) {
#ifdef __AVX2__
    return PANEL_MIN_ROWS(kind);
#else
    (void)kind;
    return INT64_MAX;
#endif
}

int tq_q8_matmul(const int8_t *q, const uint16_t *d16, int64_t n, int64_t k, const float *x, int64_t m, float *out,
                 int threads) {
    return quantized_matmul(KIND_Q8, q, d16, n, k, x, m, out, threads);
}

int tq_q4_matmul(const uint8_t *qs, const uint16_t *dm, int64_t n, int64_t k, const float *x, int64_t m,
                 float *out, int threads) {
    return quantized_matmul(KIND_Q4, qs, dm, n, k, x, m, out, threads);
}

/* ---------------------------------------------------------------- one decoder layer
 * A decode step (or short prompt chunk) of a model whose linear layers are all int4/Q8_0 runs each layer as
 * one call: the same functions as above, in the order LlamaModel.forward calls them, without a trip through
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
int tq_decoder_layer(const Layer *l, LayerStep *s, void *keys, void *values) {
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

/* ---------------------------------------------------------------- int4 weights to float32
 * Rows [start, stop) of the int4 layout above as float32 (w = d q + m), one pass, for the prefill's
 * dequantize + GEMM path. */
void tq_int4_dequant(const uint8_t *qs, const uint16_t *dm, int64_t k, int64_t start, int64_t stop, float *out,
                     int threads) {
    int64_t groups = k / Q8_GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = start; j < stop; j++) {
        const uint8_t *b = qs + j * (k / 2);
        const uint16_t *d16 = dm + j * 2 * groups, *m16 = d16 + groups;
        float *o = out + (j - start) * k;
        for (int64_t p = 0; p < groups / 2; p++) {
            float da = half_to_float(d16[2 * p]), ma = half_to_float(m16[2 * p]);
            float db = half_to_float(d16[2 * p + 1]), mb = half_to_float(m16[2 * p + 1]);
            for (int i = 0; i < 32; i++) {
                o[p * 64 + i] = (float)(b[p * 32 + i] & 15) * da + ma;
                o[p * 64 + 32 + i] = (float)(b[p * 32 + i] >> 4) * db + mb;
            }
        }
    }
}

/* ---------------------------------------------------------------- this CPU's peaks
 * Loops of independent accumulators on the widest vectors the build has, for engine/native/peaks.py to time:
 * each returns the operations it did (0 where the instruction is absent), and keeps its sums alive. */
#define PROBE_ACC 12
static volatile float probe_sink;

double tq_probe_fma(int64_t iters, int threads) {
    int width = 1;
    #pragma omp parallel num_threads(threads)
    {
        float total = 0.f;
#if defined(__AVX512F__)
        __m512 acc[PROBE_ACC], a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < PROBE_ACC; i++) total += _mm512_reduce_add_ps(acc[i]);
        width = 16;
#elif defined(__AVX2__)
        __m256 acc[PROBE_ACC], a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm256_set1_ps((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        for (int i = 0; i < PROBE_ACC; i++) total += hsum8(acc[i]);
        width = 8;
#else
        float acc[PROBE_ACC];
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = (float)i;
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = acc[i] * 0.999f + 1e-3f;
        for (int i = 0; i < PROBE_ACC; i++) total += acc[i];
#endif
        probe_sink = total;
    }
    return 2.0 * width * PROBE_ACC * (double)iters * threads;
}

double tq_probe_bf16(int64_t iters, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    #pragma omp parallel num_threads(threads)
    {
        __m512 acc[PROBE_ACC];
        __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
        __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        float total = 0.f;
        for (int i = 0; i < PROBE_ACC; i++) total += _mm512_reduce_add_ps(acc[i]);
        probe_sink = total;
    }
    return 2.0 * 32 * PROBE_ACC * (double)iters * threads;
#else
    (void)iters;
    (void)threads;
    return 0.0;
#endif
}

double tq_probe_vnni(int64_t iters, int threads) {
#if defined(__AVX512VNNI__)
    #pragma omp parallel num_threads(threads)
    {
        __m512i acc[PROBE_ACC], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
        for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_set1_epi32(i);
        for (int64_t t = 0; t < iters; t++)
            for (int i = 0; i < PROBE_ACC; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        int64_t total = 0;
        for (int i = 0; i < PROBE_ACC; i++) total += _mm512_reduce_add_epi32(acc[i]);
        probe_sink = (float)total;
    }
    return 2.0 * 64 * PROBE_ACC * (double)iters * threads;
#else
    (void)iters;
    (void)threads;
    return 0.0;
#endif
}

/* The sum of x [n] (n a multiple of 64), read once on `threads` threads: a read-bandwidth probe. */
float tq_probe_read(const float *x, int64_t n, int threads) {
    float total = 0.f;
    #pragma omp parallel num_threads(threads) reduction(+ : total)
    {
#if defined(__AVX512F__)
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i += 64) {
            s0 = _mm512_add_ps(s0, _mm512_loadu_ps(x + i));
            s1 = _mm512_add_ps(s1, _mm512_loadu_ps(x + i + 16));
            s2 = _mm512_add_ps(s2, _mm512_loadu_ps(x + i + 32));
            s3 = _mm512_add_ps(s3, _mm512_loadu_ps(x + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
        float s = 0.f;
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) s += x[i];
        total += s;
#endif
    }
    return total;
}
