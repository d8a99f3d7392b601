/* The decode step's small ops for a CPU, float32, each one pass over its rows instead of several
 * torch ops: RMSNorm (with the residual add before it), the rotary embedding, the gated MLP's
 * activation, the KV cache write, and the greedy argmax over the logits.
 *
 * Built by build.py; called through fused_ops.py, which checks dtypes and layouts. Every tensor
 * comes as a pointer plus its row strides (in elements); the last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The reference rounds every product on its own (x * cos, then + or -): no fused multiply-add,
 * so the rotation is bitwise the torch path's. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* Below this many elements a parallel region costs more than it saves. A sixteen-row decode
 * step's norms, rotations and activations are past it: run on one thread (at 65536), they kept
 * the other waiting, and SmolLM2's step took 1.2 % longer. */
#define PARALLEL_MIN 4096

/* For each row r: s = x[r] (+ residual[r], written back to residual[r] when residual is given),
 * out[r] = weight * (s / sqrt(mean(s^2) + eps)). out may be x: each row is read before it is
 * written. */
void rms_norm_f32(float *out, int64_t out_stride, const float *x, int64_t x_stride, float *residual,
                  int64_t residual_stride, const float *weight, int64_t rows, int64_t hidden, float eps,
                  int threads)
{
    #pragma omp parallel for num_threads(threads) if (rows * hidden >= PARALLEL_MIN && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * x_stride;
        float *dst = out + r * out_stride;
        if (residual) {
            float *sum = residual + r * residual_stride;
            #pragma omp simd
            for (int64_t i = 0; i < hidden; i++)
                sum[i] += src[i];
            src = sum;
        }
        float squares = 0.0f;
        #pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; i++)
            squares += src[i] * src[i];
        const float inv_rms = 1.0f / sqrtf(squares / (float)hidden + eps);
        #pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            dst[i] = weight[i] * (src[i] * inv_rms);
    }
}

/* Rotates x [tokens, heads, 2 * half] in place, the half-split ("neox") form:
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), angles from row positions[t] of the tables
 * cos, sin [num_positions, >= half]. Returns 1, touching nothing, if a position is outside the
 * tables. */
int rotary_f32(float *x, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads, int64_t half,
               const int64_t *positions, const float *cos_table, const float *sin_table, int64_t table_stride,
               int64_t num_positions, int threads)
{
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions)
            return 1;
    #pragma omp parallel for num_threads(threads) if (tokens * heads * half >= PARALLEL_MIN && threads > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * table_stride;
        const float *s = sin_table + positions[t] * table_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * token_stride + h * head_stride;
            float *x2 = x1 + half;
            #pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
    return 0;
}

/* One machine register of floats (GNU C vector extensions), and as many int32 lanes. */
#if defined(__AVX512F__)
typedef float lanes_f32 __attribute__((vector_size(64)));
#elif defined(__AVX__)
typedef float lanes_f32 __attribute__((vector_size(32)));
#else
typedef float lanes_f32 __attribute__((vector_size(16)));
#endif
typedef int32_t lanes_i32 __attribute__((vector_size(sizeof(lanes_f32))));
#define LANES ((int64_t)(sizeof(lanes_f32) / sizeof(float)))

static inline lanes_f32 select_lanes(const lanes_i32 mask, const lanes_f32 yes, const lanes_f32 no)
{
    return (lanes_f32)((mask & (lanes_i32)yes) | (~mask & (lanes_i32)no));
}

/* e**x lane by lane, within a few float32 roundings of expf (libm's is a scalar call per
 * element, most of a decode's MLP activation): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in
 * two so that n ln2's high part is exact), a degree-7 Taylor polynomial for e**r, and 2**n from
 * the exponent bits. x is clamped to [-87, 88], where 2**n stays a normal float: beyond, silu's
 * quotient is 0 or x within float32's precision. */
static inline lanes_f32 exp_lanes(lanes_f32 x)
{
    const lanes_f32 low = (lanes_f32){0} - 87.0f, high = (lanes_f32){0} + 88.0f;
    x = select_lanes(x < low, low, x);
    x = select_lanes(x > high, high, x);
    /* Adding and subtracting 1.5 * 2**23 rounds to the nearest integer in float arithmetic. */
    const lanes_f32 n = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
    const lanes_f32 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    /* Horner's rule over the coefficients 1 / 7!, ..., 1 / 1!, 1 / 0!. */
    static const float taylor[] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    lanes_f32 p = (lanes_f32){0} + taylor[0];
    for (int i = 1; i < 8; i++) p = p * r + taylor[i];
    const lanes_i32 bits = (__builtin_convertvector(n, lanes_i32) + 127) << 23;
    return p * (lanes_f32)bits;
}

/* out[r, j] = silu(x[r, j]) * x[r, width + j] for each row r of x [rows, 2 * width]: the gated
 * MLP's activation of its fused gate and up projections. */
void silu_and_mul_f32(float *out, int64_t out_stride, const float *x, int64_t x_stride, int64_t rows,
                      int64_t width, int threads)
{
    #pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_MIN && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + width;
        float *dst = out + r * out_stride;
        int64_t j = 0;
        for (; j + LANES <= width; j += LANES) {
            lanes_f32 g, u;
            memcpy(&g, gate + j, sizeof g);
            memcpy(&u, up + j, sizeof u);
            const lanes_f32 v = g / (1.0f + exp_lanes(-g)) * u;
            memcpy(dst + j, &v, sizeof v);
        }
        for (; j < width; j++)
            dst[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

/* Copies row t of k and of v (row_size elements of element_size bytes each) into slot slots[t] of
 * the key and value caches [num_slots, row_size] (a layer's [num_blocks, block_size, kv_heads,
 * head_dim] seen flat); strides are in elements. A copy of bytes, so one function serves every
 * dtype. Returns 1, touching nothing, if a slot is outside the caches. Several rows may share a
 * slot (padding requests all write slot 0 of the null block): the last one wins. */
int kv_cache_write(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *key_cache,
                   char *value_cache, const int64_t *slots, int64_t tokens, int64_t row_size,
                   int64_t element_size, int64_t num_slots)
{
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return 1;
    const size_t bytes = (size_t)(row_size * element_size);
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(key_cache + slots[t] * (int64_t)bytes, k + t * k_stride * element_size, bytes);
        memcpy(value_cache + slots[t] * (int64_t)bytes, v + t * v_stride * element_size, bytes);
    }
    return 0;
}

/* The index of row r's largest entry, torch.argmax's: the first one among equals, and the first
 * NaN where there is one (NaN counts as the largest). Each lane keeps the first maximum of its
 * own columns (a strict >), so the row's first maximum is the smallest index among the lanes
 * holding the largest value; columns past the last whole vector come after every lane's. The
 * lanes are one machine register: 16 of them on an AVX2 machine went through the stack, and a
 * sixteen-row decode step's argmax took ten times as long. */
static int64_t argmax_row(const float *x, int64_t cols)
{
    int64_t best = 0;
    float best_value = x[0];
    int64_t start = 0;
    int has_nan = 0;
    if (cols >= LANES) {
        lanes_f32 values;
        lanes_i32 indices, lane_indices, nan = {0};
        memcpy(&values, x, sizeof values);
        for (int j = 0; j < LANES; j++)
            indices[j] = j;
        lane_indices = indices;
        start = cols - cols % LANES;
        for (int64_t i = LANES; i < start; i += LANES) {
            lanes_f32 v;
            memcpy(&v, x + i, sizeof v);
            lane_indices += (int32_t)LANES;
            const lanes_i32 greater = v > values;
            nan |= v != v;
            values = select_lanes(greater, v, values);
            indices = (lane_indices & greater) | (indices & ~greater);
        }
        nan |= values != values;
        for (int j = 0; j < LANES; j++)
            has_nan |= nan[j];
        best_value = values[0];
        best = indices[0];
        for (int j = 1; j < LANES; j++)
            if (values[j] > best_value || (values[j] == best_value && indices[j] < best)) {
                best_value = values[j];
                best = indices[j];
            }
    }
    if (has_nan)
        for (int64_t i = 0; i < start; i++)
            if (x[i] != x[i])
                return i;
    for (int64_t i = start; i < cols; i++) {
        if (x[i] != x[i])
            return i;
        if (x[i] > best_value) {
            best_value = x[i];
            best = i;
        }
    }
    return best;
}

/* out[r] = argmax of row r of x [rows, cols] (row stride x_stride), as argmax_row. */
void argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out, int threads)
{
    #pragma omp parallel for num_threads(threads) if (rows * cols >= 4 * PARALLEL_MIN && threads > 1)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_row(x + r * x_stride, cols);
}
