/* LoRA for a batch that mixes adapters, float32 (kernels/lora.py states the operation and holds
 * its torch reference): for each row t whose slot s = slots[t] is not -1,
 *     y[t] += scales[s] * (x[t] . lora_a[s]^T) . lora_b[s]^T
 * in two passes: a shrink to each row's rank, then an expand to the output columns.
 *
 * Built by build.py; called through lora.py, which checks shapes, dtypes and slots (and so does
 * this file, for the slots: a wrong index must not read another process's memory). lora_a is
 * [slots, rank, in] and lora_b [slots, out, rank], contiguous; x and y come with row strides.
 */
#include <stdint.h>
#include <stdlib.h>

/* Below this many multiply-adds a parallel region costs more than it saves. */
#define PARALLEL_MIN 65536
/* Adapter ranks one shrink pass computes together, sharing each load of the input row. */
#define RANK_BLOCK 4
/* Output columns one expand tile covers: a vector register or two. */
#define OUT_BLOCK 16

/* sums[k] = x . rows[k] for the `count` (at most RANK_BLOCK) consecutive rows of length n. */
static inline void dots(const float *x, const float *rows, int64_t n, int64_t count, float *sums)
{
    if (count == RANK_BLOCK) {
        const float *r0 = rows, *r1 = rows + n, *r2 = rows + 2 * n, *r3 = rows + 3 * n;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        #pragma omp simd reduction(+:s0, s1, s2, s3)
        for (int64_t i = 0; i < n; i++) {
            float xi = x[i];
            s0 += xi * r0[i];
            s1 += xi * r1[i];
            s2 += xi * r2[i];
            s3 += xi * r3[i];
        }
        sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
        return;
    }
    for (int64_t k = 0; k < count; k++) {
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < n; i++)
            sum += x[i] * rows[k * n + i];
        sums[k] = sum;
    }
}

/* 0, or 1 for a slot out of range, 2 when out of memory. */
int lora_apply_f32(float *y, int64_t y_stride, const float *x, int64_t x_stride, const float *lora_a,
                   const float *lora_b, const int64_t *slots, const float *scales, int64_t tokens,
                   int64_t in, int64_t out, int64_t rank, int64_t num_slots, int threads)
{
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < -1 || slots[t] >= num_slots)
            return 1;
    float *shrunk = malloc((size_t)(tokens * rank > 0 ? tokens * rank : 1) * sizeof(float));
    /* Which slots some row uses: the expand visits only those. */
    char *used = calloc((size_t)(num_slots > 0 ? num_slots : 1), 1);
    if (!shrunk || !used) {
        free(shrunk);
        free(used);
        return 2;
    }
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= 0)
            used[slots[t]] = 1;
    int parallel = threads > 1 && tokens * rank * (in + out) >= PARALLEL_MIN;

    /* Each row's shrink is rank dot products over the input, RANK_BLOCK at a time so that each
     * load of the row feeds several; (row, block) pairs are independent, so both loops split. */
    int64_t rank_blocks = (rank + RANK_BLOCK - 1) / RANK_BLOCK;
    #pragma omp parallel for collapse(2) num_threads(threads) if (parallel)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t block = 0; block < rank_blocks; block++) {
            int64_t slot = slots[t];
            if (slot < 0)
                continue;
            int64_t j = block * RANK_BLOCK, count = rank - j < RANK_BLOCK ? rank - j : RANK_BLOCK;
            float sums[RANK_BLOCK];
            dots(x + t * x_stride, lora_a + (slot * rank + j) * in, in, count, sums);
            for (int64_t k = 0; k < count; k++)
                shrunk[t * rank + j + k] = sums[k] * scales[slot];
        }
    }

    /* Split over blocks of output columns: a decode step has few rows and many columns. Each
     * block of lora_b's rows (contiguous, [OUT_BLOCK, rank]) is transposed once per slot into a
     * tile, so that every row using that slot adds rank vectors of OUT_BLOCK outputs: FMAs across
     * the outputs, with no per-output reduction over the (short) rank. */
    #pragma omp parallel for num_threads(threads) if (parallel)
    for (int64_t first = 0; first < out; first += OUT_BLOCK) {
        int64_t width = out - first < OUT_BLOCK ? out - first : OUT_BLOCK;
        float tile[rank][OUT_BLOCK];
        for (int64_t slot = 0; slot < num_slots; slot++) {
            if (!used[slot])
                continue;
            const float *b = lora_b + (slot * out + first) * rank;
            for (int64_t j = 0; j < rank; j++)
                for (int64_t k = 0; k < OUT_BLOCK; k++)
                    tile[j][k] = k < width ? b[k * rank + j] : 0.0f;
            for (int64_t t = 0; t < tokens; t++) {
                if (slots[t] != slot)
                    continue;
                const float *v = shrunk + t * rank;
                float acc[OUT_BLOCK] = {0.0f};
                for (int64_t j = 0; j < rank; j++) {
                    #pragma omp simd
                    for (int64_t k = 0; k < OUT_BLOCK; k++)
                        acc[k] += v[j] * tile[j][k];
                }
                float *row = y + t * y_stride + first;
                for (int64_t k = 0; k < width; k++)
                    row[k] += acc[k];
            }
        }
    }
    free(used);
    free(shrunk);
    return 0;
}
