/* The firewall holds at teardown and with debug printing (no GPU needed):
 * - entry points called from an atexit handler and from a thread-key destructor, on
 *   threads that already used the library (their thread-locals are destroyed by then),
 *   report errors instead of aborting the process;
 * - with NVTE_COMM_DEBUG=1, SIGPIPE ignored and stderr a pipe nobody reads, a recorded
 *   error is still reported, not an abort.
 * The process must exit 0 and print its closing line last, from the atexit handler. */
#define _POSIX_C_SOURCE 200809L
#include "transformer_engine_comm.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int passed = 0, failed = 0;
static FILE *out; /* stdout duplicated before stderr is redirected */

#define CHECK(cond, what)                                                       \
  do {                                                                          \
    if (cond) {                                                                 \
      ++passed;                                                                 \
    } else {                                                                    \
      ++failed;                                                                 \
      fprintf(out, "FAIL %s:%d: %s [last error: %s]\n", __FILE__, __LINE__,     \
              what, nvte_comm_last_error());                                    \
    }                                                                           \
  } while (0)

static NVTETensor at_exit_tensor;
static pthread_key_t key;
static int key_destructor_ran = 0;

/* A use of the library after a failed call: the status and message must be recorded. */
static void use_library(const char *where) {
  size_t dims[2] = {4, 8};
  NVTETensor t = NULL;
  NVTECommStatus s = nvte_comm_tensor_create_simple((void *)0x1000, kNVTEBFloat16, dims, 2, &t);
  CHECK(s == NVTE_COMM_SUCCESS && t != NULL, where);
  nvte_destroy_tensor(t);
  CHECK(nvte_comm_last_status() == NVTE_COMM_SUCCESS, where);
  nvte_destroy_tensor(t); /* already destroyed: an error, recorded */
  CHECK(nvte_comm_last_status() == NVTE_COMM_ERROR_INVALID_ARGUMENT, where);
  CHECK(strstr(nvte_comm_last_error(), "nvte_destroy_tensor") != NULL, where);
}

static void key_destructor(void *v) {
  (void)v;
  key_destructor_ran = 1;
  use_library("thread-key destructor");
}

static void *worker(void *arg) {
  (void)arg;
  use_library("worker thread");
  pthread_setspecific(key, (void *)1); /* destructor runs after this thread's TLS teardown began */
  return NULL;
}

static void bye(void) {
  nvte_destroy_tensor(at_exit_tensor);
  CHECK(nvte_comm_last_status() == NVTE_COMM_SUCCESS, "atexit: destroy a live tensor");
  use_library("atexit handler");
  CHECK(key_destructor_ran == 1, "the thread-key destructor ran");
  CHECK(nvte_comm_live_tensor_count() == 0, "no tensor left");
  fprintf(out, "test_teardown: %d passed, %d failed\n", passed, failed);
  fflush(out);
  if (failed) _exit(1);
}

int main(void) {
  out = fdopen(dup(1), "w");
  if (!out) return 2;
  at_exit_tensor = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  CHECK(at_exit_tensor != NULL, "create a tensor for the atexit handler");
  atexit(bye);

  pthread_key_create(&key, key_destructor);
  pthread_t th;
  pthread_create(&th, NULL, worker, NULL);
  pthread_join(th, NULL);

  /* Debug printing into a pipe nobody reads, with SIGPIPE ignored (as CPython does). */
  signal(SIGPIPE, SIG_IGN);
  int fds[2];
  if (pipe(fds) != 0) return 2;
  close(fds[0]);
  dup2(fds[1], 2);
  setenv("NVTE_COMM_DEBUG", "1", 1);
  use_library("debug printing into a closed pipe");
  return 0; /* the closing line comes from bye() */
}
