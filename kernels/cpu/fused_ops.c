/* The decoder layer's small fused ops for a CPU, float32: RMSNorm (with the residual add before
 * it) and the rotary embedding, each one pass over its rows instead of several torch ops.
 *
 * Built by build.py; called through fused_ops.py, which checks dtypes and layouts. Every tensor
 * comes as a pointer plus its row strides (in elements); the last dimension is contiguous.
 */
#include <math.h>
#include <stdint.h>

/* The reference rounds every product on its own (x * cos, then + or -): no fused multiply-add,
 * so the rotation is bitwise the torch path's. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* Below this many elements a parallel region costs more than it saves. */
#define PARALLEL_MIN 65536

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
