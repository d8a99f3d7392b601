/* out[M, rows] = x[M, cols] @ W^T for a weight W kept packed (GGML blocks Q4_0 ... Q6_K, or int8
 * rows with one float scale each): float32 activations, each block dequantized to float32 in
 * registers (or an L1-sized scratch), float32 accumulation. No activation is ever quantized, so
 * the result is float32 matmul on the dequantized weights up to summation order.
 *
 * Two shapes:
 * - a few rows of x (decode): each weight row is streamed once, and each block's integers are
 *   converted to float32 once for all M rows; a unit's scale multiplies its dot product and its
 *   offset the unit's sum of x, rather than every weight. On SmolLM2 with 2 threads on an AVX2 EPYC
 *   this is compute-bound (about 14 GB/s of the machine's 29), so its job is few operations a weight;
 * - many rows (prefill, big batches): a tile of TILE_ROWS weight rows x TILE_COLS columns is
 *   dequantized once into a float32 scratch, then a register-blocked micro-kernel runs it against
 *   every row of x: with AVX-512, dot products of 4 x rows by 4 weight rows; below it, against x
 *   transposed once per call, 16 (AVX2) or 8 (SSE) rows of x in two vectors by 6 weight rows, each
 *   weight broadcast, so that no dot product needs a horizontal sum.
 * OpenMP splits the output rows (weight rows) between threads. Past about a hundred rows of x a tuned
 * float32 GEMM beats the tiled shape even after dequantizing the whole weight for it, so the
 * caller (quant_matmul.py) then dequantizes with `quant_dequantize_f32` and runs torch's GEMM.
 *
 * One source, built once per ISA level with explicit -m flags (build.py, isa.py): the vector width
 * below follows what the level's flags enable, and GCC's vector extensions lower to that level's
 * instructions. `quant_matmul_self_check` runs every type through both shapes against a plain
 * loop, so a child process can prove a level runs (and computes) on this CPU before it is used.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

/* A group of 16 float32 lanes, as the level's native vectors: one at AVX-512, two at AVX2, four at
 * the SSE2 baseline. (A 64-byte GCC vector type below AVX-512 is lowered through the stack.) */
#define VW 16
#if defined(__AVX512F__)
#define NATIVE 16
#elif defined(__AVX2__)
#define NATIVE 8
#else
#define NATIVE 4
#endif
#define PARTS (VW / NATIVE)
typedef float vn __attribute__((vector_size(NATIVE * 4)));
typedef float vn_unaligned __attribute__((vector_size(NATIVE * 4), aligned(4)));
typedef struct { vn part[PARTS]; } vf;
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16_unaligned __attribute__((vector_size(16), aligned(1)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
#define INLINE static inline __attribute__((always_inline))

/* The type codes quant_matmul.py passes (its QTYPE_CODES). */
enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, I8, NUM_TYPES };
/* Up to this many rows of x the decode shape runs; past it the tiled one. */
#define GEMV_MAX_M 4
#define GEMV_ROWS_PER_TASK 16
/* The decode shape asks for the weight row this many rows ahead of the one it multiplies: a
 * decode step reads each weight once, from memory, and these VMs' hardware prefetchers left the
 * stream latency-bound. SmolLM2's decode step (all layers and the LM head, in order, 2 threads):
 * 14.5 ms without, 10.8 with (medians of three runs each, alternating). */
#define PREFETCH_ROWS 6
#define TILE_COLS 1536
/* The tiled shape's register blocks. AVX-512's 32 registers hold 4 x 4 dot-product accumulators
 * (MR rows of x by NR weight rows). The 16 of AVX2 and SSE hold XB rows of x (two vectors) by 6
 * weight rows: 12 accumulators, the two x vectors and a broadcast weight, where two loads and six
 * broadcasts feed twelve multiply-adds, and no dot product ends in a horizontal sum. SmolLM2's
 * decode step at 16 rows (all layers and the LM head, AVX2 EPYC, alternating): 40 ms, where 2 x 2
 * dot products of 16-lane pairs took 66 (4 x 2 of single vectors: about 12 % better than those). */
#if defined(__AVX512F__)
#define TILE_ROWS 8
#define MR 4
#define NR 4
#else
#define TILE_ROWS 12
#define XB (2 * NATIVE)
#endif
/* Below this many multiply-adds a parallel region costs more than it saves. */
#define PARALLEL_MIN 65536
/* The decode shape's per-unit sums of x sit on the stack (32 KiB); wider rows take the tiled shape. */
#define UNIT_SUMS_MAX 2048

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
#if defined(__F16C__) /* else: the bits rebuilt by hand, exact for every half including subnormals */
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

/* Every half's float value: the decode shape reads its scales from here, a load where a
 * conversion costs two shuffles and a convert per block. Filled by the library's constructor. */
static float HALF_TO_FLOAT[1 << 16];

__attribute__((constructor)) static void fill_half_table(void)
{
    for (uint32_t h = 0; h < (1u << 16); h++) {
        const uint8_t bytes[2] = {(uint8_t)h, (uint8_t)(h >> 8)};
        HALF_TO_FLOAT[h] = half_to_float(bytes);
    }
}

INLINE float half_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return HALF_TO_FLOAT[h];
}

INLINE vf load(const float *p)
{
    vf v;
    for (int i = 0; i < PARTS; i++)
        v.part[i] = *(const vn_unaligned *)(p + NATIVE * i);
    return v;
}

INLINE void store(float *p, vf v)
{
    for (int i = 0; i < PARTS; i++)
        *(vn_unaligned *)(p + NATIVE * i) = v.part[i];
}

INLINE vf zero(void) { return (vf){0}; }

INLINE vf splat(float f)
{
    vf v;
    for (int i = 0; i < PARTS; i++)
        v.part[i] = (vn){0} + f;
    return v;
}

INLINE vf add(vf a, vf b)
{
    for (int i = 0; i < PARTS; i++)
        a.part[i] += b.part[i];
    return a;
}

/* acc + a * b, lane by lane (one fused multiply-add where the level has them). */
INLINE vf multiply_add(vf acc, vf a, vf b)
{
    for (int i = 0; i < PARTS; i++)
        acc.part[i] += a.part[i] * b.part[i];
    return acc;
}

/* scale * q + offset, lane by lane. */
INLINE vf affine(vf q, float scale, float offset)
{
    for (int i = 0; i < PARTS; i++)
        q.part[i] = scale * q.part[i] + offset;
    return q;
}

/* The lanes' sum, halving: three dependent adds for eight lanes where a running sum takes seven. */
INLINE float hsum_native(vn s)
{
    float lanes[NATIVE];
    memcpy(lanes, &s, sizeof lanes);
    for (int width = NATIVE / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++)
            lanes[i] += lanes[i + width];
    return lanes[0];
}

INLINE float hsum(vf v)
{
    vn s = v.part[0];
    for (int i = 1; i < PARTS; i++)
        s += v.part[i];
    return hsum_native(s);
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

INLINE u8x16 bytes16(const uint8_t *p) { return *(const u8x16_unaligned *)p; }

/* 16 int32 lanes, parted like vf. The nibble types widen their 16 bytes once and split the
 * nibbles in 32-bit lanes (an AND, a shift), so one widening serves 32 weights; widening is a
 * shuffle, the scarcest of the operations a block needs. */
typedef int32_t vn_int __attribute__((vector_size(NATIVE * 4)));
typedef struct { vn_int part[PARTS]; } vi;

INLINE vi lanes_and(vi v, int32_t mask)
{
    for (int i = 0; i < PARTS; i++)
        v.part[i] &= mask;
    return v;
}

INLINE vi lanes_shift_right(vi v, int bits)
{
    for (int i = 0; i < PARTS; i++)
        v.part[i] >>= bits;
    return v;
}

INLINE vi lanes_minus(vi v, int32_t k)
{
    for (int i = 0; i < PARTS; i++)
        v.part[i] -= k;
    return v;
}

INLINE vf to_float(vi v)
{
    vf f;
    for (int i = 0; i < PARTS; i++)
        f.part[i] = __builtin_convertvector(v.part[i], vn);
    return f;
}

/* The 16 bytes at p (unsigned or signed) as int32 lanes; at AVX2 two 8-byte loads, each widened
 * straight from memory. Each level widens with its own instructions: GCC's generic conversion
 * goes one lane at a time. */
#if defined(__AVX512F__)
INLINE vi widen(const uint8_t *p) { return (vi){{(vn_int)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))}}; }
INLINE vi widen_signed(const uint8_t *p) { return (vi){{(vn_int)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))}}; }
#elif defined(__AVX2__)
INLINE vi widen(const uint8_t *p)
{
    return (vi){{(vn_int)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                 (vn_int)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))}};
}
INLINE vi widen_signed(const uint8_t *p)
{
    return (vi){{(vn_int)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                 (vn_int)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))}};
}
#elif defined(__SSE2__)
INLINE vi widen(const uint8_t *p)
{
    const __m128i zero = _mm_setzero_si128(), q = _mm_loadu_si128((const __m128i *)p),
                  lo = _mm_unpacklo_epi8(q, zero), hi = _mm_unpackhi_epi8(q, zero);
    return (vi){{(vn_int)_mm_unpacklo_epi16(lo, zero), (vn_int)_mm_unpackhi_epi16(lo, zero),
                 (vn_int)_mm_unpacklo_epi16(hi, zero), (vn_int)_mm_unpackhi_epi16(hi, zero)}};
}
INLINE vi widen_signed(const uint8_t *p)
{
    /* Each byte into the top of a 32-bit lane; the arithmetic shift sign-extends it. */
    const __m128i q = _mm_loadu_si128((const __m128i *)p), lo = _mm_unpacklo_epi8(q, q), hi = _mm_unpackhi_epi8(q, q);
    return (vi){{(vn_int)_mm_srai_epi32(_mm_unpacklo_epi16(lo, lo), 24), (vn_int)_mm_srai_epi32(_mm_unpackhi_epi16(lo, lo), 24),
                 (vn_int)_mm_srai_epi32(_mm_unpacklo_epi16(hi, hi), 24), (vn_int)_mm_srai_epi32(_mm_unpackhi_epi16(hi, hi), 24)}};
}
#else
INLINE vi widen(const uint8_t *p)
{
    vi v;
    for (int i = 0; i < VW; i++)
        v.part[i / NATIVE][i % NATIVE] = p[i];
    return v;
}
INLINE vi widen_signed(const uint8_t *p)
{
    vi v;
    for (int i = 0; i < VW; i++)
        v.part[i / NATIVE][i % NATIVE] = (int8_t)p[i];
    return v;
}
#endif

/* Bytes computed in registers (the five- and six-bit types), widened through memory: a store
 * and two widening loads cost less than the register shuffles that would split them. */
INLINE vi widen_value(u8x16 q) { return widen((const uint8_t *)&q); }
INLINE vi widen_signed_value(u8x16 q) { return widen_signed((const uint8_t *)&q); }

/* Bits 0..15 (half 0) or 16..31 (half 1) of the 32 bits at qh, one per lane, as 0 or 16. */
INLINE u8x16 fifth_bits(const uint8_t *qh, int half)
{
    const u8x16 mask = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const u8x16 two = {qh[2 * half], qh[2 * half + 1]};
    const u8x16 spread = __builtin_shuffle(two, (u8x16){0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1});
    return (u8x16)((spread & mask) != 0) & 16;
}

/* A block's weights come in units that share one scale and one offset: 32 weights, but 16 for
 * Q6_K (and for int8 the row's scale). Weight i of unit u is scale * q_i + offset, q_i an integer. */
INLINE int unit_size(const int t) { return t == Q6_K ? 16 : 32; }
INLINE int has_offset(const int t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }

INLINE void unit_scale(const int t, const uint8_t *restrict b, const int u, float row_scale, float *scale, float *offset)
{
    *offset = 0.0f;
    switch (t) {
    case Q4_1: case Q5_1:
        *offset = half_at(b + 2);
        /* fall through */
    case Q4_0: case Q5_0: case Q8_0:
        *scale = half_at(b);
        return;
    case Q4_K: case Q5_K: { /* eight sub-blocks of 32, each a six-bit scale and min */
        float sub_scale, sub_min;
        k_scale_min(b + 4, u, &sub_scale, &sub_min);
        *scale = half_at(b) * sub_scale;
        *offset = -(half_at(b + 2) * sub_min);
        return;
    }
    case Q6_K: /* sixteen int8 scales, one per 16 weights */
        *scale = half_at(b + 208) * (float)(int8_t)b[192 + u];
        return;
    default:
        *scale = row_scale;
    }
}

/* The integers q of weights [16 g, 16 g + 16) of one block of type t, as gguf's layouts store them. */
INLINE vf group_quants(const int t, const uint8_t *restrict b, const int g)
{
    switch (t) {
    case Q4_0: /* byte i: weight i in its low nibble, weight i + 16 in its high one */
        return to_float(lanes_minus(g ? lanes_shift_right(widen(b + 2), 4) : lanes_and(widen(b + 2), 15), 8));
    case Q4_1:
        return to_float(g ? lanes_shift_right(widen(b + 4), 4) : lanes_and(widen(b + 4), 15));
    case Q5_0: {
        const u8x16 q = bytes16(b + 6);
        return to_float(lanes_minus(widen_value((g ? q >> 4 : q & 15) | fifth_bits(b + 2, g)), 16));
    }
    case Q5_1: {
        const u8x16 q = bytes16(b + 8);
        return to_float(widen_value((g ? q >> 4 : q & 15) | fifth_bits(b + 4, g)));
    }
    case Q8_0:
        return to_float(widen_signed(b + 2 + 16 * g));
    case Q4_K: { /* 4 runs of 64 weights: 32 bytes, their low nibbles sub-block 2c, their high ones 2c + 1 */
        const int c = g / 4, high = (g / 2) & 1, part = g & 1;
        const vi q = widen(b + 16 + 32 * c + 16 * part);
        return to_float(high ? lanes_shift_right(q, 4) : lanes_and(q, 15));
    }
    case Q5_K: {
        const int c = g / 4, high = (g / 2) & 1, part = g & 1;
        const u8x16 qs = bytes16(b + 48 + 32 * c + 16 * part);
        const u8x16 q = (high ? qs >> 4 : qs & 15) | ((bytes16(b + 16 + 16 * part) >> (2 * c + high)) & 1) << 4;
        return to_float(widen_value(q));
    }
    case Q6_K: {
        /* Two runs of 128: weight l + 32 k (l < 32) takes the low (k even) or high nibble of
         * ql[l + 32 (k & 1)] and bits 2k, 2k + 1 of qh[l]. */
        const int half = g / 8, k = (g / 2) & 3, part = g & 1;
        const uint8_t *ql = b + 64 * half + 32 * (k & 1) + 16 * part, *qh = b + 128 + 32 * half + 16 * part;
        const u8x16 low = k < 2 ? bytes16(ql) & 15 : bytes16(ql) >> 4;
        return to_float(widen_signed_value((low | (((bytes16(qh) >> (2 * k)) & 3) << 4)) - 32));
    }
    default: /* I8: 16 weights of one row */
        return to_float(widen_signed(b + 16 * g));
    }
}

/* Weights [16 g, 16 g + 16) of one block of type t, each as gguf's dequantizer computes it. */
INLINE vf dequantize_group(const int t, const uint8_t *restrict b, const int g, float row_scale)
{
    float scale, offset;
    unit_scale(t, b, g * 16 / unit_size(t), row_scale, &scale, &offset);
    return affine(group_quants(t, b, g), scale, offset);
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
    const float *unit_sums;    /* decode shape, types with offsets: [m, cols / 32], x summed per unit */
    const float *xt;           /* tiled shape below AVX-512: x transposed, [ceil(m / XB)][cols][XB] */
};

/* Columns [k0, k0 + n) of weight row r into w (int8's columns past its last whole block included). */
INLINE void dequantize_span(const int t, const struct problem *p, int64_t r, int64_t k0, int64_t n, float *w)
{
    const int bs = block_size(t);
    const uint8_t *row = p->w + r * p->w_stride;
    const float row_scale = t == I8 ? p->row_scales[r] : 0.0f;
    const int64_t whole = n / bs * bs;
    /* Two groups (most types' unit of 32) computed before either is stored: the stores could
     * alias the block's bytes, so a store between them made the second reload its scale and
     * widen its bytes again. */
    for (int64_t k = 0; k < whole; k += bs) {
        const uint8_t *block = row + (k0 + k) / bs * block_bytes(t);
        _Pragma("GCC unroll 8") for (int g = 0; g < bs / VW; g += 2) {
            const vf first = dequantize_group(t, block, g, row_scale), second = dequantize_group(t, block, g + 1, row_scale);
            store(w + k + VW * g, first);
            store(w + k + VW * (g + 1), second);
        }
    }
    for (int64_t k = whole; k < n; k++) /* only int8 has columns outside whole blocks */
        w[k] = row_scale * (float)(int8_t)row[k0 + k];
}

/* One unit n of a weight row (decode shape) into acc, for M rows of x: its integers converted
 * once, their dot with each row scaled once. A unit's scale and offset come out of its sum:
 * sum_i (scale q_i + offset) x_i = scale (q . x) + offset sum_i x_i, the last sum precomputed per
 * call (unit_sums), so each weight costs one multiply-add and no affine step. */
INLINE void unit_dot(const int t, const int M, const struct problem *p, const uint8_t *restrict row, int64_t n,
                     float row_scale, vf *acc, float *offsets)
{
    const int us = unit_size(t), units = block_size(t) / us, groups = us / VW;
    const uint8_t *block = row + n / units * block_bytes(t);
    float scale, offset;
    unit_scale(t, block, n % units, row_scale, &scale, &offset);
    vf q[2];
    for (int g = 0; g < groups; g++)
        q[g] = group_quants(t, block, n % units * groups + g);
    for (int m = 0; m < M; m++) {
        const float *x = p->x + m * p->x_stride + n * us;
        vf dot = zero();
        for (int g = 0; g < groups; g++)
            dot = multiply_add(dot, q[g], load(x + VW * g));
        acc[m] = multiply_add(acc[m], dot, splat(scale));
        if (has_offset(t))
            offsets[m] += offset * p->unit_sums[m * (p->cols / 32) + n];
    }
}

/* Decode shape: weight rows [r0, r1), for M (<= GEMV_MAX_M) rows of x. With one row of x, two
 * weight rows go together: their multiply-adds are independent chains, and each unit's x is
 * loaded once for both. From two rows of x on, the x rows' own chains keep the multiply-adds
 * apart, and a second weight row's accumulators spilled out of the vector registers (slower at
 * two rows of x on AVX2). */
INLINE void gemv_rows(const int t, const int M, const struct problem *p, int64_t r0, int64_t r1)
{
    enum { MAX_TOGETHER = 2 };
    const int together = M == 1 ? MAX_TOGETHER : 1;
    const int64_t units = p->cols / block_size(t) * (block_size(t) / unit_size(t)), whole = units * unit_size(t);
    const int64_t row_bytes = t == I8 ? p->cols : p->cols / block_size(t) * block_bytes(t);
    for (int64_t r = r0; r < r1; r += together) {
        const uint8_t *rows[MAX_TOGETHER];
        float row_scales[MAX_TOGETHER];
        vf acc[MAX_TOGETHER][M];
        float offsets[MAX_TOGETHER][M];
        for (int j = 0; j < together; j++) {
            const int64_t row = r + j < r1 ? r + j : r; /* past the end: row r again, not written */
            rows[j] = p->w + row * p->w_stride;
            row_scales[j] = t == I8 ? p->row_scales[row] : 0.0f;
            if (row + PREFETCH_ROWS < p->rows)
                for (int64_t line = 0; line < row_bytes; line += 64)
                    __builtin_prefetch(rows[j] + PREFETCH_ROWS * p->w_stride + line, 0, 0);
            for (int m = 0; m < M; m++) {
                acc[j][m] = zero();
                offsets[j][m] = 0.0f;
            }
        }
        for (int64_t n = 0; n < units; n++)
            for (int j = 0; j < together; j++)
                unit_dot(t, M, p, rows[j], n, row_scales[j], acc[j], offsets[j]);
        for (int j = 0; j < together && r + j < r1; j++)
            for (int m = 0; m < M; m++) {
                float sum = hsum(acc[j][m]) + offsets[j][m];
                for (int64_t k = whole; k < p->cols; k++)
                    sum += row_scales[j] * (float)(int8_t)rows[j][k] * p->x[m * p->x_stride + k];
                p->out[m * p->out_stride + r + j] = sum;
            }
    }
}

/* Tiled shape: weight rows [r0, r0 + TILE_ROWS), TILE_COLS columns at a time, dequantized once
 * into the scratch, then run against every row of x a register block at a time. Rows past the
 * weight's or x's end are computed from clamped pointers (or x's zero padding) and never written. */
#if defined(__AVX512F__)
INLINE void tile_rows(const int t, const struct problem *p, int64_t r0)
{
    float scratch[TILE_ROWS * TILE_COLS] __attribute__((aligned(64)));
    const int64_t nt = p->rows - r0 < TILE_ROWS ? p->rows - r0 : TILE_ROWS;
    for (int64_t k0 = 0; k0 < p->cols; k0 += TILE_COLS) {
        const int64_t kc = p->cols - k0 < TILE_COLS ? p->cols - k0 : TILE_COLS, vec_end = kc / NATIVE * NATIVE;
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
                vn acc[MR][NR];
                for (int i = 0; i < MR; i++)
                    for (int j = 0; j < NR; j++)
                        acc[i][j] = (vn){0};
                for (int64_t k = 0; k < vec_end; k += NATIVE) {
                    vn xv[MR], wv[NR];
                    for (int i = 0; i < MR; i++)
                        xv[i] = *(const vn_unaligned *)(xs[i] + k);
                    for (int j = 0; j < NR; j++)
                        wv[j] = *(const vn_unaligned *)(ws[j] + k);
                    for (int i = 0; i < MR; i++)
                        for (int j = 0; j < NR; j++)
                            acc[i][j] += xv[i] * wv[j];
                }
                for (int i = 0; i < MR && m0 + i < p->m; i++)
                    for (int j = 0; j < NR && n0 + j < nt; j++) {
                        float sum = hsum_native(acc[i][j]);
                        for (int64_t k = vec_end; k < kc; k++)
                            sum += xs[i][k] * ws[j][k];
                        float *o = p->out + (m0 + i) * p->out_stride + r0 + n0 + j;
                        *o = k0 ? *o + sum : sum;
                    }
            }
        }
    }
}
#else
INLINE vn broadcast(const float *f)
{
#if defined(__AVX__)
    return _mm256_broadcast_ss(f);
#else
    return _mm_load1_ps(f);
#endif
}

/* Rows [m0, m0 + V * NATIVE) of x (V vectors of each k step of its transposed block) against
 * weight rows [0, nt) of the scratch, 12 / V of them at a time: twelve accumulators either way, so
 * that a last block of at most NATIVE rows (all of a batch of 8 on AVX2) multiplies no padding. */
INLINE void tile_block(const struct problem *p, const float *scratch, int64_t nt, int64_t k0, int64_t kc,
                       int64_t m0, int64_t r0, const int V)
{
    enum { ACC = 12 };
    const int nb = ACC / V;
    const float *xt = p->xt + (m0 / XB * p->cols + k0) * XB;
    for (int64_t n0 = 0; n0 < nt; n0 += nb) {
        const float *ws[ACC];
        for (int j = 0; j < nb; j++)
            ws[j] = scratch + (n0 + j < nt ? n0 + j : nt - 1) * TILE_COLS;
        vn acc[ACC];
        for (int a = 0; a < ACC; a++)
            acc[a] = (vn){0};
        for (int64_t k = 0; k < kc; k++) {
            vn xv[2];
            for (int v = 0; v < V; v++)
                xv[v] = *(const vn *)(xt + k * XB + v * NATIVE);
            for (int j = 0; j < nb; j++) {
                const vn w = broadcast(ws[j] + k);
                for (int v = 0; v < V; v++)
                    acc[j * V + v] += xv[v] * w;
            }
        }
        /* Copied out with constant indices: indexing acc by a variable kept it in memory, stored
         * on every step of the loop above. */
        float sums[ACC][NATIVE];
        _Pragma("GCC unroll 16") for (int a = 0; a < ACC; a++)
            memcpy(sums[a], &acc[a], sizeof acc[a]);
        /* A row of out at a time, its nb outputs side by side; a whole block in constant bounds,
         * unrolled (variable bounds would index acc by a variable: see above). */
        if (p->m - m0 >= V * NATIVE && nt - n0 >= nb) {
            _Pragma("GCC unroll 16") for (int i = 0; i < V * NATIVE; i++) {
                float *o = p->out + (m0 + i) * p->out_stride + r0 + n0;
                _Pragma("GCC unroll 12") for (int j = 0; j < nb; j++)
                    o[j] = k0 ? o[j] + sums[j * V + i / NATIVE][i % NATIVE] : sums[j * V + i / NATIVE][i % NATIVE];
            }
        } else {
            for (int j = 0; j < nb && n0 + j < nt; j++)
                for (int i = 0; i < V * NATIVE && m0 + i < p->m; i++) {
                    float *o = p->out + (m0 + i) * p->out_stride + r0 + n0 + j;
                    const float sum = sums[j * V + i / NATIVE][i % NATIVE];
                    *o = k0 ? *o + sum : sum;
                }
        }
    }
}

INLINE void tile_rows(const int t, const struct problem *p, int64_t r0)
{
    float scratch[TILE_ROWS * TILE_COLS] __attribute__((aligned(64)));
    const int64_t nt = p->rows - r0 < TILE_ROWS ? p->rows - r0 : TILE_ROWS;
    for (int64_t k0 = 0; k0 < p->cols; k0 += TILE_COLS) {
        const int64_t kc = p->cols - k0 < TILE_COLS ? p->cols - k0 : TILE_COLS;
        for (int64_t n = 0; n < nt; n++)
            dequantize_span(t, p, r0 + n, k0, kc, scratch + n * TILE_COLS);
        for (int64_t m0 = 0; m0 < p->m; m0 += XB) {
            if (p->m - m0 > NATIVE)
                tile_block(p, scratch, nt, k0, kc, m0, r0, 2);
            else
                tile_block(p, scratch, nt, k0, kc, m0, r0, 1);
        }
    }
}

/* Columns [k_begin, k_end) of x [m, cols] into xt: blocks of XB rows, each [cols][XB] (one step of
 * the micro-kernel's k loop reads XB consecutive floats), rows past m zero. Written in the order
 * the micro-kernel reads it: a column of a block at a time (a store every 64 bytes) took 3x as
 * long. */
static void transpose_columns(float *xt, const float *x, int64_t x_stride, int64_t m, int64_t cols, int64_t k_begin,
                              int64_t k_end)
{
    for (int64_t b = 0; b < (m + XB - 1) / XB; b++) {
        const int64_t live = m - b * XB < XB ? m - b * XB : XB;
        const float *rows = x + b * XB * x_stride;
        float *dst = xt + (b * cols + k_begin) * XB;
        for (int64_t k = k_begin; k < k_end; k++, dst += XB) {
            for (int64_t i = 0; i < live; i++)
                dst[i] = rows[i * x_stride + k];
            for (int64_t i = live; i < XB; i++)
                dst[i] = 0.0f;
        }
    }
}
#endif

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
    static void tile_##T(const struct problem *p, int64_t r0) { tile_rows(T, p, r0); }       \
    static void dequantize_##T(const struct problem *p, int64_t r)                           \
    {                                                                                       \
        dequantize_span(T, p, r, 0, p->cols, p->out + r * p->out_stride);                   \
    }
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
typedef void (*row_fn)(const struct problem *, int64_t);
static const row_fn DEQUANTIZE[NUM_TYPES] = {dequantize_Q4_0, dequantize_Q4_1, dequantize_Q5_0, dequantize_Q5_1,
                                              dequantize_Q8_0, dequantize_Q4_K, dequantize_Q5_K, dequantize_Q6_K,
                                              dequantize_I8};

/* The caller (quant_matmul.py) has checked the shapes: cols in whole blocks (int8: any), x and
 * out with contiguous rows. Returns 1 for an unknown type code, 2 when out of memory, touching
 * nothing. */
int quant_matmul_f32(int qtype, const uint8_t *w, int64_t w_stride, const float *row_scales, int64_t rows,
                     int64_t cols, const float *x, int64_t x_stride, int64_t m, float *out, int64_t out_stride,
                     int threads)
{
    if (qtype < 0 || qtype >= NUM_TYPES)
        return 1;
    struct problem p = {w, w_stride, row_scales, rows, cols, x, x_stride, m, out, out_stride, 0};
    const int parallel = threads > 1 && rows * cols * m >= PARALLEL_MIN;
    if (m <= 0 || rows <= 0)
        return 0;
    if (m <= GEMV_MAX_M && cols / 32 <= UNIT_SUMS_MAX) {
        float unit_sums[GEMV_MAX_M * UNIT_SUMS_MAX];
        if (has_offset(qtype)) {
            for (int64_t i = 0; i < m; i++)
                for (int64_t u = 0; u < cols / 32; u++) {
                    const float *xs = x + i * x_stride + 32 * u;
                    unit_sums[i * (cols / 32) + u] = hsum(add(load(xs), load(xs + VW)));
                }
            p.unit_sums = unit_sums;
        }
        const gemv_fn gemv = GEMV[qtype];
        const int64_t tasks = (rows + GEMV_ROWS_PER_TASK - 1) / GEMV_ROWS_PER_TASK;
        #pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t r0 = task * GEMV_ROWS_PER_TASK;
            gemv(&p, r0, r0 + GEMV_ROWS_PER_TASK < rows ? r0 + GEMV_ROWS_PER_TASK : rows);
        }
    } else {
#if !defined(__AVX512F__)
        float *xt = aligned_alloc(64, (size_t)(((m + XB - 1) / XB * cols * XB * 4 + 63) / 64 * 64));
        if (xt == NULL)
            return 2;
        p.xt = xt;
#endif
        const tile_fn tile = TILE[qtype];
        const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
        #pragma omp parallel num_threads(threads) if (parallel)
        {
#if !defined(__AVX512F__)
            /* Each thread transposes a share of x's columns, rather than one thread all of it
             * while the others wait: every tile reads all of it. */
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            transpose_columns(xt, x, x_stride, m, cols, cols * me / team, cols * (me + 1) / team);
            #pragma omp barrier
#endif
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < tiles; i++)
                tile(&p, i * TILE_ROWS);
        }
#if !defined(__AVX512F__)
        free(xt);
#endif
    }
    return 0;
}

/* out[rows, cols] (rows out_stride apart) = W dequantized: what the tiled shape's scratch holds,
 * for the whole weight. Returns 1 for an unknown type code, touching nothing. */
int quant_dequantize_f32(int qtype, const uint8_t *w, int64_t w_stride, const float *row_scales, int64_t rows,
                         int64_t cols, float *out, int64_t out_stride, int threads)
{
    if (qtype < 0 || qtype >= NUM_TYPES)
        return 1;
    const struct problem p = {w, w_stride, row_scales, rows, cols, 0, 0, 0, out, out_stride};
    const row_fn dequantize = DEQUANTIZE[qtype];
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * cols >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        dequantize(&p, r);
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
