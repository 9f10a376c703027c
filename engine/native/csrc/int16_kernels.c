#include "ops.h"

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
 * does not depend on the other rows of its batch. More rows take the float32 panels (panels.c). AVX2 and, on
 * aarch64 (every ARMv8-A CPU), NEON compute the same exact int32 group sums, then scale and add them in float32
 * in vectors of 8 or 4 (so their last bits can differ); other targets run the scalar C below
 * (tests/test_native_aarch64.py checks NEON against it, and against this machine's build, under qemu-user). */
#define TILE_R 4 /* activation rows per tile */
#define TILE_C 2 /* int4 weight rows per tile at batch 1 (more independent sums in flight: 1.13-1.16x) */


#ifdef __AVX2__

/* A group's 32 codes (bytes, unsigned in 0..15 or signed) against its 32 int16 activations stored in
 * unpack order (`quantize_rows`): 8 int32 partial sums, as float. */
static inline __m256 dot_group(__m256i codes, __m256i high_bytes, const int16_t *y) {
    __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi8(codes, high_bytes), _mm256_loadu_si256((const __m256i *)y));
    __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi8(codes, high_bytes),
                                   _mm256_loadu_si256((const __m256i *)(y + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}
#elif defined(__ARM_NEON)

/* A group's 32 codes, widened to int16 in the order of its activations' slots (`quantize_rows`): elements 0-7,
 * 16-23, 8-15, 24-31 (`lo`: elements 0-15, `hi`: 16-31). */
typedef struct {
    int16x8_t v[4];
} GroupCodes;

static inline GroupCodes widen_u8(uint8x16_t lo, uint8x16_t hi) {
    GroupCodes g = {{vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo))), vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi))),
                     vreinterpretq_s16_u16(vmovl_high_u8(lo)), vreinterpretq_s16_u16(vmovl_high_u8(hi))}};
    return g;
}

static inline GroupCodes widen_s8(int8x16_t lo, int8x16_t hi) {
    GroupCodes g = {{vmovl_s8(vget_low_s8(lo)), vmovl_s8(vget_low_s8(hi)), vmovl_high_s8(lo), vmovl_high_s8(hi)}};
    return g;
}

/* The group's dot product with its 32 int16 activations: 4 int32 partial sums (exact), as float. */
static inline float32x4_t dot_group(GroupCodes c, const int16_t *y) {
    int32x4_t s = vdupq_n_s32(0);
    for (int i = 0; i < 4; i++) {
        int16x8_t yv = vld1q_s16(y + 8 * i);
        s = vmlal_s16(s, vget_low_s16(c.v[i]), vget_low_s16(yv));
        s = vmlal_high_s16(s, c.v[i], yv);
    }
    return vcvtq_f32_s32(s);
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
#elif defined(__ARM_NEON)
        float32x4_t f[8];
        int32x4_t c[8];
        for (int i = 0; i < 8; i++) f[i] = vld1q_f32(v + 4 * i);
        float32x4_t mx = vabsq_f32(f[0]);
        for (int i = 1; i < 8; i++) mx = vmaxq_f32(mx, vabsq_f32(f[i]));
        float amax = vmaxvq_f32(mx);
        float32x4_t inv = vdupq_n_f32(amax > 0.f ? 32767.f / amax : 0.f);
        int32x4_t s4 = vdupq_n_s32(0);
        for (int i = 0; i < 8; i++) { /* to nearest, ties to even: as cvtps and lrintf */
            c[i] = vcvtnq_s32_f32(vmulq_f32(f[i], inv));
            s4 = vaddq_s32(s4, c[i]);
        }
        int sum = vaddvq_s32(s4);
        for (int i = 0; i < 4; i++) /* elements 8i..8i+7 to their slots */
            vst1q_s16(q + UNPACK_SLOT(8 * i), vcombine_s16(vqmovn_s32(c[2 * i]), vqmovn_s32(c[2 * i + 1])));
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
#elif defined(__ARM_NEON)
    float32x4_t acc0[TILE_C][TILE_R], acc1[TILE_C][TILE_R];
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) acc0[c][r] = acc1[c][r] = vdupq_n_f32(0.f);
    for (int64_t g = 0; g < groups; g += 2) { /* two groups: the int4 pair, or two Q8_0 groups */
        int two = g + 1 < groups;
        for (int c = 0; c < C; c++) {
            GroupCodes u0, u1;
            if (kind == KIND_Q4) {
                const uint8_t *b = (const uint8_t *)w + c * (k / 2) + g * 16;
                uint8x16_t lo = vld1q_u8(b), hi = vld1q_u8(b + 16), low = vdupq_n_u8(0x0F);
                u0 = widen_u8(vandq_u8(lo, low), vandq_u8(hi, low));
                u1 = widen_u8(vshrq_n_u8(lo, 4), vshrq_n_u8(hi, 4));
            } else {
                const int8_t *q = (const int8_t *)w + c * k + g * Q8_GROUP;
                u0 = widen_s8(vld1q_s8(q), vld1q_s8(q + 16));
                u1 = two ? widen_s8(vld1q_s8(q + Q8_GROUP), vld1q_s8(q + Q8_GROUP + 16)) : u0;
            }
            for (int r = 0; r < R; r++) {
                const int16_t *y = a.q + r * k + g * Q8_GROUP;
                const float *dsr = ds + (c * R + r) * groups + g;
                acc0[c][r] = vfmaq_n_f32(acc0[c][r], dot_group(u0, y), dsr[0]);
                if (kind == KIND_Q4 || two)
                    acc1[c][r] = vfmaq_n_f32(acc1[c][r], dot_group(u1, y + Q8_GROUP), dsr[1]);
            }
        }
    }
    for (int c = 0; c < C; c++)
        for (int r = 0; r < R; r++) out[r * os + c] = vaddvq_f32(vaddq_f32(acc0[c][r], acc1[c][r])) + off[c][r];
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

/* On the row-invariant path (tq_set_row_invariant) every row takes the int16 kernel above, whatever the
 * batch: a row's result is then the same in any batch of any size, at the speed of that kernel. */
static int row_invariant = 0;

void tq_set_row_invariant(int on) { row_invariant = on; }

/* out [m, n] = x [m, k] @ W.T (k a multiple of 32; of 64 for int4). Returns nonzero without memory. */
int quantized_matmul(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, const float *x,
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
