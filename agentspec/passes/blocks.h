/* The interface of the GGUF block kernels (blocks.c), one home for what blocks.py, levels.py and
   tests/kernels_check.c pass across it: the structures of the decoder layers' call (levels.py mirrors
   them with ctypes and compares their sizes with agentspec_struct_sizes' when it loads a build: a
   mismatch refuses the build, it never reads past a structure) and the exported functions. */

#ifndef AGENTSPEC_BLOCKS_H
#define AGENTSPEC_BLOCKS_H

#include <stddef.h>
#include <stdint.h>

#define INTEGER_KIND 4 /* blocks.py: _blocks_arg */

typedef struct agentspec_blocks {
    int kind;               /* 0: Q4_1, 1: Q8_0, 2: Q8_16, 3: Q8_1, on float32 rows; INTEGER_KIND + an integer layout (INT_LAYOUT) */
    const void *few, *many; /* float32 rows: the blocks grouped for products of few and of many rows; integer rows: few, by lanes */
    /* A product of parts of different kinds (Q4_K_M's q and k in Q4_K, v in Q6_K): this part's
       outputs, the next part's blocks (their outputs follow), or NULL (one part: all outputs) */
    int outputs;
    const struct agentspec_blocks *next;
} agentspec_blocks;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    agentspec_blocks qkv, o, gate_up, down;
    const float *qkv_bias;        /* added to the q/k/v product's outputs (Qwen2), or NULL */
    const float *q_norm, *k_norm; /* RMSNorm weights over each query / key head before the rotary embedding (Qwen3), or NULL */
    float qk_eps;
    int window;                   /* a token attends to the last `window` positions only (Mistral); 0: to all */
    int rotary;                   /* 1 + the rotary table the layer reads (Gemma 3: one per layer type); 0: none (SmolLM3) */
    const float *post_attention, *post_mlp; /* RMSNorm weights of attention's and the MLP's outputs (Gemma 2/3), or NULL */
    float post_eps;
    int gelu;                     /* the gate's activation: GELU, tanh approximation (Gemma), instead of SiLU */
    float softcap;                /* attention scores soft-capped: tanh(score / cap) * cap (Gemma 2); 0: not */
} agentspec_layer;

typedef struct {
    int start, stop, past, capacity; /* the sequence's new tokens [start, stop) of the pass */
    void *keys, *values;             /* its block's keys and values: [layers, kv_heads, capacity, head_dim] each, float32 or float16 */
} agentspec_segment;

extern const int agentspec_lanes; /* outputs per group in the layout of the integer products (Blocks.by_lanes) */

/* What the products and the layers return (levels.py raises ValueError or MemoryError for the others): */
#define AGENTSPEC_OK 0
#define AGENTSPEC_BAD_ARGUMENT (-1)   /* a count, size or pointer the kernels do not take: nothing done */
#define AGENTSPEC_UNKNOWN_LAYOUT (-2) /* a block kind or integer layout number they do not have: nothing done */
#define AGENTSPEC_NO_MEMORY (-3)      /* their working memory could not be taken: nothing done */

/* Whether this CPU runs the level the library was built for (and, for AMX, Linux granted the tiles) */
int agentspec_cpu_runs_this(void);
/* sizeof agentspec_blocks, agentspec_layer and agentspec_segment, for levels.py's check */
void agentspec_struct_sizes(size_t sizes[3]);
/* the bytes of the calling thread's last request for working memory that failed (AGENTSPEC_NO_MEMORY) */
size_t agentspec_failed_bytes(void);

/* y[M, N] = x[M, K] @ W.T on float32 rows, W's blocks grouped for few and for many rows */
int agentspec_q4_1_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads);
int agentspec_q8_0_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads);
int agentspec_q8_16_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads);
int agentspec_q8_1_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads);
/* the same on rows quantised to 8 or 16 bits, W's blocks by lanes in an integer layout (INT_LAYOUT) */
int agentspec_int_product(int layout, const float *x, int M, int K, const void *w, float *y, int N, int threads);
/* rows of GGUF blocks (rows[i]: output i's, of ggml type types[i]) laid out for agentspec_int_product
   straight from the file's bytes (layouts.py: FileRun), and the statistics that choose the layout
   (by_lanes finds them on the way where `stats` is not NULL); 0, or -1 for a type or count they do not read */
int agentspec_gguf_statistics(const uint8_t *const *rows, const int *types, int n, int K, int threads, int stats[3]);
int agentspec_gguf_by_lanes(const uint8_t *const *rows, const int *types, int n, int K, int codes, int mins, int factored, int halves, int threads,
                            uint8_t *out, int *stats);
/* the decoder layers of a pass over `T` tokens of `nseg` sequences (blocks.c says what each does) */
int agentspec_layers(float *hidden, int T, int H, int heads, int kv_heads, int head_dim, int intermediate, int layers, const agentspec_layer *weights,
                     const float *cos, const float *sin, int rotary_dim, float scaling, float residual_scale, const agentspec_segment *segments,
                     int nseg, int key_half, int value_half, int threads);

#endif
