/* A minimal NVTX v3 injection library (the role Nsight Systems plays), for tests: it takes
 * the client's CORE function table through the export-table protocol, installs
 * RangePushA / RangePop / MarkA, and appends one line per event to the file named by
 * NVTX_FAKE_TOOL_LOG ("push <depth> <name>", "pop <depth>", "mark <name>").
 * Build: cc -shared -fPIC -o libnvtx_fake_tool.so tests_c/nvtx_fake_tool.c
 * Use:   NVTX_INJECTION64_PATH=$PWD/libnvtx_fake_tool.so NVTX_FAKE_TOOL_LOG=/tmp/log ... */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*fnptr)(void);
typedef const void *(*get_export_table_t)(uint32_t);
typedef struct {
  size_t struct_size;
  int (*get_module_function_table)(uint32_t module, fnptr ***out_table, unsigned int *out_size);
} callbacks_t;

static FILE *log_file;
static __thread int depth;

static void emit(const char *what, const char *name) {
  if (!log_file) return;
  if (name)
    fprintf(log_file, "%s %d %s\n", what, depth, name);
  else
    fprintf(log_file, "%s %d\n", what, depth);
  fflush(log_file);
}
static int push_a(const char *m) { ++depth; emit("push", m); return depth - 1; }
static int pop(void) { emit("pop", NULL); return --depth; }
static void mark_a(const char *m) { emit("mark", m); }

int InitializeInjectionNvtx2(get_export_table_t get) {
  const char *path = getenv("NVTX_FAKE_TOOL_LOG");
  log_file = path ? fopen(path, "a") : NULL;
  const callbacks_t *cb = (const callbacks_t *)get(1); /* NVTX_ETID_CALLBACKS */
  if (!cb || cb->struct_size < sizeof(callbacks_t)) return 0;
  fnptr **table = NULL;
  unsigned int size = 0;
  if (!cb->get_module_function_table(1 /* CORE */, &table, &size) || size < 12) return 0;
  *table[2] = (fnptr)mark_a;  /* NVTX_CBID_CORE_MarkA */
  *table[9] = (fnptr)push_a;  /* NVTX_CBID_CORE_RangePushA */
  *table[11] = (fnptr)pop;    /* NVTX_CBID_CORE_RangePop */
  if (log_file) { fprintf(log_file, "init core_size %u\n", size); fflush(log_file); }
  return 1;
}
