/* The C ABI of libkvq_gpu.so: kvq's paged-cache write and decode step for programs that cannot
 * or should not link C++ (a serving engine's own runtime, Python through ctypes: the torch ops
 * of tools/python/kvq/torch_ops.py). Plain C types only: ints, int64_t, device pointers as
 * void*, a cudaStream_t as void*. Nothing here allocates device memory or synchronises, so every
 * write and decode call can be captured into a CUDA graph; the caller owns the pools, the
 * windows, the page tables and the decode workspace (sized by the queries below).
 *
 * Errors: every function that can fail returns an int status, KVQ_OK (0) or a KVQ_ERROR_* code
 * (kvq::ErrorCode + 1); kvq_last_error() then returns this thread's message, which names the
 * function and the offending value. No C++ exception crosses this boundary.
 *
 * A cache is described once (kvq_cache_create) by the metadata text of spec/formats.md: the keys
 * PutCacheParams writes into every kvq file (the golden vectors' cache cases, calibration files),
 * "name=value" entries separated by ';' or newlines, e.g.
 *   num_kv_heads=8; num_q_heads=32; sink=64; recent=256; page_size=64; quantized=1;
 *   softmax_scale=0; key.head_dim=128; key.group=64; key.bits=2; key.clip=1;
 *   key.rotation=dense; key.hadamard_block=0; key.bitrev=0; value.head_dim=128; ...
 * The spec 1.0 keys are required; later ones (flush, key.row_format, key.norm, key.head_scale,
 * ...) default as in files. An unknown or repeated key is refused by name.
 *
 * Shapes (device memory, row-major, every buffer 16-byte aligned):
 *   K / V rows        bf16 [T, Hkv, d] (prefill), [B, Hkv, d] (append)
 *   pool plane i      kvq_pool_plane's shape and dtype, [pages, heads per page, rows per page,
 *                     elements] (spec/cache.md §4; the vectors' expect.pool.<side>.<plane>)
 *   sink window       bf16 [B, S0, Hkv, d] (prefill: one sequence's [S0, Hkv, d])
 *   recent ring       bf16 [B, W + F - 1, Hkv, d] (position p at slot p % (W + F - 1))
 *   page tables       int32 [B, max_pages] (prefill: one sequence's [page_table_len]); history
 *                     token i of sequence b lives in page page_tables[b][i / P], slot i % P
 *   per-head data     one pointer per row of kvq_head_row_name (an array of kvq_head_rows()
 *                     pointers per side, NULL entries for rows not given, or NULL for none):
 *                     "rotation" f32 [Hkv, d, d] (dense rotations), "clip" f32 [Hkv], "scale"
 *                     f32 [Hkv] (fp8 scales), ... (kvq_head_row_shape says each row's shape and
 *                     whether the cache needs it)
 *   q, out            f32 [B, Hq, d]
 */
#ifndef KVQ_GPU_C_API_H_
#define KVQ_GPU_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Raised when a function's meaning or signature changes; kvq_c_api_version() returns it. */
#define KVQ_C_API_VERSION 1

/* Status codes: 0, or kvq::ErrorCode + 1 (spec/errors.md), or KVQ_ERROR_INTERNAL for an
 * exception that is not a kvq::Error (out of memory, a bug). */
enum {
  KVQ_OK = 0,
  KVQ_ERROR_INVALID_ARGUMENT = 1,
  KVQ_ERROR_SHAPE_MISMATCH = 2,
  KVQ_ERROR_NON_FINITE = 3,
  KVQ_ERROR_MALFORMED = 4,
  KVQ_ERROR_IO = 5,
  KVQ_ERROR_UNSUPPORTED = 6,
  KVQ_ERROR_MISMATCH = 7,
  KVQ_ERROR_INTERNAL = 8
};

/* The sides of a cache, and element types of pools and per-head rows. */
enum { KVQ_SIDE_KEY = 0, KVQ_SIDE_VALUE = 1 };
enum { KVQ_DTYPE_U8 = 0, KVQ_DTYPE_BF16 = 1, KVQ_DTYPE_F32 = 2 };
/* Whether a cache needs a per-head row on a side. */
enum { KVQ_HEAD_ROW_ABSENT = 0, KVQ_HEAD_ROW_OPTIONAL = 1, KVQ_HEAD_ROW_REQUIRED = 2 };

/* kvq_cache_dims' entries. */
enum {
  KVQ_DIM_HEAD_DIM = 0,   /* d */
  KVQ_DIM_KV_HEADS = 1,   /* Hkv */
  KVQ_DIM_Q_HEADS = 2,    /* Hq */
  KVQ_DIM_SINK = 3,       /* S0 */
  KVQ_DIM_RECENT = 4,     /* W */
  KVQ_DIM_FLUSH = 5,      /* F */
  KVQ_DIM_PAGE_SIZE = 6,  /* P */
  KVQ_DIM_RING_SLOTS = 7, /* W + F - 1 */
  KVQ_DIM_QUANTIZED = 8,  /* 0: the bf16 baseline cache (every token a paged bf16 row) */
  KVQ_DIM_COUNT = 9
};

int kvq_c_api_version(void);

/* This thread's message of the last failing call ("" after a call that succeeded). */
const char* kvq_last_error(void);

/* ---- Describing a cache --------------------------------------------------------------------- */

typedef struct kvq_cache kvq_cache;

/* Parses and validates `params` (the metadata text above) into *out. Refuses, with the reason,
 * parameters CacheParams::Validate rejects and caches the CUDA decode step does not serve
 * (a format, width, group, tile or GQA group its kernels lack). Writes are checked per call
 * (the bf16 baseline cache has no kvq write: its rows are the caller's copy). */
int kvq_cache_create(const char* params, kvq_cache** out);
void kvq_cache_destroy(kvq_cache* cache);

/* dims[KVQ_DIM_COUNT]: the cache's geometry (KVQ_DIM_*). */
int kvq_cache_dims(const kvq_cache* cache, int32_t* dims);
/* H(t): the history tokens of a sequence of length t (spec/cache.md §2; 0 for a bf16 cache). */
int kvq_cache_history_tokens(const kvq_cache* cache, int64_t t, int64_t* out);

/* The planes of a side's page pool (LayoutOf of its write params), in storage order. */
int kvq_pool_num_planes(const kvq_cache* cache, int side, int32_t* out);
/* Plane `plane` of a pool of `num_pages` pages: shape[4] = {num_pages, heads per page, rows per
 * page, elements per row}, *dtype (KVQ_DTYPE_*), *bytes (the plane's whole size), *name
 * ("codes", "scale", "min", "norm", "rows"; static storage). Any output pointer may be NULL. */
int kvq_pool_plane(const kvq_cache* cache, int side, int32_t plane, int64_t num_pages,
                   int64_t* shape, int32_t* dtype, int64_t* bytes, const char** name);

/* The per-head rows (head_data.inc: its arrays, then its scalars): how many, and their names
 * (NULL outside [0, kvq_head_rows())). */
int kvq_head_rows(void);
const char* kvq_head_row_name(int32_t row);
/* Row `row` on a side of the cache: *elements per KV head, *dtype, *use (KVQ_HEAD_ROW_*:
 * required rows must be given to writes and decode; an optional scalar row absent means every
 * head takes the side's parameter). */
int kvq_head_row_shape(const kvq_cache* cache, int side, int32_t row, int64_t* elements,
                       int32_t* dtype, int32_t* use);

/* ---- The write path ------------------------------------------------------------------------ */

/* Prefill of one empty sequence with `tokens` rows of K and V: positions [0, min(S0, T)) into
 * its sink, [S0, S0 + H(T)) into the pages of page_table, the rest into its ring (kvq::gpu::
 * PrefillWrite). page_table_len: the table's entries, at least ceil(H(T) / P). error_flags:
 * optional device int32 the kernels OR kvq::gpu::kErrorFlag* bits into (1 a non-finite row,
 * 2 a page id outside [0, num_pages), 4 a negative length). */
int kvq_write_prefill(const kvq_cache* cache, const void* key, const void* value, int32_t tokens,
                      const int32_t* page_table, int64_t page_table_len,
                      const void* const* key_heads, const void* const* value_heads,
                      void* const* key_planes, void* const* value_planes, int64_t num_pages,
                      void* sink_key, void* sink_value, void* recent_key, void* recent_value,
                      int32_t* error_flags, void* stream);

/* One decode step's append for `batch` sequences: sequence b of length lengths[b] (device int32
 * [B], before the step) takes row b of key / value; the positions that leave the recent window
 * enter the history (kvq::gpu::AppendStep). The caller advances lengths afterwards. */
int kvq_write_append(const kvq_cache* cache, const void* key, const void* value, int32_t batch,
                     const int32_t* lengths, const int32_t* page_tables, int32_t max_pages,
                     const void* const* key_heads, const void* const* value_heads,
                     void* const* key_planes, void* const* value_planes, int64_t num_pages,
                     void* sink_key, void* sink_value, void* recent_key, void* recent_value,
                     int32_t* error_flags, void* stream);

/* ---- The decode step ----------------------------------------------------------------------- */

/* Workspace bytes kvq_decode needs for `batch` sequences of at most max_seq_len tokens on the
 * current device (its plan depends on the device's multiprocessor count). */
int kvq_decode_workspace_bytes(const kvq_cache* cache, int32_t batch, int32_t max_seq_len,
                               int64_t* bytes);

/* out = the attention of q over each sequence's cache (query rotation, fused split decode, LSE
 * merge; kvq::gpu::DecodeAttention). seq_lens: device int32 [B], lengths including the current
 * token, 1 <= t <= max_seq_len (a host bound that sizes the grid; a sequence outside it gets
 * NaN). workspace: device, 256-byte aligned, at least kvq_decode_workspace_bytes. */
int kvq_decode(const kvq_cache* cache, const float* q, int32_t batch, int32_t max_seq_len,
               const int32_t* seq_lens, const int32_t* page_tables, int32_t max_pages,
               const void* const* key_heads, const void* const* value_heads,
               const void* const* key_planes, const void* const* value_planes,
               const void* sink_key, const void* sink_value, const void* recent_key,
               const void* recent_value, float* out, void* workspace, int64_t workspace_bytes,
               void* stream);

/* One decode step as a serving engine runs it (kvq::gpu::DecodeStep): kvq_write_append's append
 * of key / value for the sequences of lengths (before the step), then kvq_decode's attention of
 * q over each sequence's cache of seq_lens (after it: the new token included), each kernel
 * launched while the one before it runs. The cache's and out's bits are the two calls'. The
 * arguments are theirs (the pools and windows written, then read); workspace as kvq_decode's. */
int kvq_decode_step(const kvq_cache* cache, const void* key, const void* value,
                    const int32_t* lengths, const float* q, int32_t batch, int32_t max_seq_len,
                    const int32_t* seq_lens, const int32_t* page_tables, int32_t max_pages,
                    const void* const* key_heads, const void* const* value_heads,
                    void* const* key_planes, void* const* value_planes, int64_t num_pages,
                    void* sink_key, void* sink_value, void* recent_key, void* recent_value,
                    int32_t* error_flags, float* out, void* workspace, int64_t workspace_bytes,
                    void* stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* KVQ_GPU_C_API_H_ */
