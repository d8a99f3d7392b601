/* out[M, rows] = x[M, cols] @ W^T for a weight W kept packed (GGML blocks Q4_0 ... Q6_K, or int8
 * rows with one float scale each): float32 activations, each block dequantized to float32 in
 * registers (or an L1-sized scratch), float32 accumulation. No activation is ever quantized, so
 * the result is float32 matmul on the dequantized weights up to summation order.
 *
 * Two shapes:
 * - a few rows of x (decode): each weight row is streamed once, every block dequantized once and
 *   multiplied into all M rows; memory-bound, so its job is to keep up with the weight bytes;
 * - many rows (prefill, big batches): a tile of TILE_ROWS weight rows x TILE_COLS columns is
 *   dequantized once into a float32 scratch, then a register-blocked micro-kernel runs it against
 *   every row of x.
 * OpenMP splits the output rows (weight rows) between threads.
 *
 * One source, built once per ISA level with explicit -m flags (build.py, isa.py): the vector width
 * below follows what the level's flags enable, and GCC's vector extensions lower to that level's
 * instructions. `quant_matmul_self_check` runs every type through both shapes against a plain
 * loop, so a child process can prove a level runs (and computes) on this CPU before it is used.
 */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX2__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_unaligned __attribute__((vector_size(VW * 4), aligned(4)));
#define INLINE static inline __attribute__((always_inline))

/* The type codes quant_matmul.py passes (its QTYPE_CODES). */
enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, I8, NUM_TYPES };
/* Up to this many rows of x the decode shape runs; past it the tiled one. */
#define GEMV_MAX_M 4
#define GEMV_ROWS_PER_TASK 16
#define TILE_ROWS 16
#define TILE_COLS 1024
#if VW == 16
#define MR 4
#define NR 4
#else
#define MR 3
#define NR 2
#endif
/* Below this many multiply-adds a parallel region costs more than it saves. */
#define PARALLEL_MIN 65536

INLINE int block_size(const int t) { return t == Q4_K || t == Q5_K || t == Q6_K ? 256 : 32; }

INLINE int block_bytes(const int t)
{
    switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 32;
    }
}

INLINE float half_to_float(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F)
        bits = sign | 0x7F800000u | (mantissa << 13);
    else if (exponent)
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa)
        bits = sign;
    else { /* subnormal: normalise the mantissa, one exponent step per shift */
        uint32_t e = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

INLINE vf load(const float *p) { return *(const vf_unaligned *)p; }

INLINE float hsum(vf v)
{
    float s = 0.0f;
    for (int i = 0; i < VW; i++)
        s += v[i];
    return s;
}

/* Q4_K / Q5_K: the j-th of 8 six-bit (scale, min) pairs packed into 12 bytes. */
INLINE void k_scale_min(const uint8_t *s, int j, float *scale, float *min)
{
    if (j < 4) {
        *scale = (float)(s[j] & 63);
        *min = (float)(s[j + 4] & 63);
    } else {
        *scale = (float)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *min = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* One block of type t into w[block_size(t)], each weight as gguf's dequantizer computes it. */
INLINE void dequantize_block(const int t, const uint8_t *restrict b, float row_scale, float *restrict w)
{
    switch (t) {
    case Q4_0: {
        const float d = half_to_float(b);
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)((int)(b[2 + j] & 15) - 8);
            w[j + 16] = d * (float)((int)(b[2 + j] >> 4) - 8);
        }
        break;
    }
    case Q4_1: {
        const float d = half_to_float(b), m = half_to_float(b + 2);
        for (int j = 0; j < 16; j++) {
            w[j] = d * (float)(b[4 + j] & 15) + m;
            w[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        break;
    }
    case Q5_0: case Q5_1: {
        const int has_min = t == Q5_1;
        const float d = half_to_float(b), m = has_min ? half_to_float(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * has_min, 4);
        const uint8_t *qs = b + 6 + 2 * has_min;
        const int bias = has_min ? 0 : 16;
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            w[j] = d * (float)(lo - bias) + m;
            w[j + 16] = d * (float)(hi - bias) + m;
        }
        break;
    }
    case Q8_0: {
        const float d = half_to_float(b);
        for (int j = 0; j < 32; j++)
            w[j] = d * (float)(int8_t)b[2 + j];
        break;
    }
    case Q4_K: case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *qh = b + 16, *qs = t == Q5_K ? b + 48 : b + 16;
        for (int c = 0; c < 4; c++) {
            float sc_lo, m_lo, sc_hi, m_hi;
            k_scale_min(b + 4, 2 * c, &sc_lo, &m_lo);
            k_scale_min(b + 4, 2 * c + 1, &sc_hi, &m_hi);
            const float a_lo = d * sc_lo, o_lo = dmin * m_lo, a_hi = d * sc_hi, o_hi = dmin * m_hi;
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                if (t == Q5_K) {
                    lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                }
                w[64 * c + l] = a_lo * (float)lo - o_lo;
                w[64 * c + 32 + l] = a_hi * (float)hi - o_hi;
            }
        }
        break;
    }
    case Q6_K: {
        const float d = half_to_float(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
            float *y = w + 128 * half;
            const int8_t *s = sc + 8 * half;
            float a[8];
            for (int i = 0; i < 8; i++)
                a[i] = d * (float)s[i];
            for (int l = 0; l < 32; l++) {
                const int g = l / 16;
                y[l] = a[g] * (float)(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = a[g + 2] * (float)(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = a[g + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = a[g + 6] * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        break;
    }
    default: /* I8: 32 weights of one row */
        for (int j = 0; j < 32; j++)
            w[j] = row_scale * (float)(int8_t)b[j];
    }
}

struct problem {
    const uint8_t *w;          /* weight rows, w_stride bytes apart */
    int64_t w_stride;
    const float *row_scales;   /* int8 only */
    int64_t rows, cols;
    const float *x;            /* [m, cols], rows x_stride floats apart */
    int64_t x_stride, m;
    float *out;                /* [m, rows], rows out_stride floats apart */
    int64_t out_stride;
};

/* Columns [k0, k0 + n) of weight row r into w (int8's columns past its last whole block included). */
INLINE void dequantize_span(const int t, const struct problem *p, int64_t r, int64_t k0, int64_t n, float *w)
{
    const int bs = block_size(t);
    const uint8_t *row = p->w + r * p->w_stride;
    const float row_scale = t == I8 ? p->row_scales[r] : 0.0f;
    const int64_t whole = n / bs * bs;
    for (int64_t k = 0; k < whole; k += bs)
        dequantize_block(t, row + (k0 + k) / bs * block_bytes(t), row_scale, w + k);
    for (int64_t k = whole; k < n; k++) /* only int8 has columns outside whole blocks */
        w[k] = row_scale * (float)(int8_t)row[k0 + k];
}

/* Decode shape: weight rows [r0, r1), each block dequantized once for all M (<= GEMV_MAX_M) rows. */
INLINE void gemv_rows(const int t, const int M, const struct problem *p, int64_t r0, int64_t r1)
{
    const int bs = block_size(t), bb = block_bytes(t);
    const int64_t blocks = p->cols / bs, whole = blocks * bs;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = p->w + r * p->w_stride;
        const float row_scale = t == I8 ? p->row_scales[r] : 0.0f;
        vf acc[M][2];
        for (int m = 0; m < M; m++)
            acc[m][0] = acc[m][1] = (vf){0};
        for (int64_t b = 0; b < blocks; b++) {
            float w[256] __attribute__((aligned(64)));
            dequantize_block(t, row + b * bb, row_scale, w);
            for (int j = 0; j < bs; j += VW) {
                const vf wv = *(const vf *)(w + j);
                for (int m = 0; m < M; m++)
                    acc[m][(j / VW) & 1] += wv * load(p->x + m * p->x_stride + b * bs + j);
            }
        }
        for (int m = 0; m < M; m++) {
            float sum = hsum(acc[m][0] + acc[m][1]);
            for (int64_t k = whole; k < p->cols; k++)
                sum += row_scale * (float)(int8_t)row[k] * p->x[m * p->x_stride + k];
            p->out[m * p->out_stride + r] = sum;
        }
    }
}

/* Tiled shape: weight rows [r0, r0 + TILE_ROWS), TILE_COLS columns at a time, dequantized once
 * into the scratch, then MR x NR dot products at a time against every row of x. Rows past the
 * weight's or x's end are computed from clamped pointers and never written. */
INLINE void tile_rows(const int t, const struct problem *p, int64_t r0)
{
    float scratch[TILE_ROWS * TILE_COLS] __attribute__((aligned(64)));
    const int64_t nt = p->rows - r0 < TILE_ROWS ? p->rows - r0 : TILE_ROWS;
    for (int64_t k0 = 0; k0 < p->cols; k0 += TILE_COLS) {
        const int64_t kc = p->cols - k0 < TILE_COLS ? p->cols - k0 : TILE_COLS, vec_end = kc / VW * VW;
        for (int64_t n = 0; n < nt; n++)
            dequantize_span(t, p, r0 + n, k0, kc, scratch + n * TILE_COLS);
        for (int64_t m0 = 0; m0 < p->m; m0 += MR) {
            const float *xs[MR];
            for (int i = 0; i < MR; i++)
                xs[i] = p->x + (m0 + i < p->m ? m0 + i : p->m - 1) * p->x_stride + k0;
            for (int64_t n0 = 0; n0 < nt; n0 += NR) {
                const float *ws[NR];
                for (int j = 0; j < NR; j++)
                    ws[j] = scratch + (n0 + j < nt ? n0 + j : nt - 1) * TILE_COLS;
                vf acc[MR][NR];
                for (int i = 0; i < MR; i++)
                    for (int j = 0; j < NR; j++)
                        acc[i][j] = (vf){0};
                for (int64_t k = 0; k < vec_end; k += VW) {
                    vf xv[MR], wv[NR];
                    for (int i = 0; i < MR; i++)
                        xv[i] = load(xs[i] + k);
                    for (int j = 0; j < NR; j++)
                        wv[j] = *(const vf *)(ws[j] + k);
                    for (int i = 0; i < MR; i++)
                        for (int j = 0; j < NR; j++)
                            acc[i][j] += xv[i] * wv[j];
                }
                for (int i = 0; i < MR && m0 + i < p->m; i++)
                    for (int j = 0; j < NR && n0 + j < nt; j++) {
                        float sum = hsum(acc[i][j]);
                        for (int64_t k = vec_end; k < kc; k++)
                            sum += xs[i][k] * ws[j][k];
                        float *o = p->out + (m0 + i) * p->out_stride + r0 + n0 + j;
                        *o = k0 ? *o + sum : sum;
                    }
            }
        }
    }
}

#define DEFINE_TYPE(T)                                                                      \
    static void gemv_##T(const struct problem *p, int64_t r0, int64_t r1)                   \
    {                                                                                       \
        switch (p->m) {                                                                     \
        case 1: gemv_rows(T, 1, p, r0, r1); break;                                          \
        case 2: gemv_rows(T, 2, p, r0, r1); break;                                          \
        case 3: gemv_rows(T, 3, p, r0, r1); break;                                          \
        default: gemv_rows(T, 4, p, r0, r1);                                                \
        }                                                                                   \
    }                                                                                       \
    static void tile_##T(const struct problem *p, int64_t r0) { tile_rows(T, p, r0); }
DEFINE_TYPE(Q4_0)
DEFINE_TYPE(Q4_1)
DEFINE_TYPE(Q5_0)
DEFINE_TYPE(Q5_1)
DEFINE_TYPE(Q8_0)
DEFINE_TYPE(Q4_K)
DEFINE_TYPE(Q5_K)
DEFINE_TYPE(Q6_K)
DEFINE_TYPE(I8)

typedef void (*gemv_fn)(const struct problem *, int64_t, int64_t);
typedef void (*tile_fn)(const struct problem *, int64_t);
static const gemv_fn GEMV[NUM_TYPES] = {gemv_Q4_0, gemv_Q4_1, gemv_Q5_0, gemv_Q5_1, gemv_Q8_0,
                                        gemv_Q4_K, gemv_Q5_K, gemv_Q6_K, gemv_I8};
static const tile_fn TILE[NUM_TYPES] = {tile_Q4_0, tile_Q4_1, tile_Q5_0, tile_Q5_1, tile_Q8_0,
                                        tile_Q4_K, tile_Q5_K, tile_Q6_K, tile_I8};

/* The caller (quant_matmul.py) has checked the shapes: cols in whole blocks (int8: any), x and
 * out with contiguous rows. Returns 1 for an unknown type code, touching nothing. */
int quant_matmul_f32(int qtype, const uint8_t *w, int64_t w_stride, const float *row_scales, int64_t rows,
                     int64_t cols, const float *x, int64_t x_stride, int64_t m, float *out, int64_t out_stride,
                     int threads)
{
    if (qtype < 0 || qtype >= NUM_TYPES)
        return 1;
    const struct problem p = {w, w_stride, row_scales, rows, cols, x, x_stride, m, out, out_stride};
    const int parallel = threads > 1 && rows * cols * m >= PARALLEL_MIN;
    if (m <= 0 || rows <= 0)
        return 0;
    if (m <= GEMV_MAX_M) {
        const gemv_fn gemv = GEMV[qtype];
        const int64_t tasks = (rows + GEMV_ROWS_PER_TASK - 1) / GEMV_ROWS_PER_TASK;
        #pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t r0 = task * GEMV_ROWS_PER_TASK;
            gemv(&p, r0, r0 + GEMV_ROWS_PER_TASK < rows ? r0 + GEMV_ROWS_PER_TASK : rows);
        }
    } else {
        const tile_fn tile = TILE[qtype];
        const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
        #pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
        for (int64_t i = 0; i < tiles; i++)
            tile(&p, i * TILE_ROWS);
    }
    return 0;
}

/* Every type through both shapes against a plain loop over the same dequantized blocks, on
 * pseudo-random blocks. Returns 0 when all agree; the type code + 1 of the first that does not.
 * A level whose instructions the CPU or the OS does not enable dies here with SIGILL. */
int quant_matmul_self_check(void)
{
    enum { ROWS = 5, COLS = 512, M = 7, ROW_BYTES = COLS / 32 * 34 };
    static uint8_t w[ROWS * ROW_BYTES];
    static float x[M * COLS], out[M * ROWS], deq[COLS];
    const float row_scales[ROWS] = {0.01f, 0.02f, 0.03f, 0.04f, 0.05f};
    uint32_t state = 12345;
    for (int i = 0; i < M * COLS; i++) {
        state = state * 1664525u + 1013904223u;
        x[i] = (float)(state >> 8) / (float)(1 << 24) - 0.5f;
    }
    for (int t = 0; t < NUM_TYPES; t++) {
        const int bs = block_size(t), bb = block_bytes(t), blocks = COLS / bs, row_bytes = blocks * bb;
        for (int i = 0; i < ROWS * row_bytes; i++) {
            state = state * 1664525u + 1013904223u;
            w[i] = (uint8_t)(state >> 24);
        }
        if (t != I8) /* fp16 fields: 0.01 (0x211F), at the front of each block, Q6_K's at its end */
            for (int b = 0; b < ROWS * blocks; b++) {
                uint8_t *block = w + b * bb;
                const int offsets[2] = {t == Q6_K ? 208 : 0, 2};
                const int fields = t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K ? 2 : 1;
                for (int f = 0; f < fields; f++)
                    block[offsets[f]] = 0x1F, block[offsets[f] + 1] = 0x21;
            }
        for (int m = 1; m <= M; m += M - 1) {
            quant_matmul_f32(t, w, row_bytes, row_scales, ROWS, COLS, x, COLS, m, out, ROWS, 1);
            for (int r = 0; r < ROWS; r++) {
                const struct problem p = {w, row_bytes, row_scales, ROWS, COLS, x, COLS, m, out, ROWS};
                dequantize_span(t, &p, r, 0, COLS, deq);
                for (int i = 0; i < m; i++) {
                    double sum = 0.0, magnitude = 0.0;
                    for (int k = 0; k < COLS; k++) {
                        sum += (double)deq[k] * x[i * COLS + k];
                        magnitude += __builtin_fabs((double)deq[k] * x[i * COLS + k]);
                    }
                    const double error = __builtin_fabs(out[i * ROWS + r] - sum);
                    if (!(error <= 1e-5 * magnitude + 1e-6))
                        return t + 1;
                }
            }
        }
    }
    return 0;
}
