/* The forward pass's work on the CPU, in C: the small per-layer operations (each one call instead of the 5-10
 * torch operations, and their dispatch of ~2-5 us each, it replaces), the int4/Q8_0 matmul kernels, and a
 * whole decoder layer as one call. Built once per instruction-set variant at install time (engine/native/build.py)
 * and loaded by engine/native/__init__.py with ctypes. float32 activations; every output row depends only on its
 * own input row and on which side of a matmul's PANEL_MIN_ROWS its batch is (on the packed int8 panels, only on
 * how many digits its caller asked for), so a token computes the same in any batch of that side. Parallel over
 * rows, weight rows, sequences or sequence x KV head with OpenMP, on torch's own runtime.
 *
 * One file per job, in the order a forward pass meets them:
 *   threads.c          the library's source hash; how a matmul's threads share its work (Share)
 *   elementwise.c      RMSNorm, RoPE with the K/V store, SiLU gate, argmax
 *   paged_attention.c  decode rows' and short chunks' attention over the paged KV pool
 *   paged_segments.c   its AVX-512 path: a row's context in segments of 128 tokens, on every thread
 *   int16_kernels.c    int4/Q8_0 weights against int16 activations (few rows), and which rows go where
 *   panels.c           many rows on panels of dequantized weights: float32, or bfloat16 for long prompt chunks
 *                      (AVX-512 BF16); int4 to float32 for a GEMM
 *   i8_panels.c        every row on int8 dot products of weights packed at load (AVX-512 VNNI, ARM dotprod)
 *   chunk_attention.c  long prompt chunks' attention, flash-attention style (float32 or bfloat16; AVX-512)
 *   layer.c            one decoder layer as one call
 *   peaks.c            this CPU's peaks, for the benchmarks' rooflines
 * This header holds what more than one of them uses. */
#ifndef TANDEM_OPS_H
#define TANDEM_OPS_H

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
#ifdef __ARM_NEON
#include <arm_neon.h>
#endif

/* functions one file defines for another, not exported from the library */
#define INTERNAL __attribute__((visibility("hidden")))

/* The pool's K/V elements: float32, or float16 where `half` (half the bytes a decode step reads; rounded to
 * nearest even where written). Offsets are in elements. */
static inline float kv_at(const void *p, int64_t i, const int half) {
    return half ? (float)((const _Float16 *)p)[i] : ((const float *)p)[i];
}

static inline const char *kv_address(const void *p, int64_t i, const int half) {
    return (const char *)p + i * (half ? 2 : 4);
}

#ifdef __AVX2__
/* the sums of 8 vectors, as one: [sum y[0], ..., sum y[7]] (hadd, not 8 hsums) */
static inline __attribute__((always_inline)) __m256 sum8x8(const __m256 y[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* tq_paged_attention's AVX-512 path (paged_segments.c). */
INTERNAL int paged_attention_segments(const float *q, int64_t q_stride, const void *keys, const void *values,
                                      int64_t block_stride, const int64_t *tables, int64_t table_stride,
                                      const int64_t *row_table, const int64_t *lens, int64_t rows, int heads,
                                      int kv_heads, int d, int block_size, float scale, int64_t window, float *out,
                                      int half, int threads);
#endif

#ifdef __AVX512F__
/* 16 of the pool's K/V elements from offset i of `p`, as float32 (float16 widened exactly). */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *p, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}
#endif

/* This thread's number in the enclosing OpenMP team (0 outside one, or without OpenMP). */
static inline int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#define Q8_GROUP 32
enum { KIND_Q8 = 8, KIND_Q4 = 4 };

/* The int8 kernels' packed weights (i8_pack.c packs, i8_panels.c multiplies; the layout is described there): panels
 * of I8_PANEL weight rows, per block (int4: a pair of groups; Q8_0: one group) the codes, then the scales. */
#define I8_PANEL 32
#define I8_CODES (8 * I8_PANEL * 4)
static inline int64_t i8_block_bytes(int kind) { return kind == KIND_Q4 ? I8_CODES + 4 * I8_PANEL * 2 : I8_CODES + I8_PANEL * 2; }
static inline int64_t i8_blocks(int kind, int64_t k) { return kind == KIND_Q4 ? k / 64 : k / Q8_GROUP; }

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 f;
    memcpy(&f, &h, 2);
    return (float)f;
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

static inline float hmax8(__m256 v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

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
#endif

#ifdef __AVX512F__
/* e^x for x <= 0, 16 at a time: exp_neg's polynomial, the same bits lane by lane for any x but NaN (relative error
 * ~2e-7); below -87 (and -inf) it is 0 */
static inline __m512 exp_neg16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}
#endif

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

/* A thread's chunk: a sixteenth of its range, so a thief waits on at most that much of another's. */
static inline int64_t share_chunk(int64_t items, int threads) {
    int64_t c = items / ((int64_t)threads * 16);
    return c > 1 ? c : 1;
}

/* A Share per thread (times `blocks`) over `items`, each thread's range contiguous; NULL without memory. */
INTERNAL Share *shares_new(int64_t blocks, int threads, int64_t items);
INTERNAL int share_next(Share *s, int threads, int tid, int64_t chunk, int64_t *b, int64_t *e);

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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 16 columns' values at an even k and at the next odd one as 16 bfloat16 pairs (column c: even, odd at 2c, 2c + 1),
 * rounded to nearest even: cvtne2ps_pbh holds the evens in lanes 0-15 and the odds in 16-31, interleaved here. */
static inline __m512i bf16_pairs(__m512 even, __m512 odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}
#endif

/* From this many rows of a matmul on, int4/Q8_0 weights take the float32 panels (panels.c); fewer, the int16
 * kernels (int16_kernels.c). */
#define PANEL_MIN_ROWS(kind) ((kind) == KIND_Q4 ? 16 : 32)

/* out [m, n] = x [m, k] @ W.T for int4 (KIND_Q4) or Q8_0 (KIND_Q8) weights as their rows hold them, on the
 * int16 kernels or the float32 panels (int16_kernels.c); nonzero without memory. */
INTERNAL int quantized_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                              int64_t m, float *out, int threads);
#ifdef __AVX2__
INTERNAL int panel_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
                          int64_t m, float *out, int threads);
#endif

/* What layer.c calls of the others (the library's exported functions). */
void tq_rms_norm(float *x, const float *residual, const float *w, int64_t m, int64_t n, float eps, float *out,
                 int threads);
void tq_rope_store(float *qkv, int64_t m, int64_t width, const int64_t *positions, const float *cos_t,
                   const float *sin_t, int heads, int kv_heads, int d, void *keys, void *values, int64_t block_stride,
                   const int64_t *blocks, const int64_t *offsets, int kv_half, int threads);
void tq_paged_attention(const float *q, int64_t q_stride, const void *keys, const void *values,
                        int64_t block_stride, const int64_t *tables, int64_t table_stride, const int64_t *row_table,
                        const int64_t *lens, int64_t rows, int heads, int kv_heads, int d, int block_size,
                        float scale, int64_t window, float *out, int kv_half, int threads);
void tq_silu_mul(const float *gu, int64_t m, int64_t f, float *out, int threads);
int tq_i8_matmul(int kind, const uint8_t *wp, int64_t n, int64_t k, const float *x, int64_t m, float *out, int digits,
                 int threads);

#endif
