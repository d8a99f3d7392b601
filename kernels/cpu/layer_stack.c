/* A Llama-family model's decoder layers, the whole stack in one call: the CPU's counterpart of
 * replaying a CUDA graph. At decode sizes the Python side of a layer (a dozen module calls, their
 * checks, torch's dispatch and allocations) costs more than the layer's arithmetic; here the
 * step goes from kernel to kernel with nothing in between.
 *
 * It computes nothing of its own but the bias add: it calls the other kernels' entry points
 * (quant_matmul.c at the ISA level the process chose, fused_ops.c, paged_attention.c) through
 * the pointers the caller hands it, in the order and with the arguments that the model's
 * per-layer Python path passes them. So a step through here is bitwise a step through there,
 * and each kernel keeps its own tests and ISA dispatch.
 *
 * Built by build.py; layer_stack.py fills the structs and checks the step.
 */
#include <stdint.h>
#include <string.h>

typedef int (*matmul_fn)(int qtype, const uint8_t *w, int64_t w_stride, const float *row_scales, int64_t rows,
                         int64_t cols, const float *x, int64_t x_stride, int64_t m, float *out,
                         int64_t out_stride, int threads);
typedef void (*rms_norm_fn)(float *out, int64_t out_stride, const float *x, int64_t x_stride, float *residual,
                            int64_t residual_stride, const float *weight, int64_t rows, int64_t hidden,
                            float eps, int threads);
typedef int (*rotary_fn)(float *x, int64_t token_stride, int64_t head_stride, int64_t tokens, int64_t heads,
                         int64_t half, const int64_t *positions, const float *cos_table, const float *sin_table,
                         int64_t table_stride, int64_t num_positions, int threads);
typedef int (*kv_write_fn)(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *key_cache,
                           char *value_cache, const int64_t *slots, int64_t tokens, int64_t row_size,
                           int64_t element_size, int64_t num_slots);
typedef int (*attention_fn)(float *out, int64_t out_stride_token, int64_t out_stride_head, const float *q,
                            int64_t q_stride_token, int64_t q_stride_head, const float *key_cache,
                            const float *value_cache, int64_t cache_stride_block, int64_t cache_stride_slot,
                            int64_t cache_stride_head, const int64_t *block_tables, int64_t block_tables_stride,
                            const int64_t *query_start_loc, const int64_t *seq_lens, int64_t num_reqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int num_threads);
typedef void (*silu_and_mul_fn)(float *out, int64_t out_stride, const float *x, int64_t x_stride, int64_t rows,
                                int64_t width, int threads);

struct kernels {
    matmul_fn matmul;
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    kv_write_fn kv_write;
    attention_fn attention;
    silu_and_mul_fn silu_and_mul;
};

/* One packed weight of a linear layer, as quant_matmul_f32 takes it. */
struct packed {
    int64_t qtype;
    const uint8_t *data;
    int64_t row_stride;
    const float *row_scales;
    int64_t rows, cols;
};

/* A linear layer: its packed parts side by side in the output (a Q4_K_M file's v is Q6_K beside
 * q and k's Q4_K), and a bias or NULL. */
#define MAX_PARTS 3
struct linear {
    int64_t num_parts;
    struct packed parts[MAX_PARTS];
    const float *bias;
};

struct layer {
    const float *input_norm, *post_attention_norm;
    struct linear qkv, o, gate_up, down;
    float *key_cache, *value_cache; /* [blocks, block_size, kv_heads, head_dim], contiguous */
};

struct model {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, num_slots;
    float eps, scale;
    const float *cos, *sin; /* the rotary tables [num_positions, table_stride] */
    int64_t table_stride, num_positions;
};

/* One step's tokens and where its activations go. hidden and residual are [tokens, hidden]; the
 * scratch rows are wide enough for the widest projection output. */
struct step {
    int64_t tokens, num_reqs;
    const int64_t *positions, *slot_mapping, *block_tables, *query_start_loc, *seq_lens;
    int64_t block_tables_stride;
    float *hidden, *residual;
    int has_residual; /* 0: the stream starts here, from hidden (the embedding) */
    float *qkv, *attn, *gate_up, *act;
};

/* What failed, for the caller's message: the op in the low byte, the layer above it, and the
 * kernel's own status in status_out. */
enum op { OK = 0, MATMUL = 1, ROTARY = 2, KV_WRITE = 3, ATTENTION = 4 };

static int linear(const struct kernels *k, const struct linear *l, const float *x, int64_t x_stride,
                  int64_t tokens, float *out, int64_t out_stride, int threads) {
    int64_t offset = 0;
    for (int64_t i = 0; i < l->num_parts; i++) {
        const struct packed *w = &l->parts[i];
        const int status = k->matmul((int)w->qtype, w->data, w->row_stride, w->row_scales, w->rows, w->cols, x,
                                     x_stride, tokens, out + offset, out_stride, threads);
        if (status)
            return status;
        offset += w->rows;
    }
    if (l->bias)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t j = 0; j < offset; j++)
                out[t * out_stride + j] += l->bias[j];
    return 0;
}

static int run_layer(const struct kernels *k, const struct model *m, const struct layer *l, const struct step *s,
                     int first, int threads, int *status) {
    const int64_t T = s->tokens, H = m->hidden, D = m->head_dim;
    const int64_t q_width = m->heads * D, kv_width = m->kv_heads * D, qkv_width = q_width + 2 * kv_width;
    const int64_t gate_up_width = 2 * m->intermediate;
    if (first && !s->has_residual) {
        memcpy(s->residual, s->hidden, (size_t)(T * H) * sizeof(float));
        k->rms_norm(s->hidden, H, s->residual, H, NULL, 0, l->input_norm, T, H, m->eps, threads);
    } else {
        k->rms_norm(s->hidden, H, s->hidden, H, s->residual, H, l->input_norm, T, H, m->eps, threads);
    }
    if ((*status = linear(k, &l->qkv, s->hidden, H, T, s->qkv, qkv_width, threads)))
        return MATMUL;
    if ((*status = k->rotary(s->qkv, qkv_width, D, T, m->heads + m->kv_heads, D / 2, s->positions, m->cos, m->sin,
                             m->table_stride, m->num_positions, threads)))
        return ROTARY;
    const float *keys = s->qkv + q_width, *values = keys + kv_width;
    if ((*status = k->kv_write((const char *)keys, qkv_width, (const char *)values, qkv_width,
                               (char *)l->key_cache, (char *)l->value_cache, s->slot_mapping, T, kv_width,
                               sizeof(float), m->num_slots)))
        return KV_WRITE;
    if ((*status = k->attention(s->attn, q_width, D, s->qkv, qkv_width, D, l->key_cache, l->value_cache,
                                m->block_size * kv_width, kv_width, D, s->block_tables, s->block_tables_stride,
                                s->query_start_loc, s->seq_lens, s->num_reqs, m->heads, m->kv_heads, D,
                                m->block_size, m->scale, threads)))
        return ATTENTION;
    if ((*status = linear(k, &l->o, s->attn, q_width, T, s->hidden, H, threads)))
        return MATMUL;
    k->rms_norm(s->hidden, H, s->hidden, H, s->residual, H, l->post_attention_norm, T, H, m->eps, threads);
    if ((*status = linear(k, &l->gate_up, s->hidden, H, T, s->gate_up, gate_up_width, threads)))
        return MATMUL;
    k->silu_and_mul(s->act, m->intermediate, s->gate_up, gate_up_width, T, m->intermediate, threads);
    if ((*status = linear(k, &l->down, s->act, m->intermediate, T, s->hidden, H, threads)))
        return MATMUL;
    return OK;
}

/* Runs layers [0, num_layers) over the step: on return, hidden holds the last layer's output and
 * residual the stream before it (their sum is the stream after), as the Python layers return
 * them. Returns 0, or (layer << 8 | op) with the kernel's status in *status; a failed kernel
 * has written nothing, but the layers before it have run. */
int layer_stack_run(const struct kernels *k, const struct model *m, const struct layer *layers, int64_t num_layers,
                    const struct step *s, int threads, int *status) {
    *status = 0;
    for (int64_t i = 0; i < num_layers; i++) {
        const int op = run_layer(k, m, &layers[i], s, i == 0, threads, status);
        if (op)
            return (int)(i << 8) | op;
    }
    return 0;
}
