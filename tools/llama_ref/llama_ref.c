// llama_ref: reference logits and greedy tokens from llama.cpp, via the public llama.h API.
//
// Usage:
//   llama_ref MODEL.gguf PROMPTS.txt OUT_DIR [options]
//
// PROMPTS.txt: one prompt per line, whitespace-separated decimal token ids (no BOS is added;
//              put it in the line if the model needs one). Empty lines are skipped.
//
// Options:
//   --n-gen N        greedy tokens to generate per prompt (default 32)
//   --all-logits     write the logits of every prompt position (OUT_DIR/logits_<i>.bin)
//   --topk K         write the top-K logits of every prompt position (default 0 = off)
//   --threads N      CPU threads (default 2)
//   --kv f32|f16|q8_0  KV cache type (default f32; q8_0 needs --fa)
//   --fa             flash attention on (default off; llama.cpp needs it for a quantised V cache)
//   --extra-bufts    allow ggml's extra CPU buffer types (weight repacking, AMX). Off by default:
//                    on CPUs that advertise AMX inside a sandbox that does not grant it, the AMX
//                    kernels die with SIGILL (seen on our 2-core Xeon machines).
//   --dump FILE      write every f32 tensor of the graph of the FIRST llama_decode call (prompt 0)
//                    to FILE, in evaluation order: per tensor u32 name length, the name, 4 x i64
//                    ne, then ne0*ne1*ne2*ne3 f32 values (ne0 fastest). For finding the first op
//                    where another implementation parts from llama.cpp bit for bit.
//
// For prompt i (0-based, in file order) it writes into OUT_DIR:
//   logits_<i>.bin     (--all-logits) f32 little-endian, shape [n_prompt, n_vocab], row = position
//   last_<i>.bin       f32 little-endian, shape [n_vocab]: logits of the last prompt position
//   topk_ids_<i>.bin   (--topk K) i32 little-endian, shape [n_prompt, K], ids by descending logit
//                      (ties: lower id first)
//   topk_vals_<i>.bin  (--topk K) f32 little-endian, shape [n_prompt, K], the matching logits
//   gen_<i>.txt        the N greedy ids, space separated, one line
// and OUT_DIR/info.txt with "n_vocab <V>" and the model description.
//
// Method: the whole prompt is ONE llama_decode call (n_batch = n_ubatch >= longest prompt,
// output requested for every position), one sequence (seq 0, positions 0..n-1). Greedy decode:
// token t_0 = argmax of the last prompt row; then each t_k is decoded alone at position n+k-1
// reusing the KV cache, t_{k+1} = argmax of its logits. argmax is over the full vocabulary, the
// first (lowest) id wins a tie, end-of-generation tokens are NOT treated specially (no stopping).
// The memory (KV cache) is cleared between prompts. CPU only, flash attention off unless --fa.

#include "llama.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t *ids;
    int n;
} prompt_t;

static void die(const char *msg) {
    fprintf(stderr, "llama_ref: %s\n", msg);
    exit(1);
}

static void quiet_log(enum ggml_log_level level, const char *text, void *ud) {
    (void)ud;
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

static prompt_t *read_prompts(const char *path, int *n_prompts) {
    FILE *f = fopen(path, "r");
    if (!f) die("cannot open prompts file");
    prompt_t *ps = NULL;
    int np = 0;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) >= 0) {
        int32_t *ids = NULL;
        int n = 0, icap = 0;
        char *p = line;
        for (;;) {
            while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == ',') p++;
            if (!*p) break;
            char *end;
            errno = 0;
            long v = strtol(p, &end, 10);
            if (end == p || errno) die("bad token id in prompts file");
            if (n == icap) {
                icap = icap ? icap * 2 : 64;
                ids = realloc(ids, sizeof(int32_t) * icap);
            }
            ids[n++] = (int32_t)v;
            p = end;
        }
        if (n == 0) continue;
        ps = realloc(ps, sizeof(prompt_t) * (np + 1));
        ps[np].ids = ids;
        ps[np].n = n;
        np++;
    }
    free(line);
    fclose(f);
    *n_prompts = np;
    return ps;
}

static void write_file(const char *dir, const char *name, int idx, const void *data, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s_%d.bin", dir, name, idx);
    FILE *f = fopen(path, "wb");
    if (!f) die("cannot create output file");
    if (bytes && fwrite(data, 1, bytes, f) != bytes) die("short write");
    fclose(f);
}

static int argmax(const float *row, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (row[i] > row[best]) best = i;
    return best;
}

// top-k by descending value, ties -> lower id first. Simple insertion into a sorted k-list.
static void topk(const float *row, int n, int k, int32_t *ids, float *vals) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        float v = row[i];
        if (m == k && !(v > vals[k - 1])) continue;
        int j = (m < k) ? m++ : k - 1;
        while (j > 0 && v > vals[j - 1]) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        vals[j] = v;
        ids[j] = i;
    }
}

// --dump state: the file, and whether the first decode is still running.
static FILE *g_dump = NULL;
static int g_dump_on = 0;

static bool dump_cb(struct ggml_tensor *t, bool ask, void *ud) {
    (void)ud;
    if (ask) return g_dump_on;
    if (!g_dump_on || t->type != GGML_TYPE_F32 || t->data == NULL) return true;
    const char *name = ggml_get_name(t);
    uint32_t nl = (uint32_t)strlen(name);
    int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
    fwrite(&nl, 4, 1, g_dump);
    fwrite(name, 1, nl, g_dump);
    fwrite(ne, 8, 4, g_dump);
    // element by element through the strides: views and permutes are not contiguous
    for (int64_t i3 = 0; i3 < ne[3]; i3++)
        for (int64_t i2 = 0; i2 < ne[2]; i2++)
            for (int64_t i1 = 0; i1 < ne[1]; i1++)
                for (int64_t i0 = 0; i0 < ne[0]; i0++) {
                    const char *e = (const char *)t->data + i0 * t->nb[0] + i1 * t->nb[1] +
                                    i2 * t->nb[2] + i3 * t->nb[3];
                    fwrite(e, 4, 1, g_dump);
                }
    return true;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPTS.txt OUT_DIR [--n-gen N] [--all-logits] "
                        "[--topk K] [--threads N] [--kv f32|f16|q8_0] [--fa] [--extra-bufts] [--dump FILE]\n", argv[0]);
        return 2;
    }
    const char *model_path = argv[1], *prompts_path = argv[2], *out_dir = argv[3];
    int n_gen = 32, all_logits = 0, k = 0, n_threads = 2, extra_bufts = 0, fa = 0;
    enum ggml_type kv_type = GGML_TYPE_F32;
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "--n-gen") && i + 1 < argc) n_gen = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--all-logits")) all_logits = 1;
        else if (!strcmp(argv[i], "--topk") && i + 1 < argc) k = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) n_threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--extra-bufts")) extra_bufts = 1;
        else if (!strcmp(argv[i], "--fa")) fa = 1;
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc) {
            g_dump = fopen(argv[++i], "wb");
            if (!g_dump) die("cannot create the --dump file");
            g_dump_on = 1;
        }
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc) {
            i++;
            if (!strcmp(argv[i], "f32")) kv_type = GGML_TYPE_F32;
            else if (!strcmp(argv[i], "f16")) kv_type = GGML_TYPE_F16;
            else if (!strcmp(argv[i], "q8_0")) kv_type = GGML_TYPE_Q8_0;
            else die("--kv must be f32, f16 or q8_0");
        } else die("unknown option");
    }

    int n_prompts = 0;
    prompt_t *prompts = read_prompts(prompts_path, &n_prompts);
    if (n_prompts == 0) die("no prompts");
    int max_len = 0;
    for (int i = 0; i < n_prompts; i++)
        if (prompts[i].n > max_len) max_len = prompts[i].n;

    llama_log_set(quiet_log, NULL);
    llama_backend_init();

    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.use_extra_bufts = extra_bufts != 0;
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) die("model load failed");
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    struct llama_context_params cp = llama_context_default_params();
    int n_batch = max_len < 512 ? 512 : max_len;
    cp.n_ctx = (uint32_t)(((max_len + n_gen + 255) / 256) * 256);
    cp.n_batch = (uint32_t)n_batch;
    cp.n_ubatch = (uint32_t)n_batch;
    cp.n_seq_max = 1;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = kv_type;
    cp.type_v = kv_type;
    cp.offload_kqv = false;
    cp.op_offload = false;
    cp.no_perf = true;
    if (g_dump) {
        cp.cb_eval = dump_cb;
        cp.cb_eval_user_data = NULL;
    }
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("context init failed");

    {
        char desc[256], path[4096];
        llama_model_desc(model, desc, sizeof desc);
        snprintf(path, sizeof path, "%s/info.txt", out_dir);
        FILE *f = fopen(path, "w");
        if (!f) die("cannot write info.txt (does OUT_DIR exist?)");
        fprintf(f, "n_vocab %d\nmodel %s\nn_ctx %u\nn_batch %d\nkv %s\nthreads %d\nextra_bufts %d\n",
                n_vocab, desc, cp.n_ctx, n_batch, ggml_type_name(kv_type), n_threads, extra_bufts);
        if (fa) fprintf(f, "flash_attn 1\n");
        fclose(f);
    }

    struct llama_batch batch = llama_batch_init(n_batch, 0, 1);
    float *all = NULL;
    int32_t *tk_ids = NULL;
    float *tk_vals = NULL;

    for (int pi = 0; pi < n_prompts; pi++) {
        const prompt_t *pr = &prompts[pi];
        llama_memory_clear(llama_get_memory(ctx), true);

        batch.n_tokens = pr->n;
        for (int j = 0; j < pr->n; j++) {
            if (pr->ids[j] < 0 || pr->ids[j] >= n_vocab) die("token id out of range");
            batch.token[j] = pr->ids[j];
            batch.pos[j] = j;
            batch.n_seq_id[j] = 1;
            batch.seq_id[j][0] = 0;
            batch.logits[j] = 1;
        }
        if (llama_decode(ctx, batch) != 0) die("llama_decode (prompt) failed");
        if (g_dump_on) {
            g_dump_on = 0;
            fclose(g_dump);
        }

        if (all_logits) all = realloc(all, sizeof(float) * (size_t)pr->n * n_vocab);
        if (k > 0) {
            tk_ids = realloc(tk_ids, sizeof(int32_t) * (size_t)pr->n * k);
            tk_vals = realloc(tk_vals, sizeof(float) * (size_t)pr->n * k);
        }
        for (int j = 0; j < pr->n; j++) {
            const float *row = llama_get_logits_ith(ctx, j);
            if (!row) die("no logits for a prompt position");
            if (all_logits) memcpy(all + (size_t)j * n_vocab, row, sizeof(float) * n_vocab);
            if (k > 0) topk(row, n_vocab, k, tk_ids + (size_t)j * k, tk_vals + (size_t)j * k);
        }
        const float *last = llama_get_logits_ith(ctx, pr->n - 1);
        write_file(out_dir, "last", pi, last, sizeof(float) * n_vocab);
        if (all_logits) write_file(out_dir, "logits", pi, all, sizeof(float) * (size_t)pr->n * n_vocab);
        if (k > 0) {
            write_file(out_dir, "topk_ids", pi, tk_ids, sizeof(int32_t) * (size_t)pr->n * k);
            write_file(out_dir, "topk_vals", pi, tk_vals, sizeof(float) * (size_t)pr->n * k);
        }

        // greedy decode, one token per llama_decode, KV cache reused
        int32_t *gen = malloc(sizeof(int32_t) * (n_gen > 0 ? n_gen : 1));
        int tok = argmax(last, n_vocab);
        for (int g = 0; g < n_gen; g++) {
            gen[g] = tok;
            if (g + 1 == n_gen) break;
            batch.n_tokens = 1;
            batch.token[0] = tok;
            batch.pos[0] = pr->n + g;
            batch.n_seq_id[0] = 1;
            batch.seq_id[0][0] = 0;
            batch.logits[0] = 1;
            if (llama_decode(ctx, batch) != 0) die("llama_decode (generation) failed");
            tok = argmax(llama_get_logits_ith(ctx, 0), n_vocab);
        }
        char path[4096];
        snprintf(path, sizeof path, "%s/gen_%d.txt", out_dir, pi);
        FILE *f = fopen(path, "w");
        if (!f) die("cannot write gen file");
        for (int g = 0; g < n_gen; g++) fprintf(f, g ? " %d" : "%d", gen[g]);
        fputc('\n', f);
        fclose(f);
        free(gen);
        fprintf(stderr, "llama_ref: prompt %d: %d tokens, %d generated\n", pi, pr->n, n_gen);
    }

    llama_batch_free(batch);
    free(all);
    free(tk_ids);
    free(tk_vals);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    for (int i = 0; i < n_prompts; i++) free(prompts[i].ids);
    free(prompts);
    return 0;
}
