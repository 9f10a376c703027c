/* The small per-layer operations of a forward pass, in C: each is one call instead of the 5-10 torch
 * operations (and their dispatch, ~2-5 us each) it replaces. Built and loaded by engine/native/__init__.py.
 * float32 throughout; every output row depends only on its own input row, so a token computes the same
 * in any batch. Parallel over rows (or sequence x KV head) with OpenMP, on torch's own runtime. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w, rows of n floats (x and out may alias). */
void tq_rms_norm(const float *x, const float *w, int64_t m, int64_t n, float eps, float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m > 8)
    for (int64_t i = 0; i < m; i++) {
        const float *row = x + i * n;
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
                   const float *sin_t, int heads, int kv_heads, int d, float *keys, float *values,
                   int64_t block_stride, const int64_t *blocks, const int64_t *offsets, int threads) {
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
        memcpy(keys + slot, row + (int64_t)heads * d, kv * sizeof(float));
        memcpy(values + slot, row + (int64_t)rot * d, kv * sizeof(float));
    }
}

/* Causal attention of query rows over the paged KV pool: row r (query heads `heads`, head h reading KV head
 * h / (heads / kv_heads)) attends to the first lens[r] tokens of the sequence whose block table is
 * tables[row_table[r] * table_stride ...] (token t in block table[t / block_size]); softmax(q . k * scale)
 * weights the v. A prefill chunk's rows and a decode row run the same code, so a token's result is the same
 * whether it was computed in a prompt or one at a time, in any batch. q and out: [rows, heads * d], q's rows
 * q_stride apart. The K/V of every row must already be in the pool (tq_rope_store). */
void tq_paged_attention(const float *q, int64_t q_stride, const float *keys, const float *values,
                        int64_t block_stride, const int64_t *tables, int64_t table_stride, const int64_t *row_table,
                        const int64_t *lens, int64_t rows, int heads, int kv_heads, int d, int block_size,
                        float scale, float *out, int threads) {
    int group = heads / kv_heads;
    int64_t kv = (int64_t)kv_heads * d, total = 0;
    for (int64_t r = 0; r < rows; r++) total += lens[r];
    /* one thread for a small call: the parallel region costs more than ~64 tokens of context */
    #pragma omp parallel num_threads(threads) if (total * kv_heads > 256)
    {
        int64_t cap = 0;
        float *scores = NULL;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < rows * kv_heads; w++) {
            int64_t r = w / kv_heads, g = w % kv_heads, len = lens[r];
            if (len > cap) {
                free(scores);
                cap = len;
                scores = (float *)malloc((size_t)(cap * group) * sizeof(float));
            }
            const int64_t *table = tables + row_table[r] * table_stride;
            const float *qg = q + r * q_stride + g * group * d;
            float mx[64];  /* group <= 64 query heads per KV head */
            for (int hh = 0; hh < group; hh++) mx[hh] = -INFINITY;
            for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
                const float *kb = keys + table[b] * block_stride + g * d;
                int64_t count = len - start < block_size ? len - start : block_size;
                for (int64_t i = 0; i < count; i++) {
                    const float *k = kb + i * kv;
                    for (int hh = 0; hh < group; hh++) {
                        const float *qh = qg + hh * d;
                        float s = 0.f;
                        #pragma omp simd reduction(+ : s)
                        for (int j = 0; j < d; j++) s += qh[j] * k[j];
                        s *= scale;
                        scores[hh * len + start + i] = s;
                        mx[hh] = s > mx[hh] ? s : mx[hh];
                    }
                }
            }
            float inv[64];
            for (int hh = 0; hh < group; hh++) {
                float *sc = scores + hh * len, sum = 0.f;
                for (int64_t t = 0; t < len; t++) {
                    sc[t] = expf(sc[t] - mx[hh]);
                    sum += sc[t];
                }
                inv[hh] = 1.f / sum;
                float *o = out + r * heads * d + (g * group + hh) * d;
                for (int j = 0; j < d; j++) o[j] = 0.f;
            }
            for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
                const float *vb = values + table[b] * block_stride + g * d;
                int64_t count = len - start < block_size ? len - start : block_size;
                for (int64_t i = 0; i < count; i++) {
                    const float *v = vb + i * kv;
                    for (int hh = 0; hh < group; hh++) {
                        float p = scores[hh * len + start + i] * inv[hh];
                        float *o = out + r * heads * d + (g * group + hh) * d;
                        #pragma omp simd
                        for (int j = 0; j < d; j++) o[j] += p * v[j];
                    }
                }
            }
        }
        free(scores);
    }
}

/* ---------------------------------------------------------------- GGUF Q8_0 weights, float32 activations
 * W [n, k]: int8 codes q [n, k] and a float16 scale d per group of 32 along k ([n, k / 32]), w = d * q —
 * a GGUF's Q8_0 blocks exactly. out[r, j] = sum_g d[j, g] * sum_i q[j, 32 g + i] * x[r, 32 g + i], in
 * float32, the same order of operations for a row in any batch. */
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define Q8_GROUP 32
#define Q8_TILE 4 /* activation rows sharing one weight group's conversion to float */

static inline float half_to_float(uint16_t h) {
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
}

static inline void halves(const uint16_t *h, int64_t count, float *out) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < count; i++) out[i] = half_to_float(h[i]);
}

#ifdef __AVX2__
static inline float q8_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 q8_load8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}
#endif

/* `rows` (a constant after inlining) activation rows, x_stride apart, against weight row q/d. */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *q, const float *d, int64_t groups,
                                                          const float *x, int64_t k, const int rows, float *out,
                                                          int64_t out_stride) {
#ifdef __AVX2__
    __m256 acc[Q8_TILE];
    for (int t = 0; t < rows; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *b = q + g * Q8_GROUP;
        __m256 w0 = q8_load8(b), w1 = q8_load8(b + 8), w2 = q8_load8(b + 16), w3 = q8_load8(b + 24);
        __m256 dg = _mm256_broadcast_ss(d + g);
        for (int t = 0; t < rows; t++) {
            const float *y = x + t * k + g * Q8_GROUP;
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(y));
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(y + 8), s);
            s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(y + 16), s);
            s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(y + 24), s);
            acc[t] = _mm256_fmadd_ps(dg, s, acc[t]);
        }
    }
    for (int t = 0; t < rows; t++) out[t * out_stride] = q8_hsum(acc[t]);
#else
    for (int t = 0; t < rows; t++) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            for (int i = 0; i < Q8_GROUP; i++) s += (float)q[g * Q8_GROUP + i] * x[t * k + g * Q8_GROUP + i];
            acc += d[g] * s;
        }
        out[t * out_stride] = acc;
    }
#endif
}

/* out [m, n] = x [m, k] @ W.T for W as above; k a multiple of 32. Returns nonzero without memory. */
int tq_q8_matmul(const int8_t *q, const uint16_t *d16, int64_t n, int64_t k, const float *x, int64_t m, float *out,
                 int threads) {
    int64_t groups = k / Q8_GROUP;
    float *scales = (float *)malloc((size_t)(groups * threads) * sizeof(float));
    if (!scales) return -1;
    #pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *d = scales + groups * tid;
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            halves(d16 + j * groups, groups, d);
            const int8_t *row = q + j * k;
            int64_t r = 0;
            for (; r + Q8_TILE <= m; r += Q8_TILE) q8_tile(row, d, groups, x + r * k, k, Q8_TILE, out + r * n + j, n);
            switch (m - r) {
            case 1: q8_tile(row, d, groups, x + r * k, k, 1, out + r * n + j, n); break;
            case 2: q8_tile(row, d, groups, x + r * k, k, 2, out + r * n + j, n); break;
            case 3: q8_tile(row, d, groups, x + r * k, k, 3, out + r * n + j, n); break;
            default: break;
            }
        }
    }
    free(scales);
    return 0;
}

/* ---------------------------------------------------------------- int4 weights to float32
 * Rows [start, stop) (multiples of 32) of torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`:
 * for each block of 32 output rows and each input column, 16 bytes whose low nibble is row j and high
 * nibble row j + 16) with bfloat16 (scale, zero) per group of 32 along a row ([groups, n, 2]):
 * w = q * scale + (zero - 8 scale). One pass, row by row, for the prefill's dequantize + GEMM path. */
void tq_int4_dequant(const uint8_t *packed, const uint16_t *scales_zeros, int64_t n, int64_t k, int64_t start,
                     int64_t stop, float *out, int threads) {
    int64_t blocks = (stop - start) / 32;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t rb = 0; rb < blocks * 32; rb++) {
        int64_t b = rb / 32, j = rb % 32, row = start + rb;
        const uint8_t *u = packed + (start / 32 + b) * k * 16 + (j % 16);
        int shift = j < 16 ? 0 : 4;
        float *o = out + rb * k;
        for (int64_t g = 0; g < k / 32; g++) {
            const uint16_t *sz = scales_zeros + (g * n + row) * 2;
            uint32_t sb = (uint32_t)sz[0] << 16, zb = (uint32_t)sz[1] << 16;
            float s, z;
            memcpy(&s, &sb, 4);
            memcpy(&z, &zb, 4);
            float z8 = z - 8.f * s;
            for (int64_t c = g * 32; c < g * 32 + 32; c++) o[c] = (float)((u[c * 16] >> shift) & 15) * s + z8;
        }
    }
}
