/* Paged attention on a CPU, reading K/V in place through the block tables.
 *
 * The contract of kernels/paged_attention.py (the Triton kernel), for a packed step of decodes
 * and prefill chunks: request i's queries are rows query_start_loc[i] .. query_start_loc[i+1] of
 * q, the last of its seq_lens[i] context tokens; key j of request i sits in page
 * block_tables[i][j / block_size], slot j % block_size. Query n of a request with q_len queries
 * sees keys 0 .. seq_len - q_len + n (causal within a chunk, everything cached before it).
 *
 * A work item is (request, KV head, tile of queries), or for a decode (request, all KV heads,
 * tile); its rows are the tile's queries times the query heads of its KV heads (GQA), so every
 * key and value row is read from the cache once per item and dotted with all of the rows of its
 * head, with no repeated or gathered K/V. The keys are taken in chunks of KEY_CHUNK, each chunk
 * one online-softmax update (running max and sum, base 2, all float32). Causality is a per-row
 * bound on the keys, never a mask: no -inf enters the arithmetic, and keys past a row's bound
 * (or past the context, where the null block pads the table) are never read. Threads take runs
 * of consecutive items, and prefetch the next item's rows while they compute the current one.
 *
 * Scores: a decode tile (few rows) multiplies each query row with LANES key rows and reduces the
 * LANES product vectors together; a prefill tile copies the chunk's keys transposed once and
 * scores four rows at a time against it (multiply-adds vectorised over the keys). Values are
 * accumulated a whole row of head_dim at a time. The vectors are written with GNU C vector
 * extensions (below); exp2 is a polynomial the compiler vectorises (libm's expf is a scalar
 * call). No -ffast-math: sums keep float32 semantics.
 *
 * The same kernel reads bfloat16 tensors (q, the caches and out all bfloat16): each element is
 * widened to float32 as it is loaded (a bfloat16 is the top half of a float32, so the widening is
 * an exact shift), everything after the load is the float32 arithmetic above, and out is rounded
 * to nearest even once at the end, as torch rounds. Half the cache bytes are read per key.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

/* Keys per online-softmax update: enough to amortise the rescaling of the accumulators (64
 * decoded 1.3x faster than 32, and 128 slower again: the scores leave L1). */
#define KEY_CHUNK 64
/* Floats of query rows a work item holds (rows x head_dim): 64 rows of 128, L1/L2-resident. */
#define ROW_FLOATS 8192
#define MAX_ROWS 64
#define LOG2E 1.4426950408889634f

enum { OK = 0, BAD_HEADS = 1, BAD_HEAD_DIM = 2, OUT_OF_MEMORY = 3 };

typedef struct {
    const void *q, *key_cache, *value_cache; /* float32, or bfloat16 (uint16_t) in the bf16 entry */
    void *out;
    int64_t element_size;
    int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
    int64_t cache_stride_block, cache_stride_slot, cache_stride_head;
    const int64_t *block_tables, *query_start_loc, *seq_lens;
    int64_t block_tables_stride, num_heads, num_kv_heads, group, head_dim, block_size;
    int64_t tile_queries, wide_tile_queries; /* queries per item: one KV head's, all KV heads' */
    float scale_log2;
} Problem;

typedef struct {
    float *queries, *acc, *keys_t;  /* [rows][head_dim], [rows][head_dim], [head_dim][KEY_CHUNK] */
    float scores[MAX_ROWS][KEY_CHUNK];
    float running_max[MAX_ROWS], running_sum[MAX_ROWS];
    int64_t last_key[MAX_ROWS];     /* the last key each row sees */
    int64_t head_offset[MAX_ROWS];  /* where the row's KV head sits in a cache slot */
} Workspace;

/* Vectors of one machine register of floats (GNU C vector extensions, which gcc and clang
 * share): 16 with AVX-512, 8 with AVX, 4 otherwise (SSE, NEON). Written out rather than left to
 * the auto-vectoriser, which turned these loops into gathers and chains of scalar adds. A vector
 * wider than the registers is lowered through the stack: 16 floats on an AVX2 machine made a
 * SmolLM2 decode's attention 5x slower. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float half_vec __attribute__((vector_size(LANES / 2 * sizeof(float))));
typedef float quarter_vec __attribute__((vector_size(LANES / 4 * sizeof(float))));

static inline vec load(const float *from) {
    vec v;
    memcpy(&v, from, sizeof v); /* an unaligned vector load */
    return v;
}

static inline void store(float *to, vec v) { memcpy(to, &v, sizeof v); }

typedef int32_t lane_ints __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec select_lanes(const lane_ints mask, const vec yes, const vec no) {
    return (vec)((mask & (lane_ints)yes) | (~mask & (lane_ints)no));
}

/* 2**x for x <= 0: a power of two from the exponent bits times a degree-7 Taylor polynomial on
 * [-0.5, 0.5] (relative error ~5e-9, below float32's rounding). Below -126 it returns 2**-126,
 * whose weight is nothing next to the running max's 1. Lane by lane in explicit vectors: `omp simd`
 * over a scalar version left the softmax's loop scalar (a quarter of a decode's time). */
static inline vec exp2_nonpositive(vec x) {
    const vec lowest = (vec){0} - 126.0f;
    x = select_lanes(x < lowest, lowest, x);
    /* Adding and subtracting 1.5 * 2**23 rounds to the nearest integer in float arithmetic. */
    const vec n = (x + 12582912.0f) - 12582912.0f;
    const vec t = (x - n) * 0.6931471805599453f;
    /* Horner's rule over the coefficients 1 / 7!, ..., 1 / 1!, 1 / 0!. */
    static const float taylor[] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    vec p = (vec){0} + taylor[0];
    for (int i = 1; i < 8; i++) p = p * t + taylor[i];
    const lane_ints bits = (__builtin_convertvector(n, lane_ints) + 127) << 23;
    return p * (vec)bits;
}

typedef uint16_t bf16_vec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t bits_vec __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline float bf16_to_float(const uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest, ties to even (torch's rounding); a NaN stays a quiet NaN. */
static inline uint16_t float_to_bf16(const float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* LANES elements of a row from element `at`, as float32. `bf16` is a constant in every caller
 * once inlined, so each variant compiles to its own straight loads. */
static inline __attribute__((always_inline)) vec load_row(const void *row, const int64_t at, const int bf16) {
    if (!bf16) return load((const float *)row + at);
    bf16_vec halves;
    memcpy(&halves, (const uint16_t *)row + at, sizeof halves);
    const bits_vec bits = __builtin_convertvector(halves, bits_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) float row_at(const void *row, const int64_t at, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[at]) : ((const float *)row)[at];
}

/* The sum of the lanes, by halving: a tree, not a chain of dependent adds; in registers at 16
 * lanes where the compiler has __builtin_shufflevector (clang, gcc 12+), through memory
 * otherwise (at 8 lanes a decode sums its scores with sum_lanes_of_each instead). */
static inline float sum_lanes(vec v) {
#if LANES == 16 && (defined(__clang__) || __GNUC__ >= 12)
    const half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
                       + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const quarter_vec q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
#else /* the same pairs: lane i with lane i + width, the width halved each time */
    float lanes[LANES];
    memcpy(lanes, &v, sizeof v);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) lanes[i] += lanes[i + width];
    return lanes[0];
#endif
}

/* query . (key + offset) over dim elements. */
static inline __attribute__((always_inline)) float dot(const float *restrict query, const void *key,
                                                       const int64_t offset, const int64_t dim, const int bf16) {
    vec lanes = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES) lanes += load(query + d) * load_row(key, offset + d, bf16);
    float sum = sum_lanes(lanes);
    for (; d < dim; d++) sum += query[d] * row_at(key, offset + d, bf16);
    return sum;
}

#if LANES == 16 && (defined(__clang__) || __GNUC__ >= 12)
#define HAVE_SHUFFLE 1
/* Lane j of the result is the sum of the lanes of parts[j]. Pairs of vectors are halved together
 * (two shuffles and an add give each of them half as many partial sums, side by side), so LANES
 * sums cost 45 operations instead of LANES separate trees. The additions pair the same lanes as
 * sum_lanes, so each sum is bitwise the one sum_lanes gives. */
static inline __attribute__((always_inline)) vec sum_lanes_of_each(const vec parts[LANES]) {
    vec eighths[8], quarters[4], halves[2];
    for (int i = 0; i < 8; i++)
        eighths[i] = __builtin_shufflevector(parts[2 * i], parts[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7,
                                             16, 17, 18, 19, 20, 21, 22, 23)
                     + __builtin_shufflevector(parts[2 * i], parts[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                               24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        quarters[i] = __builtin_shufflevector(eighths[2 * i], eighths[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11,
                                              16, 17, 18, 19, 24, 25, 26, 27)
                      + __builtin_shufflevector(eighths[2 * i], eighths[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                                                20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        halves[i] = __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13,
                                            16, 17, 20, 21, 24, 25, 28, 29)
                    + __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                                              18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(halves[0], halves[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
           + __builtin_shufflevector(halves[0], halves[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif LANES == 8 && (defined(__clang__) || __GNUC__ >= 12)
#define HAVE_SHUFFLE 1
/* The same at 8 lanes (AVX2): 4 + 2 + 1 shuffled adds for 8 sums, pairing lanes as sum_lanes does. */
static inline __attribute__((always_inline)) vec sum_lanes_of_each(const vec parts[LANES]) {
    vec quarters[4], halves[2];
    for (int i = 0; i < 4; i++)
        quarters[i] = __builtin_shufflevector(parts[2 * i], parts[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
                      + __builtin_shufflevector(parts[2 * i], parts[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        halves[i] = __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
                    + __builtin_shufflevector(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(halves[0], halves[1], 0, 2, 4, 6, 8, 10, 12, 14)
           + __builtin_shufflevector(halves[0], halves[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* scores[j] = query . (keys[j] + offset) for j < count (<= KEY_CHUNK). Where dim is whole vectors and the
 * compiler can shuffle, LANES keys are scored together: each key's products are summed lane-wise
 * into one vector, and the LANES vectors reduced at once. Slots past count repeat key 0. */
static inline __attribute__((always_inline)) void score_keys(const float *restrict query, const void *const *keys,
                                                             const int64_t offset, const int64_t count,
                                                             float *restrict scores, const int64_t dim,
                                                             const int bf16) {
#ifdef HAVE_SHUFFLE
    if (dim % LANES == 0) {
        for (int64_t j0 = 0; j0 < count; j0 += LANES) {
            vec parts[LANES];
            for (int64_t j = 0; j < LANES; j++) {
                const void *key = keys[j0 + j < count ? j0 + j : 0];
                vec lanes = load(query) * load_row(key, offset, bf16);
                for (int64_t d = LANES; d < dim; d += LANES) lanes += load(query + d) * load_row(key, offset + d, bf16);
                parts[j] = lanes;
            }
            store(scores + j0, sum_lanes_of_each(parts));
        }
        return;
    }
#endif
    for (int64_t j = 0; j < count; j++) scores[j] = dot(query, keys[j], offset, dim, bf16);
}

/* Vectors of an accumulator updated at once: independent chains of multiply-adds (one
 * dependent chain per vector is bound by the adds' latency), and dims up to 128 in registers. */
#define MAX_SLICES 8

/* acc = acc * correction + sum_j weights[j] * (values[j] + offset). Even and odd keys go into
 * separate accumulators, for twice the independent chains. */
static inline __attribute__((always_inline)) void accumulate(float *restrict acc, const float correction,
                                                             const float *restrict weights,
                                                             const void *const *values, const int64_t offset,
                                                             const int64_t count, const int64_t dim,
                                                             const int bf16) {
    const int64_t vector_dim = dim / LANES * LANES;
    for (int64_t d0 = 0; d0 < vector_dim; d0 += MAX_SLICES * LANES) {
        const int64_t slices = (vector_dim - d0) / LANES < MAX_SLICES ? (vector_dim - d0) / LANES : MAX_SLICES;
        vec even[MAX_SLICES], odd[MAX_SLICES];
        for (int64_t s = 0; s < slices; s++) {
            even[s] = load(acc + d0 + s * LANES) * correction;
            odd[s] = (vec){0};
        }
        int64_t j = 0;
        for (; j + 1 < count; j += 2) {
            for (int64_t s = 0; s < slices; s++) {
                even[s] += weights[j] * load_row(values[j], offset + d0 + s * LANES, bf16);
                odd[s] += weights[j + 1] * load_row(values[j + 1], offset + d0 + s * LANES, bf16);
            }
        }
        for (; j < count; j++)
            for (int64_t s = 0; s < slices; s++)
                even[s] += weights[j] * load_row(values[j], offset + d0 + s * LANES, bf16);
        for (int64_t s = 0; s < slices; s++) store(acc + d0 + s * LANES, even[s] + odd[s]);
    }
    for (int64_t d = vector_dim; d < dim; d++) {
        float sum = acc[d] * correction;
        for (int64_t j = 0; j < count; j++) sum += weights[j] * row_at(values[j], offset + d, bf16);
        acc[d] = sum;
    }
}

/* Rows scored together from the transposed keys: each row's KEY_CHUNK / LANES vectors are
 * separate chains, so SCORE_ROWS rows keep several multiply-adds in flight. */
#define SCORE_ROWS 4

/* scores[r][0 : KEY_CHUNK] = queries[r] . keys_t[:, j] for `count` <= SCORE_ROWS rows. */
static inline __attribute__((always_inline)) void score_rows(const float *restrict queries,
                                                             const float *restrict keys_t,
                                                             float (*restrict scores)[KEY_CHUNK], const int64_t count,
                                                             const int64_t dim) {
    vec sums[SCORE_ROWS][KEY_CHUNK / LANES] = {{{0}}};
    for (int64_t d = 0; d < dim; d++) {
        vec column[KEY_CHUNK / LANES];
        for (int b = 0; b < KEY_CHUNK / LANES; b++) column[b] = load(keys_t + d * KEY_CHUNK + b * LANES);
        for (int64_t r = 0; r < count; r++) {
            const float qd = queries[r * dim + d];
            for (int b = 0; b < KEY_CHUNK / LANES; b++) sums[r][b] += qd * column[b];
        }
    }
    for (int64_t r = 0; r < count; r++)
        for (int b = 0; b < KEY_CHUNK / LANES; b++) store(scores[r] + b * LANES, sums[r][b]);
}

/* A work item: a tile of one request's queries, against one of its KV heads or all of them.
 * A decode (a tile too small to transpose its keys for) takes all, and so reads each cache slot
 * whole: reading alone, whole blocks streamed from memory 1.2-1.5x faster than a stride through
 * one head's part of every slot; the decode kernel gained 6-13 % (none on SmolLM2's shapes). */
typedef struct {
    int64_t req, first_query;  /* the tile's queries: first_query .. first_query + rows / heads - 1 */
    int64_t kv_head, kv_heads; /* the first KV head, and how many */
    int64_t rows;              /* the tile's queries times the query heads of its KV heads */
    int64_t key_end;           /* the keys read are 0 .. key_end - 1: the tile's last query sees them all */
} Item;

/* Asks for the cache lines of keys from .. to - 1 of an item (its K and V rows) ahead of their
 * use, into L2 (locality 2: an item's rows outgrow L1). In an engine step the cache comes mostly
 * from memory (the weights and the other layers have passed through the CPU caches since its
 * last read); there, fetching the next item's rows while this one is computed made a decode
 * 1.2-1.3x faster, and cost nothing with the cache in L2/L3 (bench/attention_options.py
 * --cold). Into L1 instead it gained under 10 %, and lost as much when the cache was warm. */
static inline void prefetch_keys(const Problem *p, const Item *item, const int64_t from, const int64_t to,
                                 const int64_t dim) {
    const int64_t *table = p->block_tables + item->req * p->block_tables_stride;
    int64_t block = from / p->block_size, slot = from % p->block_size;
    for (int64_t key = from; key < to; key++) {
        for (int64_t h = item->kv_head; h < item->kv_head + item->kv_heads; h++) {
            const int64_t offset = table[block] * p->cache_stride_block + slot * p->cache_stride_slot
                                   + h * p->cache_stride_head;
            for (int64_t d = 0; d < dim; d += 64 / p->element_size) {
                __builtin_prefetch((const char *)p->key_cache + (offset + d) * p->element_size, 0, 2);
                __builtin_prefetch((const char *)p->value_cache + (offset + d) * p->element_size, 0, 2);
            }
        }
        if (++slot == p->block_size) slot = 0, block++;
    }
}

/* Tiles of at least this many rows score a chunk from a transposed copy of its keys: a rank-1
 * update per dimension, vectorised over the chunk's keys. Fewer rows (decodes: one query per
 * head of the group) dot each key row directly, since the copy would cost as much as the dots. */
#define TRANSPOSE_MIN_ROWS 8

/* One work item. Inlined into a copy per common head_dim (attend_tile below), so that the loops
 * over head_dim have a constant trip count and unroll into whole vectors. */
static inline __attribute__((always_inline)) void attend_tile_dim(
    const Problem *p, Workspace *w, const Item *item, const Item *next, const int64_t dim, const int bf16) {
    const int64_t rows = item->rows, key_end = item->key_end;
    const int64_t heads = item->kv_heads * p->group, first_head = item->kv_head * p->group;
    const int64_t q_start = p->query_start_loc[item->req];
    const int64_t first_query = item->first_query;
    const int64_t context = key_end - rows / heads - first_query;
    float *restrict queries = w->queries, *restrict accs = w->acc, *restrict keys_t = w->keys_t;

    /* Row r is query first_query + r / heads, head first_head + r % heads. */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = first_head + r % heads;
        const int64_t src = (q_start + first_query + r / heads) * p->q_stride_token + head * p->q_stride_head;
        for (int64_t d = 0; d < dim; d++) {
            queries[r * dim + d] = row_at(p->q, src + d, bf16) * p->scale_log2;
            accs[r * dim + d] = 0.0f;
        }
        w->running_max[r] = -1e30f; /* finite: the first update's correction is ~0, times zeros */
        w->running_sum[r] = 0.0f;
        w->last_key[r] = context + first_query + r / heads;
        w->head_offset[r] = head / p->group * p->cache_stride_head;
    }

    const int64_t *table = p->block_tables + item->req * p->block_tables_stride;
    const int transpose = item->kv_heads == 1 && rows >= TRANSPOSE_MIN_ROWS;
    const void *keys[KEY_CHUNK], *values[KEY_CHUNK];
    const int64_t num_chunks = (key_end + KEY_CHUNK - 1) / KEY_CHUNK;
    int64_t block = 0, slot = 0;
    for (int64_t chunk = 0, c = 0; chunk < key_end; chunk += KEY_CHUNK, c++) {
        if (next != NULL) /* a share of the next item's rows per chunk of this one */
            prefetch_keys(p, next, c * next->key_end / num_chunks, (c + 1) * next->key_end / num_chunks, dim);
        int64_t chunk_len = key_end - chunk;
        if (chunk_len > KEY_CHUNK) chunk_len = KEY_CHUNK;
        for (int64_t j = 0; j < chunk_len; j++) {
            const int64_t offset = table[block] * p->cache_stride_block + slot * p->cache_stride_slot;
            keys[j] = (const char *)p->key_cache + offset * p->element_size;
            values[j] = (const char *)p->value_cache + offset * p->element_size;
            if (++slot == p->block_size) slot = 0, block++;
        }
        if (transpose) {
            /* Columns past chunk_len keep older (finite) keys; their scores are never used. */
            for (int64_t j = 0; j < chunk_len; j++)
                for (int64_t d = 0; d < dim; d++)
                    keys_t[d * KEY_CHUNK + j] = row_at(keys[j], w->head_offset[0] + d, bf16);
            for (int64_t r = 0; r < rows; r += SCORE_ROWS)
                score_rows(queries + r * dim, keys_t, w->scores + r, rows - r < SCORE_ROWS ? rows - r : SCORE_ROWS, dim);
        }
        for (int64_t r = 0; r < rows; r++) {
            /* Keys this row sees in this chunk (the rows of a tile end at successive keys). */
            int64_t visible = w->last_key[r] - chunk + 1;
            if (visible > chunk_len) visible = chunk_len;
            if (visible <= 0) continue;
            float *restrict scores = w->scores[r];
            if (!transpose) score_keys(queries + r * dim, keys, w->head_offset[r], visible, scores, dim, bf16);
            /* Whole vectors over the chunk, the scores past `visible` (stale or unset) masked
             * out: fixed trip counts, and no scalar chains of dependent maxes and adds. */
            const vec very_low = (vec){0} - 1e30f;
            lane_ints index;
            for (int l = 0; l < LANES; l++) index[l] = l;
            vec maxes = very_low;
            for (int64_t j = 0; j < KEY_CHUNK; j += LANES) {
                const vec score = select_lanes(index + (int32_t)j < (int32_t)visible, load(scores + j), very_low);
                maxes = select_lanes(score > maxes, score, maxes);
            }
            float chunk_max = maxes[0];
            for (int l = 1; l < LANES; l++) chunk_max = maxes[l] > chunk_max ? maxes[l] : chunk_max;
            const float old_max = w->running_max[r];
            const float new_max = chunk_max > old_max ? chunk_max : old_max;
            const float correction = exp2_nonpositive((vec){0} + (old_max - new_max))[0];
            for (int64_t j = 0; j < KEY_CHUNK; j += LANES)
                store(scores + j, select_lanes(index + (int32_t)j < (int32_t)visible,
                                               exp2_nonpositive(load(scores + j) - new_max), (vec){0}));
            vec sums = load(scores);
            for (int64_t j = LANES; j < KEY_CHUNK; j += LANES) sums += load(scores + j);
            const float chunk_sum = sum_lanes(sums);
            w->running_max[r] = new_max;
            w->running_sum[r] = w->running_sum[r] * correction + chunk_sum;
            accumulate(accs + r * dim, correction, scores, values, w->head_offset[r], visible, dim, bf16);
        }
    }

    for (int64_t r = 0; r < rows; r++) {
        const int64_t dst = (q_start + first_query + r / heads) * p->out_stride_token
                            + (first_head + r % heads) * p->out_stride_head;
        const float inverse = 1.0f / w->running_sum[r]; /* >= 1: every row sees key 0 */
        for (int64_t d = 0; d < dim; d++) {
            const float value = accs[r * dim + d] * inverse;
            if (bf16) ((uint16_t *)p->out)[dst + d] = float_to_bf16(value);
            else ((float *)p->out)[dst + d] = value;
        }
    }
}

static void attend_tile_of(const Problem *p, Workspace *w, const Item *item, const Item *next, const int bf16) {
    switch (p->head_dim) {
    case 32: attend_tile_dim(p, w, item, next, 32, bf16); break;
    case 64: attend_tile_dim(p, w, item, next, 64, bf16); break;
    case 128: attend_tile_dim(p, w, item, next, 128, bf16); break;
    default: attend_tile_dim(p, w, item, next, p->head_dim, bf16);
    }
}

static void attend_tile(const Problem *p, Workspace *w, const Item *item, const Item *next) {
    if (p->element_size == sizeof(uint16_t)) attend_tile_of(p, w, item, next, 1);
    else attend_tile_of(p, w, item, next, 0);
}

/* The work items of request req, written to items unless it is NULL; returns their number. A
 * short run of queries (a decode) is tiled against all KV heads at once (see Item), when its
 * heads fit a tile; a longer one against one KV head per item. */
static int64_t plan_request(const Problem *p, const int64_t req, Item *items) {
    const int64_t q_len = p->query_start_loc[req + 1] - p->query_start_loc[req];
    const int all_heads = p->wide_tile_queries > 0 && q_len * p->group < TRANSPOSE_MIN_ROWS;
    const int64_t kv_heads = all_heads ? p->num_kv_heads : 1;
    const int64_t tile_queries = all_heads ? p->wide_tile_queries : p->tile_queries;
    int64_t count = 0;
    for (int64_t first_query = 0; first_query < q_len; first_query += tile_queries) {
        const int64_t tile_len = q_len - first_query < tile_queries ? q_len - first_query : tile_queries;
        for (int64_t kv_head = 0; kv_head < p->num_kv_heads; kv_head += kv_heads, count++)
            if (items != NULL)
                items[count] = (Item){.req = req, .first_query = first_query, .kv_head = kv_head,
                                      .kv_heads = kv_heads, .rows = tile_len * kv_heads * p->group,
                                      .key_end = p->seq_lens[req] - q_len + first_query + tile_len};
    }
    return count;
}

/* out[T, heads, dim] = attention of q[T, heads, dim] over the paged caches; all of them of one
 * element type (element_size bytes: float32 or bfloat16) and head_dim contiguous. Returns OK, or
 * an error code (nothing written). */
static int paged_attention(
    int64_t element_size, void *out, int64_t out_stride_token, int64_t out_stride_head,
    const void *q, int64_t q_stride_token, int64_t q_stride_head,
    const void *key_cache, const void *value_cache,
    int64_t cache_stride_block, int64_t cache_stride_slot, int64_t cache_stride_head,
    const int64_t *block_tables, int64_t block_tables_stride,
    const int64_t *query_start_loc, const int64_t *seq_lens, int64_t num_reqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_ROWS)
        return BAD_HEADS;
    if (head_dim <= 0 || head_dim * (num_heads / num_kv_heads) > ROW_FLOATS) return BAD_HEAD_DIM;
    const int64_t group = num_heads / num_kv_heads;
    int64_t max_rows = ROW_FLOATS / head_dim;
    if (max_rows > MAX_ROWS) max_rows = MAX_ROWS;
    Problem p = {
        .q = q, .key_cache = key_cache, .value_cache = value_cache, .out = out, .element_size = element_size,
        .q_stride_token = q_stride_token, .q_stride_head = q_stride_head,
        .out_stride_token = out_stride_token, .out_stride_head = out_stride_head,
        .cache_stride_block = cache_stride_block, .cache_stride_slot = cache_stride_slot,
        .cache_stride_head = cache_stride_head,
        .block_tables = block_tables, .query_start_loc = query_start_loc, .seq_lens = seq_lens,
        .block_tables_stride = block_tables_stride, .num_kv_heads = num_kv_heads, .group = group,
        .head_dim = head_dim, .block_size = block_size, .num_heads = num_heads, .tile_queries = max_rows / group,
        /* 0: too many heads for one item; or fewer requests than threads (one stream decoding),
         * where items of one KV head each give every thread work. */
        .wide_tile_queries = num_reqs < num_threads ? 0 : max_rows / num_heads,
        .scale_log2 = scale * LOG2E,
    };
    int64_t num_items = 0;
    for (int64_t req = 0; req < num_reqs; req++) num_items += plan_request(&p, req, NULL);
    if (num_items == 0) return OK;
    Item *items = malloc((size_t)num_items * sizeof *items);
    if (items == NULL) return OUT_OF_MEMORY;
    for (int64_t req = 0, planned = 0; req < num_reqs; req++) planned += plan_request(&p, req, items + planned);
    int status = OK;
    int64_t next_run = 0; /* the first item no thread has taken */

    /* A team no larger than the work: one decode is one item, and waking an idle thread for it
     * costs more than the item. */
    const int team = num_items < num_threads ? (int)num_items : num_threads;
    #pragma omp parallel num_threads(team) if (team > 1)
    {
        Workspace *w = malloc(sizeof *w);
        float *rows = calloc((size_t)(2 * max_rows + KEY_CHUNK) * (size_t)head_dim, sizeof(float));
        if (w == NULL || rows == NULL) {
            #pragma omp atomic write
            status = OUT_OF_MEMORY;
        }
        #pragma omp barrier
        int ready;
        #pragma omp atomic read
        ready = status;
        if (ready == OK) {
            w->queries = rows;
            w->acc = rows + max_rows * head_dim;
            w->keys_t = rows + 2 * max_rows * head_dim;
            /* Threads take runs of consecutive items as they come free: within a run a thread
             * knows its next item and fetches its rows while it computes this one, and runs are
             * short enough (a quarter of a thread's share) that a thread the OS delays, or long
             * contexts, leave the others no long wait at the end. One thread takes one run. */
            const int64_t threads = omp_get_num_threads();
            const int64_t run = threads == 1 ? num_items : (num_items + 4 * threads - 1) / (4 * threads);
            for (;;) {
                int64_t begin;
                #pragma omp atomic capture
                { begin = next_run; next_run += run; }
                if (begin >= num_items) break;
                const int64_t end = begin + run < num_items ? begin + run : num_items;
                prefetch_keys(&p, &items[begin], 0, items[begin].key_end, head_dim);
                for (int64_t i = begin; i < end; i++)
                    attend_tile(&p, w, &items[i], i + 1 < end ? &items[i + 1] : NULL);
            }
        }
        free(rows);
        free(w);
    }
    free(items);
    return status;
}

#define PAGED_ATTENTION_ENTRY(name, element)                                                            \
    int name(element *out, int64_t out_stride_token, int64_t out_stride_head, const element *q,         \
             int64_t q_stride_token, int64_t q_stride_head, const element *key_cache,                   \
             const element *value_cache, int64_t cache_stride_block, int64_t cache_stride_slot,          \
             int64_t cache_stride_head, const int64_t *block_tables, int64_t block_tables_stride,       \
             const int64_t *query_start_loc, const int64_t *seq_lens, int64_t num_reqs,                \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, \
             int num_threads) {                                                                         \
        return paged_attention(sizeof(element), out, out_stride_token, out_stride_head, q,              \
                               q_stride_token, q_stride_head, key_cache, value_cache,                   \
                               cache_stride_block, cache_stride_slot, cache_stride_head, block_tables,  \
                               block_tables_stride, query_start_loc, seq_lens, num_reqs, num_heads,     \
                               num_kv_heads, head_dim, block_size, scale, num_threads);                 \
    }

/* The entry points: float32 tensors, and bfloat16 ones (as uint16_t, their bits). */
PAGED_ATTENTION_ENTRY(paged_attention_f32, float)
PAGED_ATTENTION_ENTRY(paged_attention_bf16, uint16_t)
