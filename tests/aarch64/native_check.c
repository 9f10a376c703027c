/* Runs engine/native's C of the build it is compiled into (the int4 / Q8_0 matmuls, decode attention, the peak
 * probes) for tests/test_native_aarch64.py: cross-compiled with the library's C for aarch64, run under qemu-user.
 *
 *     native_check IN OUT
 *
 * IN: int64 kind (4: int4, 8: Q8_0), n, k, m, threads, digits (0: the int16 kernels, tq_q4_matmul / tq_q8_matmul;
 * 1 or 2: the weights packed by tq_i8_pack and multiplied by tq_i8_matmul in that many int8 digits); then x float32
 * [m, k], the codes (int4 [n, k / 2] bytes, Q8_0 [n, k] int8) and the float16 scales (int4 [n, 2, k / 32], Q8_0
 * [n, k / 32]). OUT: float32 [m, n]. Exit status 3: this build has no int8 dot product (tq_has_i8).
 *
 *     native_check --probes OUT
 *
 * OUT: float64 what tq_probe_fma, tq_probe_vnni and tq_probe_read (of 4,096 ones) return, on one thread.
 *
 *     native_check --attention IN OUT
 *
 * tq_paged_attention. IN: int64 rows, heads, kv_heads, d, block_size, blocks, table_stride, half (the pool's
 * elements: 1 float16, 0 float32), threads; float32 scale; then q float32 [rows, heads * d], keys and values
 * [blocks, block_size, kv_heads, d], tables int64 [rows, table_stride], lens int64 [rows] (row r reads table r).
 * OUT: float32 [rows, heads * d]. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tq_q8_matmul(const int8_t *q, const uint16_t *d16, int64_t n, int64_t k, const float *x, int64_t m, float *out,
                 int threads);
int tq_q4_matmul(const uint8_t *qs, const uint16_t *dm, int64_t n, int64_t k, const float *x, int64_t m,
                 float *out, int threads);
int tq_has_i8(void);
double tq_probe_fma(int64_t iters, int threads);
double tq_probe_vnni(int64_t iters, int threads);
float tq_probe_read(const float *x, int64_t n, int threads);
void tq_paged_attention(const float *q, int64_t q_stride, const void *keys, const void *values, int64_t block_stride,
                        const int64_t *tables, int64_t table_stride, const int64_t *row_table, const int64_t *lens,
                        int64_t rows, int heads, int kv_heads, int d, int block_size, float scale, int64_t window,
                        float *out, int kv_half, int threads);

static void *read_exactly(FILE *f, size_t bytes);

/* tq_paged_attention on the inputs in `in` (see above); 0, or an exit status */
static int attention(const char *in_path, const char *out_path) {
    FILE *in = fopen(in_path, "rb");
    if (!in) return 2;
    int64_t *h = (int64_t *)read_exactly(in, 9 * sizeof(int64_t));
    int64_t rows = h[0], heads = h[1], kv_heads = h[2], d = h[3], bs = h[4], blocks = h[5], ts = h[6], half = h[7];
    float *scale = (float *)read_exactly(in, sizeof(float));
    float *q = (float *)read_exactly(in, (size_t)(rows * heads * d) * sizeof(float));
    size_t pool = (size_t)(blocks * bs * kv_heads * d) * (half ? 2 : 4);
    void *keys = read_exactly(in, pool), *values = read_exactly(in, pool);
    int64_t *tables = (int64_t *)read_exactly(in, (size_t)(rows * ts) * sizeof(int64_t));
    int64_t *lens = (int64_t *)read_exactly(in, (size_t)rows * sizeof(int64_t));
    fclose(in);
    int64_t *row_table = (int64_t *)malloc((size_t)rows * sizeof(int64_t));
    float *out = (float *)malloc((size_t)(rows * heads * d) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) row_table[r] = r;
    tq_paged_attention(q, heads * d, keys, values, bs * kv_heads * d, tables, ts, row_table, lens, rows, (int)heads,
                       (int)kv_heads, (int)d, (int)bs, *scale, 0, out, (int)half, (int)h[8]);
    FILE *o = fopen(out_path, "wb");
    return !o || fwrite(out, sizeof(float), (size_t)(rows * heads * d), o) != (size_t)(rows * heads * d) || fclose(o);
}
int64_t tq_i8_packed_bytes(int kind, int64_t n, int64_t k);
void tq_i8_pack(int kind, const void *w, const uint16_t *scales, int64_t n, int64_t k, uint8_t *out, int threads);
int tq_i8_matmul(int kind, const uint8_t *wp, int64_t n, int64_t k, const float *x, int64_t m, float *out, int digits,
                 int threads);

static void *read_exactly(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "native_check: input ends early (%zu bytes wanted)\n", bytes);
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--probes")) {
        static float ones[4096];
        for (int i = 0; i < 4096; i++) ones[i] = 1.f;
        double got[3] = {tq_probe_fma(1000, 1), tq_probe_vnni(1000, 1), tq_probe_read(ones, 4096, 1)};
        FILE *o = fopen(argv[2], "wb");
        return !o || fwrite(got, sizeof(double), 3, o) != 3 || fclose(o);
    }
    if (argc == 4 && !strcmp(argv[1], "--attention")) return attention(argv[2], argv[3]);
    if (argc != 3) {
        fprintf(stderr, "usage: native_check IN OUT\n");
        return 2;
    }
    FILE *in = fopen(argv[1], "rb");
    if (!in) {
        perror(argv[1]);
        return 2;
    }
    int64_t *h = (int64_t *)read_exactly(in, 6 * sizeof(int64_t));
    int64_t kind = h[0], n = h[1], k = h[2], m = h[3];
    int threads = (int)h[4], digits = (int)h[5];
    int64_t groups = k / 32, code_bytes = kind == 4 ? n * k / 2 : n * k, scales = kind == 4 ? n * 2 * groups : n * groups;
    float *x = (float *)read_exactly(in, (size_t)(m * k) * sizeof(float));
    void *codes = read_exactly(in, (size_t)code_bytes);
    uint16_t *s = (uint16_t *)read_exactly(in, (size_t)scales * sizeof(uint16_t));
    fclose(in);
    float *out = (float *)malloc((size_t)(m * n) * sizeof(float));
    int rc;
    if (digits) {
        if (!tq_has_i8()) return 3;
        uint8_t *packed = (uint8_t *)malloc((size_t)tq_i8_packed_bytes((int)kind, n, k));
        tq_i8_pack((int)kind, codes, s, n, k, packed, threads);
        rc = tq_i8_matmul((int)kind, packed, n, k, x, m, out, digits, threads);
    } else {
        rc = kind == 4 ? tq_q4_matmul((const uint8_t *)codes, s, n, k, x, m, out, threads)
                       : tq_q8_matmul((const int8_t *)codes, s, n, k, x, m, out, threads);
    }
    if (rc) {
        fprintf(stderr, "native_check: the matmul returned %d\n", rc);
        return 1;
    }
    FILE *o = fopen(argv[2], "wb");
    if (!o || fwrite(out, sizeof(float), (size_t)(m * n), o) != (size_t)(m * n)) {
        perror(argv[2]);
        return 2;
    }
    fclose(o);
    return 0;
}
